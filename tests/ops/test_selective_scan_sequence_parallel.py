"""ops.selective_scan with its time axis split over a mesh (context parallelism).

On 8 simulated CPU devices (one subprocess for the file), with the sequence
split 8 ways, on a 2 x 4 (batch x sequence) and a 2 x 4 (channels x sequence)
mesh of Explicit axes; with the skip, the gate, the step sizes' bias and
softplus; per-step, per-group and time-invariant B/C; reverse; without the
final state: the outputs, final state and gradients equal one device's; each
device's scan runs on its own T / n steps; and the compiled forward and
fwd+bwd programs communicate only the chunks' summaries (no collective
exceeds [n, B, D, S], less than one device's chunk of the outputs, and no
array on a device spans more than its chunk).
"""

import pytest

from tests import simulated_devices

B, T, D, S = 2, 256, 4, 3
CHUNK = T // 8  # time steps per device with the sequence split 8 ways

_SCRIPT = r'''
import json
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import ops
from ops.selective_scan import api
from tests.ops.compiled_programs import compile_and_run, longest_axis, max_err, record_shapes

assert jax.device_count() == 8, jax.devices()
B, T, D, S, G = 2, 256, 4, 3, 2
out = {}

# The [B, t, D] shapes the XLA implementation is traced with.
seen = record_shapes(api, "selective_scan_xla", "u")

keys = jax.random.split(jax.random.key(0), 10)
u = jax.random.normal(keys[0], (B, T, D))
delta = jax.random.uniform(keys[1], (B, T, D), minval=0.01, maxval=0.5)  # decays without softplus
A = -jnp.exp(jax.random.normal(keys[2], (D, S)))
projections = {  # B/C forms: per step [B, T, S], per group [B, T, G, S], time-invariant [D, S]
    "step": (jax.random.normal(keys[3], (B, T, S)), jax.random.normal(keys[4], (B, T, S))),
    "group": (jax.random.normal(keys[3], (B, T, G, S)), jax.random.normal(keys[4], (B, T, G, S))),
    "invariant": (jax.random.normal(keys[3], (D, S)), jax.random.normal(keys[4], (D, S))),
}
skip = jax.random.normal(keys[5], (D,))
z = jax.random.normal(keys[6], (B, T, D))
bias = jax.random.normal(keys[7], (D,))
h0 = jax.random.normal(keys[8], (B, D, S))

seq8 = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Explicit,))
grid = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2)
wide = jax.make_mesh((2, 4), ("model", "seq"), axis_types=(AxisType.Explicit,) * 2)

# name: mesh, batch axis, channel axis, implementation, B/C form, D z bias softplus,
# initial state, reverse, return_final_state.
CASES = {
    "seq8": (seq8, None, None, "xla", "step", True, True, False, True),
    "seq8_reverse_invariant": (seq8, None, None, "xla", "invariant", False, False, True, True),
    "batch2_seq4_reverse_groups_no_final_state": (
        grid, "data", None, "xla", "group", True, True, True, False),
    "channels2_seq4_invariant": (wide, None, "model", "xla", "invariant", True, True, False, True),
    "seq8_triton": (seq8, None, None, "triton", "step", True, True, False, True),
}
for name, (mesh, batch, channels, impl, form, extras, with_state, reverse,
           with_final) in CASES.items():
  b_in, c_in = projections[form]
  args = (u, delta, A, b_in, c_in, skip, z, bias, h0)
  token = P(batch, "seq", channels)
  projection = {"step": P(batch, "seq"), "group": P(batch, "seq", channels),
                "invariant": P(channels)}[form]
  specs = (token, token, P(channels), projection, projection, P(channels), token,
           P(channels), P(batch, channels))

  def scan(u, delta, A, b_in, c_in, skip, z, bias, h0):
    options = dict(D=skip, z=z, delta_bias=bias, delta_softplus=True) if extras else {}
    return ops.selective_scan(u, delta, A, b_in, c_in, initial_state=h0 if with_state else None,
                              reverse=reverse, return_final_state=with_final,
                              implementation=impl, **options)

  def loss(*args):
    y, final = scan(*args)
    return jnp.sum(jnp.sin(y)) + (0.0 if final is None else jnp.sum(jnp.cos(final) * final)), (
        y, final)

  # The outputs come with the gradients (one program on one device for both).
  grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))
  want = grad(*args)
  placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
  seen.clear()
  (forward, got), facts = compile_and_run(mesh, scan, grad, placed)
  y, final = forward
  out[name] = {"err": max_err((forward, got), (want[0][1], want)), "y_spec": list(y.sharding.spec),
               "final_is_none": final is None, "scan_shapes": seen[:], **facts}

# Not vacuous: the same program on one device's arrays holds the whole sequence.
out["unsplit_longest_axis"] = longest_axis(jax.jit(lambda *a: ops.selective_scan(*a)[0]).lower(
    u, delta, A, *projections["step"]).compile().as_text())

def error(mesh, specs, args=(u, delta, A, *projections["step"])):
  """The ValueError of a call with `args` placed as `specs` say, traced."""
  try:
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    with jax.set_mesh(mesh):
      jax.jit(lambda *a: ops.selective_scan(*a)).trace(*placed)
    return "no error"
  except ValueError as e:
    return str(e)

# Time axes split differently (B's over the batch axis's mesh axis), and the
# state size split while the time axis is: errors before any work.
out["mismatch_error"] = error(grid, [P(None, "seq")] * 2 + [P(), P(None, "data"), P(None, "seq")])
b_in, c_in = projections["step"]
out["state_error"] = error(grid, [P(None, "seq")] * 2 + [P(None, "data"), P(None, "seq"),
                                                        P(None, "seq")],
                           (u, delta, A[:, :2], b_in[..., :2], c_in[..., :2]))
print("RESULT" + json.dumps(out))
'''

