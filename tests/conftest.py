"""Setup shared by every test module: environment, compilation cache, fixtures."""

import os
import shutil
import tempfile
import types

import pytest

# XLA:CPU sizes its thread pool by the cores (2 on CI) unless PJRT_NPROC says
# otherwise. Mosaic GPU interpret mode runs a block's three warpgroups as
# threads whose barrier waits are host callbacks, and those callbacks run on
# that pool: with two threads, two waiting warpgroups starve the third, which
# would arrive, and the test hangs. Set before any test creates the CPU client.
os.environ.setdefault("PJRT_NPROC", "8")

# The suite's time is XLA:CPU's compile time (about 70 % of it: the shapes are
# tiny). LLVM at -O1 compiles about 15 % faster than the default level and the
# whole suite passes at both (BUILD_NOTES.md, "Running the tests"); at -O0
# XLA:CPU gives NaN in an ALiBi reference gradient, so not lower. An explicit
# level in XLA_FLAGS wins.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=1").strip()

_CACHE_ENV = "PROBJAX_HK_TEST_COMPILE_CACHE"


def pytest_configure(config):
  """One persistent compilation cache per test run, shared by the xdist
  workers: tests build many identical programs (the same reference at the
  same shapes, from new closures), and the cache keys on the program, so each
  is compiled once per run. The first process (the xdist controller, or the
  only one) makes the directory; workers inherit it through the environment.
  A fresh directory each run, so local runs time like CI's fresh clone. A
  cache directory of the user's (JAX_COMPILATION_CACHE_DIR) is left alone."""
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  if _CACHE_ENV not in os.environ:
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="probjax_hk_jax_cache_")
    config._probjax_hk_cache_owner = True
  import jax
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  if getattr(config, "_probjax_hk_cache_owner", False):
    shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


@pytest.fixture
def hopper_lowering(monkeypatch):
  """Lowering for a Hopper GPU (compute capability 9.0) on the CPU, without a
  GPU: JAX 0.11.2 (pinned) asks this module for the GPU's compute capability
  while lowering a Triton kernel, so we state the H200's; and the ops run
  their compiled kernel paths (interpret mode off)."""
  from jax._src.pallas.triton import pallas_call_registration as triton_registration
  from ops import _backend
  monkeypatch.setattr(triton_registration, "gpu_info_lib", types.SimpleNamespace(
      get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90)))
  monkeypatch.setattr(_backend, "pallas_interpret", lambda: False)
