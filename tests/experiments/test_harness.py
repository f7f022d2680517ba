"""experiments.harness.run_case: a row per case, timing samples of
back-to-back calls, carried outputs, failures as rows; the environment a run
records."""

import importlib.metadata

import jax
import jax.numpy as jnp

from experiments import harness


def test_samples_batch_fast_calls_and_report_per_call_time():
  row = harness.run_case({"case": "add"}, lambda: (lambda x: x + 1, (jnp.ones(4),)),
                         iters=3, sample_ms=2.0)
  assert row["status"] == "ok" and row["case"] == "add"
  assert row["calls_per_sample"] > 1          # a microsecond call is batched
  assert 0 < row["min_ms"] <= row["median_ms"]
  assert 0 < row["lower_s"] <= row["compile_s"]  # compile_s includes the lowering


def test_sample_ms_zero_syncs_every_call():
  row = harness.run_case({}, lambda: (lambda x: x * 2, (jnp.ones(4),)),
                         iters=2, sample_ms=0.0)
  assert row["calls_per_sample"] == 1


def test_a_slow_call_still_gets_several_calls_per_sample():
  # 5 ms per call against a 2 ms sample: one call would fill it, but a sample
  # of one call adds the dispatch and the sync to the time.
  import time as time_lib
  slow = lambda x: jax.pure_callback(lambda v: (time_lib.sleep(0.005), v)[1], x, x)
  row = harness.run_case({}, lambda: (slow, (jnp.ones(4),)), iters=2, sample_ms=2.0)
  assert row["status"] == "ok"
  assert row["calls_per_sample"] == harness.MIN_CALLS_PER_SAMPLE


def test_carried_outputs_feed_the_next_call():
  # The step donates its first argument: reusing it instead of the carried
  # output would read a deleted buffer.
  step = jax.jit(lambda count, x: (count + 1, x), donate_argnums=0)
  build = lambda: (step, (jnp.zeros(()), jnp.ones(2)))
  assert harness.run_case({}, build, iters=2, carry_outputs=1)["status"] == "ok"
  assert harness.run_case({}, build, iters=2, carry_outputs=0)["status"] != "ok"


def test_a_failing_case_becomes_a_row():
  def build():
    raise RuntimeError("boom")
  row = harness.run_case({"case": "bad"}, build)
  assert row["status"] in ("error", "fail") and "boom" in row["message"]


def test_environment_records_the_gpu_stack_or_none():
  env = harness.environment()
  assert env["jaxlib"] == importlib.metadata.version("jaxlib")
  assert env["jax"] == jax.__version__
  # The GPU fields are always there, None off a GPU (never left out: a
  # missing field means a run from before they were recorded).
  on_gpu = jax.devices()[0].platform == "gpu"
  for field in ("gpu", "compute_capability", "driver", "cuda", "cuda_driver", "cudnn"):
    assert field in env, field
    assert on_gpu or env[field] is None, (field, env[field])
