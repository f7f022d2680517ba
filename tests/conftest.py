"""Setup shared by every test module: environment, compilation cache, fixtures."""

import collections
import json
import os
import re
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
# tiny), so LLVM runs at -O0 without its expensive passes, which compiles about
# a third faster than -O1 (BUILD_NOTES.md, "Running the tests"). An explicit
# level in XLA_FLAGS wins.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true").strip()

# Importing Pallas's fuser adds a setting to JAX's trace context; imported
# lazily by a test's first kernel, it would make every function jitted before
# that trace again. Imported here, before any test traces.
import jax.experimental.pallas.fuser  # pylint: disable=unused-import,g-import-not-at-top

_CACHE_ENV = "PROBJAX_HK_TEST_COMPILE_CACHE"

# The tests a JAX release can break, marked `jax_release`; `make test` runs
# them again on the second JAX version (Makefile: test-jax-next). A test is in
# the set when (1) its file exercises one of JAX's moving parts as a whole, one
# file per mechanism (lowering, per-shard kernels, the sequence passes of the
# recurrences and the ring's permutes, expert-parallel exchange, fit on a mesh,
# several processes, checkpoints, the README's examples, the wheel's install),
# (2) it uses the `hopper_lowering` fixture (a Triton or Mosaic GPU lowering),
# or (3) it is listed below: each kernel's one interpret-mode numerics test
# against its reference (a new kernel adds its own), and the multi-device or
# lowering tests that share a file with others. On the first version only: what
# composes a mechanism checked here (the models' sharding, tests/models/
# test_sharding.py, composes the ops'; the other recurrences' sequence splits
# share ssd's pass, ops/_sequence_parallel.py) and the docs pages' examples
# (the public calls the README's examples make, at more length).
_JAX_RELEASE_FILES = frozenset(f"tests/{path}" for path in (
    "ops/test_triton_lowering.py", "ops/test_shared_lowering.py", "ops/test_shard_map.py",
    "ops/test_sharding.py", "ops/test_ssd_sequence_parallel.py",
    "ops/test_flex_attention_ring.py", "models/test_moe_sharding.py",
    "training/test_sharding.py", "training/test_fit_sharding.py",
    "training/test_multiprocess.py", "training/test_checkpoints.py", "test_readme.py",
    "test_packaging.py"))
_JAX_RELEASE_TESTS = frozenset(f"tests/{test}" for test in (
    "ops/test_flex_attention.py::test_kernel_matches_reference[causal_t17_h32_f32]",
    "ops/test_flex_attention_mosaic.py::test_forward_and_gradients_match_reference"
    "[window_both_sides_lengths_h32_bf16]",
    "ops/test_flex_attention_mosaic_backward.py::test_gradients_match_reference"
    "[cross_padded_h128_f16-dq_column_chunks_2]",
    "ops/test_decode_attention.py::test_kernel_matches_reference[t1_gqa_bf16]",
    "ops/test_ssd.py::test_matches_reference[1-None-float32-dims2-True-pallas]",
    "ops/test_gated_delta_rule.py::test_matches_reference[1-None-float32-None-True-None-pallas]",
    "ops/test_gated_delta_rule_mosaic.py::test_op_with_the_mosaic_walk_matches_reference",
    "ops/test_gated_delta_rule_mosaic_grads.py::test_op_with_the_mosaic_gradients_matches_reference",
    "ops/test_gated_delta_rule_mosaic_key_grads.py::"
    "test_op_with_the_mosaic_key_gradients_matches_reference",
    "ops/test_grouped_matmul.py::test_float32_values_and_grads[pallas_small_blocks-all_in_last]",
    "ops/test_grouped_matmul_mosaic.py::test_grouped_matmul_values_and_gradients",
    "ops/test_grouped_matmul_mosaic_tgmm.py::test_tgmm_matches_per_group_products[whole_tiles]",
    "ops/test_grouped_mlp.py::test_kernel_float32_values_and_grads[swiglu-mixed_with_empty]",
    "ops/test_linear_scan.py::test_matches_reference[pallas-complex64-1-False-True-None]",
    "ops/test_selective_scan.py::test_matches_reference[pallas-float32-1-False-False-None]",
    "ops/test_grouped_matmul_mosaic_tgmm.py::test_lowers_to_mosaic_gpu_for_hopper",
    "ops/test_decode_attention.py::test_runs_per_shard_on_a_mesh",
    "ops/test_names.py::test_flex_key_value_seq_lengths_run_per_shard",
    "ops/test_names.py::test_a_misplaced_length_array_is_named",
    "training/test_load_checkpoint.py::test_fsdp_checkpoint_loads_onto_a_mesh_or_one_device",
))


