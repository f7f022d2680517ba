"""The documentation site: its examples run, its API reference is complete, it builds.

Each page of the overview, the user guide and the contributors' page
(`docs/index.md`, `docs/guide/*.md`, `docs/contributing.md`) is a test: its Python examples run as written, in order, in
one namespace, on the CPU; the examples assert what their text promises. The
site itself builds with Sphinx and warnings as errors (what `make docs` runs)
when Sphinx, MyST and furo are installed (`pip install -e ".[docs]"`).
"""

import doctest
import glob
import importlib.util
import inspect
import os
import re
import subprocess
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import probjax_hk

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DOCS = os.path.join(_ROOT, "docs")
_PAGES = sorted([os.path.join(_DOCS, "index.md"), os.path.join(_DOCS, "contributing.md")]
                + glob.glob(os.path.join(_DOCS, "guide", "*.md")))
_AUTODOC = re.compile(r"^\.\. auto\w+:: ([\w.]+)$", re.M)


def _python_blocks(path):
  with open(path) as f:
    return re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)


@pytest.mark.parametrize("page", _PAGES, ids=lambda p: os.path.relpath(p, _DOCS))
def test_page_examples_run(page):
  blocks = _python_blocks(page)
  if not blocks:
    pytest.skip("the page has no Python examples")
  namespace = {}
  for i, block in enumerate(blocks):
    name = f"{os.path.relpath(page, _ROOT)}, Python example {i + 1}"
    exec(compile(block, name, "exec"), namespace)  # pylint: disable=exec-used


def test_api_reference_documents_every_public_name():
  documented = set()
  for page in glob.glob(os.path.join(_DOCS, "api", "*.md")):
    with open(page) as f:
      documented.update(_AUTODOC.findall(f.read()))
  public = ({f"probjax_hk.{name}" for name in probjax_hk.__all__}
            | {f"ops.{name}" for name in ops.__all__})
  assert not public - documented, (
      f"public names missing from docs/api/: {sorted(public - documented)}")


def _public_objects():
  """(name, object) of every public name of `probjax_hk`, `ops` and
  `probjax_hk.training`, and of the public methods of its classes."""
  for package, prefix in ((probjax_hk, "probjax_hk"), (ops, "ops"),
                          (probjax_hk.training, "probjax_hk.training")):
    for name in package.__all__:
      obj = getattr(package, name)
      yield f"{prefix}.{name}", obj
      if inspect.isclass(obj):
        for attr, member in vars(obj).items():
          if callable(member) and (not attr.startswith("_") or attr == "__call__"):
            yield f"{prefix}.{name}.{attr}", member


def test_docstring_examples_run():
  """The `>>>` examples of the public docstrings run and print what they show."""
  finder = doctest.DocTestFinder(recurse=False)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  names = {"hk": hk, "jax": jax, "jnp": jnp, "np": np, "ops": ops, "pk": probjax_hk}
  tested = []
  for name, obj in _public_objects():
    for test in finder.find(obj, name, globs=dict(names)):
      if test.examples:
        tested.append(name)
        runner.run(test)
  assert "ops.flex_attention" in tested, tested  # the examples were found
  failed, attempted = runner.summarize(verbose=False)
  assert not failed, f"{failed} of {attempted} docstring examples failed (output above)"


def test_site_builds_without_warnings(tmp_path):
  missing = [m for m in ("sphinx", "myst_parser", "furo") if importlib.util.find_spec(m) is None]
  if missing:
    pytest.skip(f"{', '.join(missing)} not installed: pip install -e '.[docs]' to build the site")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
       "-d", str(tmp_path / "doctrees"), _DOCS, str(tmp_path / "html")],
      capture_output=True, text=True, env=env, cwd=_ROOT, timeout=600)
  assert run.returncode == 0, f"sphinx-build failed:\n{run.stdout}\n{run.stderr}"
  api_pages = [os.path.splitext(os.path.basename(p))[0]
               for p in glob.glob(os.path.join(_DOCS, "api", "*.md"))]
  for page in ["index", "guide/attention", "performance/index"] + [f"api/{p}" for p in api_pages]:
    assert (tmp_path / "html" / f"{page}.html").is_file(), page
