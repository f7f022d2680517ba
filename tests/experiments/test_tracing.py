"""experiments.tracing (what benchmark_fit's traced rows report): per-kernel
device times from a trace (on the CPU the XLA ops stand in for kernels), and
the busy-time union."""

import jax
import jax.numpy as jnp

from experiments import tracing


def test_busy_time_is_the_union_of_intervals():
  events = [("a", 0, 10), ("b", 5, 10), ("c", 30, 5), ("d", 31, 1)]
  assert tracing.busy_ns(events) == 15 + 5
  assert tracing.busy_ns([]) == 0


def test_profile_reports_the_kernels_of_a_call():
  fn = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  result = tracing.profile(fn, (jnp.ones((128, 128)),), calls=3)
  assert result["kernels"], "the trace must show the call's ops"
  assert result["wall_us"] > 0 and result["busy_us"] > 0
  shares = [k["share"] for k in result["kernels"]]
  assert abs(sum(shares) - 1.0) < 1e-6 and shares == sorted(shares, reverse=True)
  assert all(k["launches"] > 0 for k in result["kernels"])
