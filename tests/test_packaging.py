"""The wheel built from this repository installs beside the user's JAX and
serves the public API.

`python -m build` runs without build isolation (the backend, setuptools, comes
with the test extra, so no network is needed) on a copy of the files a build
reads, so the working tree gets no build/ or egg-info writes and a stale
egg-info cannot leak into the sdist. The wheel is installed, with dependency
resolution but no index, into a fresh venv that sees this interpreter's
packages through a .pth file: pip must find every requirement already
satisfied (whatever JAX this environment has: 0.11.2 or 0.12.x in CI) and
install the wheel alone. The public API is then imported from a directory
outside the repository, so the installed copy is the one found.
"""

import importlib.metadata
import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import tarfile
import textwrap
import tomllib
import zipfile

import probjax_hk

_REPO = pathlib.Path(__file__).resolve().parent.parent
_PACKAGES = ("probjax_hk", "ops")
# The repository's absl programs: never installed (`experiments` is also
# another project's name on PyPI).
_NOT_INSTALLED = ("experiments",)


def _copy_sources(dest: pathlib.Path) -> None:
  """The repository's top-level files and its Python package folders."""
  dest.mkdir()
  for entry in _REPO.iterdir():
    if entry.is_file():
      shutil.copy2(entry, dest / entry.name)
  for name in _PACKAGES + ("experiments",):
    shutil.copytree(_REPO / name, dest / name,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _source_modules(name: str) -> set[str]:
  """Dotted names of every module under the repository's package `name`."""
  modules = set()
  for path in (_REPO / name).rglob("*.py"):
    parts = path.relative_to(_REPO).with_suffix("").parts
    modules.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
  return modules


def _run(args, **kwargs) -> subprocess.CompletedProcess:
  proc = subprocess.run(args, capture_output=True, text=True, **kwargs)
  assert proc.returncode == 0, (
      f"{args[:4]} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
  return proc


def test_wheel_installs_and_serves_the_public_api(tmp_path):
  src, dist = tmp_path / "src", tmp_path / "dist"
  _copy_sources(src)
  # Both artifacts; the wheel is built from the unpacked sdist, so the sdist
  # is checked to be complete as well.
  _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
       cwd=tmp_path)
  wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
  assert len(wheels) == 1 and len(sdists) == 1, sorted(os.listdir(dist))

  with zipfile.ZipFile(wheels[0]) as whl:
    names = whl.namelist()
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    metadata = whl.read(f"{dist_info}/METADATA").decode()
  top_level = {n.split("/")[0] for n in names}
  assert top_level == set(_PACKAGES) | {dist_info}, top_level
  assert f"{dist_info}/licenses/LICENSE" in names
  # The measured dispatch tables the defaults read.
  tables = {p.relative_to(_REPO).as_posix() for p in (_REPO / "ops/dispatch_tables").glob("*.json")}
  assert tables and tables <= set(names), sorted(tables - set(names))
  for field in ("License-Expression: Apache-2.0", "Description-Content-Type: text/markdown",
                "Requires-Python: >=3.12"):
    assert field in metadata, field
  # The long description is the README.
  readme = (_REPO / "README.md").read_text()
  assert readme.strip() in metadata
  with tarfile.open(sdists[0]) as sdist:
    members = {m.split("/", 1)[1] for m in sdist.getnames() if "/" in m}
  assert {"LICENSE", "README.md", "pyproject.toml"} <= members, sorted(members)

  # A venv of its own, seeing this interpreter's site-packages (jax, haiku,
  # ...) after its own: a .pth line adds a folder without running the .pth
  # files in it, so an editable install of the repository stays invisible.
  venv = tmp_path / "venv"
  _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
  python = venv / "bin" / "python"
  venv_site = pathlib.Path(_run(
      [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
  ).stdout.strip())
  outer = [p for p in site.getsitepackages() if os.path.isdir(p)]
  (venv_site / "_outer_site_packages.pth").write_text("\n".join(outer) + "\n")

  report = tmp_path / "report.json"
  _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
        "--disable-pip-version-check", "--report", str(report), str(wheels[0])])
  installed = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
  assert installed == ["probjax_hk"], f"pip would also install {installed}"

  check = textwrap.dedent(f"""
      import importlib, importlib.metadata, importlib.util, json, os, pkgutil, sys
      site_dir = {str(venv_site)!r}
      found = {{}}
      for name in {_PACKAGES!r}:
        package = importlib.import_module(name)
        assert package.__file__.startswith(site_dir), (name, package.__file__)
        missing = [n for n in package.__all__ if not hasattr(package, n)]
        assert not missing, (name, missing)
        found[name] = [name] + [m.name for m in pkgutil.walk_packages(
            package.__path__, name + ".")]
        for module in found[name]:
          importlib.import_module(module)
      not_installed = [n for n in {_NOT_INSTALLED!r} if importlib.util.find_spec(n)]
      from ops import _measured
      assert _measured.load("attention")["devices"], "the installed tables are not found"
      meta = importlib.metadata.metadata("probjax_hk")
      print(json.dumps({{"modules": found, "not_installed": not_installed,
                        "license": meta["License-Expression"],
                        "version": importlib.import_module("probjax_hk").__version__}}))
  """)
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
  env["JAX_PLATFORMS"] = "cpu"
  outside = tmp_path / "elsewhere"
  outside.mkdir()
  result = json.loads(_run([str(python), "-c", check], cwd=outside, env=env).stdout)
  for name in _PACKAGES:
    assert set(result["modules"][name]) == _source_modules(name), name
  assert result["not_installed"] == [], result["not_installed"]
  assert result["license"] == "Apache-2.0"
  assert result["version"] == _pyproject_version()


def _pyproject_version() -> str:
  with open(_REPO / "pyproject.toml", "rb") as f:
    return tomllib.load(f)["project"]["version"]


def test_version_comes_from_the_package_metadata(monkeypatch):
  # This environment's install (editable in CI) has pyproject's version.
  assert probjax_hk.__version__ == _pyproject_version()

  def not_installed(name):
    raise importlib.metadata.PackageNotFoundError(name)

  monkeypatch.setattr(importlib.metadata, "version", not_installed)
  assert probjax_hk._installed_version() == "0+unknown"  # pylint: disable=protected-access


def test_setup_py_shim_reads_pyproject():
  # Tools that still call `python setup.py` see pyproject's name and version.
  out = subprocess.run([sys.executable, "setup.py", "--name", "--version"], cwd=_REPO,
                       capture_output=True, text=True, check=True).stdout.split()
  assert out[-2:] == ["probjax_hk", _pyproject_version()]
