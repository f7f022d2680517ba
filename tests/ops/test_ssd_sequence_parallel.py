"""ops.ssd with its time axis split over a mesh (context parallelism).

On 8 simulated CPU devices (one subprocess for the file), with the sequence
split 8 ways, on a 2 x 4 (batch x sequence) and a 2 x 4 (heads x sequence)
mesh of Explicit axes, grouped queries and keys (G < N): the outputs, final
state and gradients equal one device's; each device runs the implementation
on its own T / n tokens; and the compiled forward and fwd+bwd programs
communicate only the per-device summaries (no collective larger than the n
states [B, N, K, V] gathered, no array on a device longer than its chunk).
Packed sequences (`cu_seqlens`) over the split: boundaries inside a device's
chunk and on its edge, an empty sequence, one sequence across five devices;
outputs, every sequence's final state and the gradients (of the initial
states too) equal one device's.
"""

import math

import pytest

from tests import simulated_devices

B, T, N, G, K, V = 2, 1024, 4, 2, 4, 4

_SCRIPT = r'''
import json
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import ops
from ops.ssd import api
from tests.ops.compiled_programs import compile_and_run, longest_axis, max_err, record_shapes

assert jax.device_count() == 8, jax.devices()
B, T, N, G, K, V = 2, 1024, 4, 2, 4, 4
out = {}

# The [B, t, N, V] value shapes the XLA implementation is traced with.
seen = record_shapes(api, "ssd_xla", "v")

keys = jax.random.split(jax.random.key(0), 5)
q = jax.random.normal(keys[0], (B, T, G, K))
k = jax.random.normal(keys[1], (B, T, G, K)) / K ** 0.5
v = jax.random.normal(keys[2], (B, T, N, V))
# Slow decays, so the state entering a chunk reaches far into it.
g = -0.05 * jax.nn.softplus(jax.random.normal(keys[3], (B, T, N)))
h0 = jax.random.normal(keys[4], (B, N, K, V))

seq8 = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Explicit,))
data_seq = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2)
heads_seq = jax.make_mesh((2, 4), ("heads", "seq"), axis_types=(AxisType.Explicit,) * 2)

# name: mesh, batch axis, heads axis, implementation, initial state, length.
CASES = {
    "seq8": (seq8, None, None, "xla", True, T),
    "seq8_no_state": (seq8, None, None, "xla", False, T),
    "batch2_seq4": (data_seq, "data", None, "xla", True, T),
    "heads2_seq4": (heads_seq, None, "heads", "xla", True, T),
    "seq8_triton": (seq8, None, None, "triton", True, 128),
}
for name, (mesh, batch, heads, impl, with_state, length) in CASES.items():
  args = (q[:, :length], k[:, :length], v[:, :length], g[:, :length], h0)
  chunk = 16 if impl == "triton" else None

  def ssd(q, k, v, g, h0):
    return ops.ssd(q, k, v, g, initial_state=h0 if with_state else None, chunk_size=chunk,
                   implementation=impl)

  def loss(q, k, v, g, h0):
    y, final = ssd(q, k, v, g, h0)
    return jnp.sum(jnp.sin(y)) + jnp.sum(final * jnp.cos(final))

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  want = (jax.jit(ssd)(*args), grad(*args))
  specs = (P(batch, "seq", heads),) * 4 + (P(batch, heads),)
  placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
  seen.clear()
  got, facts = compile_and_run(mesh, ssd, grad, placed)
  out[name] = {"err": max_err(got, want), "y_spec": list(got[0][0].sharding.spec),
               "ssd_shapes": seen[:], **facts}

# Not vacuous: the same program on one device's arrays holds the whole sequence.
out["unsplit_longest_axis"] = longest_axis(
    jax.jit(lambda *a: ops.ssd(*a, implementation="xla")[0]).lower(q, k, v, g).compile().as_text())

def error(fn, *args):
  try:
    with jax.set_mesh(data_seq):
      jax.jit(fn).trace(*args)
    return "no error"
  except ValueError as e:
    return str(e)

on_seq = lambda x: jax.device_put(x, NamedSharding(data_seq, P(None, "seq")))

# Packed sequences, the time axis split 8 ways (128 tokens per device, 16 for
# the kernels): name -> (implementation, length, cu_seqlens).
PACKED = {"packed": ("xla", T, [0, 100, 100, 300, 384, 1000, T]),
          "packed_triton": ("triton", 128, [0, 5, 5, 40, 48, 110, 128])}
for name, (impl, length, offsets) in PACKED.items():
  cu = jnp.array(offsets, jnp.int32)
  starts = jax.random.normal(keys[4], (len(offsets) - 1, N, K, V))

  def packed_loss(q, k, v, g, starts):
    y, finals = ops.ssd(q, k, v, g, initial_state=starts, cu_seqlens=cu,
                        chunk_size=16 if impl == "triton" else None, implementation=impl)
    return jnp.sum(jnp.sin(y)) + jnp.sum(finals * jnp.cos(finals)), (y, finals)

  packed_grad = jax.jit(jax.value_and_grad(packed_loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
  args = [x[:1, :length] for x in (q, k, v, g)]
  want = packed_grad(*args, starts)
  with jax.set_mesh(seq8):
    got = packed_grad(*[jax.device_put(x, NamedSharding(seq8, P(None, "seq"))) for x in args],
                      starts)
  out[name] = [max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                   for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))),
               list(got[0][1][0].sharding.spec)]
# Time axes split differently: an error before any work.
out["mismatch_error"] = error(lambda q, k, v, g: ops.ssd(q, k, v, g), on_seq(q), on_seq(k),
                              jax.device_put(v, NamedSharding(data_seq, P(None, "data"))),
                              on_seq(g))
print("RESULT" + json.dumps(out))
'''

