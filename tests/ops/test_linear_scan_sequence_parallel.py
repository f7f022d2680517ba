"""ops.linear_scan with its time axis split over a mesh (context parallelism).

On 8 simulated CPU devices (one subprocess for the file), with the sequence
split 8 ways and on a 2 x 4 (batch x sequence) mesh of Explicit axes: the
outputs, final state and gradients equal one device's; each device's scan
runs on its own T / n steps; and the compiled forward and fwd+bwd programs
communicate only [n, B, D]-sized arrays (no collective carries a chunk of the
sequence, no array on a device spans more than its chunk).
"""

import pytest

from tests import simulated_devices

B, T, D = 2, 128, 3
CHUNK = T // 8  # time steps per device with the sequence split 8 ways

_SCRIPT = r'''
import json
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import ops
from ops.linear_scan import api
from tests.ops.compiled_programs import compile_and_run, longest_axis, max_err, record_shapes

assert jax.device_count() == 8, jax.devices()
B, T, D = 2, 128, 3
out = {}

# The [B, t, D] shapes the XLA implementation is traced with.
seen = record_shapes(api, "linear_scan_xla", "b")

keys = jax.random.split(jax.random.key(0), 4)
a = jax.random.uniform(keys[0], (B, T, D), minval=0.6, maxval=0.99)
b = jax.random.normal(keys[1], (B, T, D))
h0 = jax.random.normal(keys[2], (B, D))
phase = jnp.exp(1j * jax.random.uniform(keys[3], (D,), maxval=3.0))

seq8 = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Explicit,))
grid = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2)

# name: mesh, b's spec, implementation, reverse, initial state, a [D] complex.
CASES = {
    "seq8": (seq8, P(None, "seq"), "xla", False, True, False),
    "seq8_reverse_shared_complex_decay": (seq8, P(None, "seq"), "xla", True, False, True),
    "batch2_seq4": (grid, P("data", "seq"), "xla", False, True, False),
    "batch2_seq4_reverse": (grid, P("data", "seq"), "xla", True, True, False),
    "seq8_triton": (seq8, P(None, "seq"), "triton", False, True, False),
}
for name, (mesh, spec, impl, reverse, with_state, shared) in CASES.items():
  args = (a[0, 0] * phase, b * (1 + 0.5j), h0 + 0j) if shared else (a, b, h0)

  def scan(a, b, h0):
    return ops.linear_scan(a, b, initial_state=h0 if with_state else None, reverse=reverse,
                           implementation=impl)

  def loss(a, b, h0):
    h, final = scan(a, b, h0)
    return (jnp.sum(jnp.sin(jnp.real(h))) + jnp.sum(jnp.cos(jnp.imag(h)))
            + jnp.sum(jnp.real(final) * jnp.imag(final) + jnp.real(final)))

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  want = (jax.jit(scan)(*args), grad(*args))
  placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(
      args, (P() if shared else spec, spec, P(spec[0])))]
  seen.clear()
  got, facts = compile_and_run(mesh, scan, grad, placed)
  out[name] = {"err": max_err(got, want), "h_spec": list(got[0][0].sharding.spec),
               "scan_shapes": seen[:], **facts}

# The time axis on a size-1 mesh axis (data 8 x seq 1), complex: one chunk,
# nothing to exchange (jaxlib 0.11's CPU compiler crashed on the all-gather).
unit = jax.make_mesh((8, 1), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2)
unit_args = (jnp.tile(a, (4, 1, 1)) * phase, jnp.tile(b, (4, 1, 1)) * (1 + 0.5j))  # B = 8
unit_grad = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.abs(ops.linear_scan(a, b)[0]) ** 2),
                             argnums=(0, 1)))
unit_want = unit_grad(*unit_args)
with jax.set_mesh(unit):
  unit_got = unit_grad(*[jax.device_put(x, NamedSharding(unit, P("data", "seq")))
                         for x in unit_args])
out["unit_time_axis"] = [max_err(unit_got, unit_want),
                         max(float(jnp.max(jnp.abs(g))) for g in unit_want)]

# Not vacuous: the same program on one device's arrays holds the whole sequence.
out["unsplit_longest_axis"] = longest_axis(
    jax.jit(lambda a, b: ops.linear_scan(a, b)[0]).lower(a, b).compile().as_text())

# Time axes split differently: an error before any work.
try:
  with jax.set_mesh(grid):
    jax.jit(lambda a, b: ops.linear_scan(a, b)).trace(
        jax.device_put(a, NamedSharding(grid, P(None, "seq"))),
        jax.device_put(b, NamedSharding(grid, P(None, "data"))))
  out["mismatch_error"] = "no error"
except ValueError as e:
  out["mismatch_error"] = str(e)

# A T the axes do not divide: Explicit types refuse the placement itself, and
# the op's plan would refuse the call.
try:
  uneven = jax.device_put(b[:, :12], NamedSharding(seq8, P(None, "seq")))
  with jax.set_mesh(seq8):
    ops.linear_scan(uneven, uneven)
  out["uneven_error"] = "no error"
except ValueError as e:
  out["uneven_error"] = str(e)
print("RESULT" + json.dumps(out))
'''

_CASES = ("seq8", "seq8_reverse_shared_complex_decay", "batch2_seq4", "batch2_seq4_reverse",
          "seq8_triton")


@pytest.fixture(scope="module")
def results():
  return simulated_devices.run(_SCRIPT, timeout=600)


@pytest.mark.parametrize("case", _CASES)
def test_matches_one_device(results, case):
  assert results[case]["err"] < 2e-5, results[case]
  batch = None if case.startswith("seq8") else "data"
  assert results[case]["h_spec"][:2] == [batch, "seq"], results[case]  # h split as b is


@pytest.mark.parametrize("case", _CASES)
def test_communicates_only_per_device_states(results, case):
  """Every collective's result is at most [n, B, D] (n <= 8 devices), far
  below one device's chunk of the sequence; the forward's are the all-gathers."""
  collectives = results[case]["collectives"]
  assert collectives, results[case]
  for shape in collectives:
    size = 1
    for dim in shape:
      size *= dim
    assert size <= 8 * B * D < CHUNK * B * D, (shape, results[case])
  assert results[case]["forward_gathers"] >= 1, results[case]


@pytest.mark.parametrize("case", _CASES)
def test_each_device_holds_only_its_chunk(results, case):
  """No array in the compiled per-device programs is longer than a chunk: the
  sequence is never assembled on a device."""
  chunk = CHUNK if case.startswith("seq8") else T // 4
  assert results[case]["longest_axis"] <= chunk, results[case]
  assert results["unsplit_longest_axis"] == T, results


@pytest.mark.parametrize("case", [c for c in _CASES if "triton" not in c])
def test_each_device_scans_its_own_steps(results, case):
  local_batch = B if case.startswith("seq8") else B // 2
  chunk = CHUNK if case.startswith("seq8") else T // 4
  assert results[case]["scan_shapes"], results[case]
  assert all(s == [local_batch, chunk, D] for s in results[case]["scan_shapes"]), results[case]


def test_time_axes_split_differently_is_an_error(results):
  message = results["mismatch_error"]
  assert "`b`" in message and "`a`" in message and "sequence axis" in message, message


def test_an_uneven_split_is_refused(results):
  message = results["uneven_error"]
  assert "evenly divide" in message or ("`b`" in message and "sequence axis" in message), message


def test_a_size_one_time_axis_matches_one_device(results):
  err, scale = results["unit_time_axis"]
  assert err <= 2e-6 * max(1.0, scale), results["unit_time_axis"]