def pytest_configure(config):
  """One persistent compilation cache per test run, shared by the xdist
  workers and every subprocess a test starts: tests build many identical
  programs (the same reference at the same shapes, from new closures), and the
  cache keys on the program, so each is compiled once per run. The first
  process (the xdist controller, or the only one) makes the directory and
  exports it as JAX_COMPILATION_CACHE_DIR, which workers and subprocesses
  inherit. A fresh directory each run, unless the run is given one to keep
  in PROBJAX_HK_TEST_COMPILE_CACHE (`make test TEST_CACHE=DIR`, as CI does).
  A cache directory of the user's (JAX_COMPILATION_CACHE_DIR) is left
  alone."""
  config.addinivalue_line(
      "markers", "jax_release: a test a JAX release can break (tests/conftest.py says which)")
  if _CACHE_ENV not in os.environ:
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
      return
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="probjax_hk_jax_cache_")
    config._probjax_hk_cache_owner = True
  # As environment variables, read when JAX is imported (subprocesses), and as
  # config for this process, which may have imported JAX already.
  os.environ.update(JAX_COMPILATION_CACHE_DIR=os.environ[_CACHE_ENV],
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  import jax
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Each test file's seconds in the last run that kept its compilation cache
# (`make test TEST_CACHE=DIR`), one record per marker selection: the next run
# hands out the longest files first, so the two xdist workers finish together
# (`--dist loadfile` deals whole files in collection order, the Makefile's
# `--no-loadscope-reorder` keeps that order). Without a record: path order.
_file_seconds = collections.Counter()


def _seconds_record(config):
  cache = os.environ.get(_CACHE_ENV)
  if not cache:
    return None
  selection = re.sub(r"\W+", "_", config.getoption("markexpr") or "all")
  return os.path.join(cache, f"file_seconds_{selection}.json")


def pytest_runtest_logreport(report):
  _file_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session):
  """Writes the record (the xdist controller, or the only process)."""
  path = _seconds_record(session.config)
  if path is None or hasattr(session.config, "workerinput") or not _file_seconds:
    return
  try:
    with open(path) as f:
      seconds = json.load(f)
  except (OSError, ValueError):
    seconds = {}
  seconds.update(_file_seconds)
  with open(path + ".tmp", "w") as f:
    json.dump(seconds, f, indent=0, sort_keys=True)
  os.replace(path + ".tmp", path)


def pytest_unconfigure(config):
  if getattr(config, "_probjax_hk_cache_owner", False):
    shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


def pytest_collection_modifyitems(config, items):
  """Marks the `jax_release` tests. When they are selected (`-m jax_release`),
  a listed test that is not collected is an error, so a rename cannot drop a
  kernel's check from the second JAX version silently. Orders the files by
  the record's seconds, longest first (a stable sort: a file's tests stay
  together and in order)."""
  collected = set()
  for item in items:
    path = item.nodeid.split("::")[0]
    collected.add(item.nodeid)
    if (path in _JAX_RELEASE_FILES or item.nodeid in _JAX_RELEASE_TESTS
        or "hopper_lowering" in getattr(item, "fixturenames", ())):
      item.add_marker(pytest.mark.jax_release)
  if "jax_release" in (config.getoption("markexpr") or ""):
    missing = sorted(_JAX_RELEASE_TESTS - collected)
    if missing:
      raise pytest.UsageError(
          "tests/conftest.py lists jax_release tests that were not collected: "
          + ", ".join(missing))
  path = _seconds_record(config)
  if path and os.path.exists(path):
    with open(path) as f:
      seconds = json.load(f)
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


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