_CASES = ("seq8", "seq8_reverse_invariant", "batch2_seq4_reverse_groups_no_final_state",
          "channels2_seq4_invariant", "seq8_triton")


def _chunk(case):
  return CHUNK if case.startswith("seq8") else T // 4


@pytest.fixture(scope="module")
def results():
  return simulated_devices.run(_SCRIPT, timeout=600)


@pytest.mark.parametrize("case", _CASES)
def test_matches_one_device(results, case):
  assert results[case]["err"] < 2e-5, results[case]
  batch = "data" if case.startswith("batch2") else None
  channels = "model" if case.startswith("channels2") else None
  assert results[case]["y_spec"] == [batch, "seq", channels], results[case]  # y split as u is
  assert results[case]["final_is_none"] == ("no_final" in case), results[case]


@pytest.mark.parametrize("case", _CASES)
def test_communicates_only_per_device_summaries(results, case):
  """Every collective's result is at most [n, B, D, S] (n <= 8 devices), less
  than one device's chunk of the outputs; the forward's are the all-gathers."""
  collectives = results[case]["collectives"]
  assert collectives, results[case]
  for shape in collectives:
    size = 1
    for dim in shape:
      size *= dim
    assert size <= 8 * B * D * S < CHUNK * B * D, (shape, results[case])
  assert results[case]["forward_gathers"] >= 1, results[case]


@pytest.mark.parametrize("case", _CASES)
def test_each_device_holds_only_its_chunk(results, case):
  """No array in the compiled per-device programs is longer than a chunk: the
  sequence is never assembled on a device."""
  assert results[case]["longest_axis"] <= _chunk(case), results[case]
  assert results["unsplit_longest_axis"] == T, results


@pytest.mark.parametrize("case", [c for c in _CASES if "triton" not in c])
def test_each_device_scans_its_own_steps(results, case):
  local_batch = B // 2 if case.startswith("batch2") else B
  local_width = D // 2 if case.startswith("channels2") else D
  assert results[case]["scan_shapes"], results[case]
  assert all(s == [local_batch, _chunk(case), local_width]
             for s in results[case]["scan_shapes"]), results[case]


def test_time_axes_split_differently_is_an_error(results):
  message = results["mismatch_error"]
  assert "`B`" in message and "`delta`" in message and "sequence axis" in message, message


def test_a_split_state_size_is_an_error(results):
  message = results["state_error"]
  assert "`A`" in message and "axis 1" in message and "cannot split" in message, message
