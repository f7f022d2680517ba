"""What docs/contributing.md says of the house holds: the picture is drawn
from today's imports, every op has the same rooms and a registry, the models
use only the ops' public names, and every cell is an SSMCell."""

import ast
import importlib
import inspect
import pathlib
import re
import subprocess

import pytest

from experiments import architecture
from ops import registry
import probjax_hk
from probjax_hk.ssm import SSMCell

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_OPS = sorted(p.parent.name for p in (_ROOT / "ops").glob("*/api.py"))


def test_the_architecture_picture_is_drawn_from_todays_imports():
  drawn = (_ROOT / "docs" / "architecture.svg").read_text()
  assert drawn == architecture.render(architecture.imports()), (
      "docs/architecture.svg is out of date: python -m experiments.architecture")


def test_models_import_only_the_ops_public_names():
  found = subprocess.run(
      ["git", "grep", "-n", r"from ops import _\|ops\.[a-z_]*\.reference\|ops\._", "--",
       "probjax_hk"], cwd=_ROOT, capture_output=True, text=True).stdout
  assert not found, found


@pytest.mark.parametrize("op", _OPS)
def test_every_op_has_the_same_rooms_and_a_registry(op):
  folder = _ROOT / "ops" / op
  for name in ("__init__.py", "api.py", "reference.py"):
    assert (folder / name).is_file(), f"ops/{op}/ has no {name}"
  package = importlib.import_module(f"ops.{op}")
  implementations = package.IMPLEMENTATIONS
  assert isinstance(implementations, registry.Registry)
  if [*folder.glob("pallas.py"), *folder.glob("triton*.py"), *folder.glob("mosaic*.py")]:
    for name in ("configs.py", "tuned.json"):
      assert (folder / name).is_file(), f"ops/{op}/ has kernels but no {name}"
  for path in folder.glob("*.py"):  # tiles are data: no tuning table in code
    assert not re.search(r"^_TABLE\s*=", path.read_text(), re.M), path


def _imported_modules(path):
  """The dotted names a file imports: `from a.b import c` gives `a.b` and `a.b.c`."""
  tree = ast.parse(path.read_text())
  names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
  for n in ast.walk(tree):
    if isinstance(n, ast.ImportFrom) and n.module:
      names += [n.module] + [f"{n.module}.{a.name}" for a in n.names]
  return [n for n in names if n.startswith("ops.")]


@pytest.mark.parametrize("op", [op for op in _OPS if (_ROOT / "ops" / op / "configs.py").is_file()])
def test_configurations_import_no_kernel(op):
  """Kernel files import their configurations, never the reverse."""
  names = _imported_modules(_ROOT / "ops" / op / "configs.py")
  kernel = re.compile(r"\.(pallas|mosaic\w*|triton\w*)$")
  assert not [n for n in names if kernel.search(n)], names


@pytest.mark.parametrize("op", _OPS)
def test_backends_import_not_each_other(op):
  """Triton files import no Mosaic GPU module (of any op) and Mosaic GPU files no
  Triton module, nor either an op's `pallas.py`, which combines the two."""
  for backend, other in (("triton", "mosaic"), ("mosaic", "triton")):
    for path in (_ROOT / "ops" / op).glob(f"{backend}*.py"):
      names = _imported_modules(path)
      found = [n for n in names if re.search(rf"\._?{other}\w*$|\.pallas$", n)]
      assert not found, f"ops/{op}/{path.name} imports {found}"


def test_every_cell_is_an_ssm_cell():
  cells = [obj for name, obj in vars(probjax_hk).items()
           if name.endswith("Cell") and inspect.isclass(obj)]
  assert len(cells) >= 5
  for cell in cells:
    assert issubclass(cell, SSMCell), cell