_CASES = ("seq8", "seq8_no_state", "batch2_seq4", "heads2_seq4", "seq8_triton")


def _mesh(case):
  """(sequence shards, batch per device, heads per device, tokens per device)."""
  if case.startswith("seq8"):
    return 8, B, N, (128 if "triton" in case else T) // 8
  if case.startswith("batch2"):
    return 4, B // 2, N, T // 4
  return 4, B, N // 2, T // 4


@pytest.fixture(scope="module")
def results():
  return simulated_devices.run(_SCRIPT, timeout=600)


@pytest.mark.parametrize("case", _CASES)
def test_matches_one_device(results, case):
  assert results[case]["err"] < 1e-4, results[case]
  batch = "data" if case.startswith("batch2") else None
  heads = "heads" if case.startswith("heads2") else None
  assert results[case]["y_spec"][:3] == [batch, "seq", heads], results[case]  # y split as v is


@pytest.mark.parametrize("case", _CASES)
def test_communicates_only_per_device_states(results, case):
  """Every collective's result is at most the n gathered states [n, B, N, K,
  V] (per device's batch and heads), below one device's chunk of `q`; the
  forward's are the all-gathers."""
  shards, batch, heads, tokens = _mesh(case)
  summaries = shards * batch * heads * K * V
  collectives = results[case]["collectives"]
  assert collectives, results[case]
  assert max(map(math.prod, collectives)) <= summaries, results[case]
  if "triton" not in case:  # the tiny kernel case holds fewer tokens than a state
    assert summaries < batch * tokens * heads * K, results[case]
  assert results[case]["forward_gathers"] >= 1, results[case]


@pytest.mark.parametrize("case", _CASES)
def test_each_device_holds_only_its_chunk(results, case):
  """No array in the compiled per-device programs is longer than a chunk: the
  sequence is never assembled on a device."""
  assert results[case]["longest_axis"] <= _mesh(case)[3], results[case]
  assert results["unsplit_longest_axis"] == T, results


@pytest.mark.parametrize("case", [c for c in _CASES if "triton" not in c])
def test_each_device_runs_its_own_tokens(results, case):
  _, batch, heads, tokens = _mesh(case)
  assert results[case]["ssd_shapes"], results[case]
  assert all(s == [batch, tokens, heads, V] for s in results[case]["ssd_shapes"]), results[case]


@pytest.mark.parametrize("case", ["packed", "packed_triton"])
def test_packed_sequences_over_a_split_time_axis_match_one_device(results, case):
  relative_err, y_spec = results[case]
  assert relative_err < 1e-5, results[case]
  assert y_spec[:2] == [None, "seq"], results[case]


def test_time_axes_split_differently_is_an_error(results):
  message = results["mismatch_error"]
  assert "`v`" in message and "sequence axis" in message, message
