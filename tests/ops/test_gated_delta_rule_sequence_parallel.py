"""ops.gated_delta_rule with its time axis split over a mesh (context parallelism).

On 8 simulated CPU devices (one subprocess for the file), with the sequence
split 8 ways and on a 2 x 4 (batch x sequence) mesh of Explicit axes, grouped
queries and keys (G < N), with and without an initial state: the outputs,
final state and gradients (q, k, v, log_decay, beta, initial_state) equal one
device's; each device runs the implementation once, on its own T / n tokens
with V + K value columns (or twice, on V and on K columns, where the
implementation cannot take V + K); and the compiled forward and fwd+bwd
programs communicate only the per-device summaries (no collective larger than
the n states and transitions gathered, no array on a device longer than its
chunk). Packed sequences (`cu_seqlens`) over the split, in one run and in
two: boundaries inside a device's chunk and on its edge, an empty sequence,
one sequence across five devices; outputs, every sequence's final state and
the gradients equal one device's.
"""

import math

import pytest

from tests import simulated_devices

B, T, N, G, K, V = 2, 256, 4, 2, 2, 4

_SCRIPT = r'''
import json
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import ops
from ops import registry
from ops.gated_delta_rule import api
from ops.gated_delta_rule import sequence_parallel
from tests.ops.compiled_programs import compile_and_run, longest_axis, max_err, record_shapes

assert jax.device_count() == 8, jax.devices()
B, T, N, G, K, V = 2, 256, 4, 2, 2, 4
out = {}

# The [B, t, N, *] value shapes the XLA implementation is traced with.
seen = record_shapes(api, "gated_delta_rule_xla", "v")

keys = jax.random.split(jax.random.key(0), 6)
q = jax.random.normal(keys[0], (B, T, G, K))
k = jax.random.normal(keys[1], (B, T, G, K))
k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)  # the rule assumes |k| = 1
v = jax.random.normal(keys[2], (B, T, N, V))
# Slow decays and weak writes, so the state entering a chunk reaches far into it.
g = -0.02 * jax.nn.softplus(jax.random.normal(keys[3], (B, T, N)))
beta = 0.3 * jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, N)))
h0 = jax.random.normal(keys[5], (B, N, K, V))

seq8 = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Explicit,))
data_seq = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2)


def narrow_xla(q, k, v, log_decay, beta, initial_state):
  """The split op with an XLA implementation that refuses V + K value columns."""
  narrow = registry.Implementation(
      "xla", api._xla, supports=lambda call: None if call["v"].shape[-1] <= V else "V > 4")
  split = sequence_parallel.plan(q, k, v, log_decay, beta, initial_state, None)
  return sequence_parallel.gated_delta_rule_split(narrow, split, scale=None, chunk_size=None)


def gdr(q, k, v, g, beta, h0):
  return ops.gated_delta_rule(q, k, v, g, beta, initial_state=h0, implementation="xla")


def sin_loss(fn):
  def loss(*args):
    y, final = fn(*args)
    return jnp.sum(jnp.sin(y)) + jnp.sum(final * jnp.cos(final))
  return jax.jit(jax.value_and_grad(loss, argnums=range(6)))


# One device's outputs and gradients, with and without the initial state.
args = (q, k, v, g, beta, h0)
without = lambda *a: gdr(*a[:5], None)
unsplit = jax.jit(gdr).lower(*args).compile()
WANT = {True: (unsplit(*args), sin_loss(gdr)(*args)),
        False: (jax.jit(without)(*args), sin_loss(without)(*args))}
# Not vacuous: the same program on one device's arrays holds the whole sequence.
out["unsplit_longest_axis"] = longest_axis(unsplit.as_text())

# name: mesh, batch axis, initial state, the split op.
CASES = {
    "seq8": (seq8, None, True, gdr),
    "batch2_seq4_no_state": (data_seq, "data", False, without),
    "seq8_two_runs": (seq8, None, True, narrow_xla),
}
for name, (mesh, batch, with_state, fn) in CASES.items():
  specs = (P(batch, "seq"),) * 5 + (P(batch),)
  placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
  seen.clear()
  got, facts = compile_and_run(mesh, fn, sin_loss(fn), placed)
  out[name] = {"err": max_err(got, WANT[with_state]), "y_spec": list(got[0][0].sharding.spec),
               "xla_shapes": seen[:], **facts}

def error(fn, *args):
  try:
    with jax.set_mesh(data_seq):
      jax.jit(fn).trace(*args)
    return "no error"
  except ValueError as e:
    return str(e)

on_seq = lambda x: jax.device_put(x, NamedSharding(data_seq, P(None, "seq")))

# Packed sequences, the time axis split 8 ways (32 tokens per device).
cu = jnp.array([0, 20, 20, 70, 96, 230, T], jnp.int32)
starts = jax.random.normal(keys[5], (cu.shape[0] - 1, N, K, V))


def packed_narrow(q, k, v, log_decay, beta, initial_state, cu_seqlens):
  narrow = registry.Implementation(
      "xla", api._xla, supports=lambda call: None if call["v"].shape[-1] <= V else "V > 4")
  split = sequence_parallel.plan(q, k, v, log_decay, beta, initial_state, cu_seqlens)
  return sequence_parallel.gated_delta_rule_split(narrow, split, scale=None, chunk_size=None)


one_run = lambda *a, cu_seqlens: ops.gated_delta_rule(*a[:5], initial_state=a[5],
                                                        cu_seqlens=cu_seqlens)
for name, packed in (("packed", one_run), ("packed_two_runs", packed_narrow)):
  def packed_loss(q, k, v, g, beta, starts, packed=packed):
    y, finals = packed(q, k, v, g, beta, starts, cu_seqlens=cu)
    return jnp.sum(jnp.sin(y)) + jnp.sum(finals * jnp.cos(finals)), (y, finals)

  packed_grad = jax.jit(jax.value_and_grad(packed_loss, argnums=tuple(range(6)), has_aux=True))
  args = [x[:1] for x in (q, k, v, g, beta)]
  want = jax.jit(jax.value_and_grad(
      lambda *a: (lambda y, f: (jnp.sum(jnp.sin(y)) + jnp.sum(f * jnp.cos(f)), (y, f)))(
          *one_run(*a, cu_seqlens=cu)), argnums=tuple(range(6)), has_aux=True))(*args, starts)
  with jax.set_mesh(seq8):
    got = packed_grad(*[jax.device_put(x, NamedSharding(seq8, P(None, "seq"))) for x in args],
                      starts)
  out[name] = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
# The value size split: an error naming the argument and the axis.
out["value_split_error"] = error(
    ops.gated_delta_rule, on_seq(q), on_seq(k),
    jax.device_put(v, NamedSharding(data_seq, P(None, "seq", None, "data"))), on_seq(g),
    on_seq(beta))
print("RESULT" + json.dumps(out))
'''

_CASES = ("seq8", "batch2_seq4_no_state", "seq8_two_runs")


def _mesh(case):
  """(sequence shards, batch per device, tokens per device)."""
  if case.startswith("seq8"):
    return 8, B, T // 8
  return 4, B // 2, T // 4


@pytest.fixture(scope="module")
def results():
  return simulated_devices.run(_SCRIPT, timeout=600)


@pytest.mark.parametrize("case", _CASES)
def test_matches_one_device(results, case):
  assert results[case]["err"] < 1e-4, results[case]
  batch = "data" if case.startswith("batch2") else None
  assert results[case]["y_spec"][:3] == [batch, "seq", None], results[case]  # y split as v is


@pytest.mark.parametrize("case", _CASES)
def test_communicates_only_per_device_summaries(results, case):
  """Every collective's result is at most the n gathered states [n, B, N, K,
  V] and transitions [n, B, N, K, K] (per device's batch), below one device's
  chunk of `v`; the forward's are the all-gathers."""
  shards, batch, tokens = _mesh(case)
  summaries = shards * batch * N * K * max(K, V)
  collectives = results[case]["collectives"]
  assert collectives, results[case]
  assert max(map(math.prod, collectives)) <= summaries, results[case]
  assert summaries < batch * tokens * N * V, results[case]
  assert results[case]["forward_gathers"] >= 1, results[case]


@pytest.mark.parametrize("case", _CASES)
def test_each_device_holds_only_its_chunk(results, case):
  """No array in the compiled per-device programs is longer than a chunk: the
  sequence is never assembled on a device."""
  assert results[case]["longest_axis"] <= _mesh(case)[2], results[case]
  assert results["unsplit_longest_axis"] == T, results


@pytest.mark.parametrize("case", _CASES)
def test_each_device_runs_its_own_tokens(results, case):
  """One run on V + K value columns, or one on V and one on K."""
  _, batch, tokens = _mesh(case)
  want = ({(batch, tokens, N, V), (batch, tokens, N, K)} if case == "seq8_two_runs"
          else {(batch, tokens, N, V + K)})
  assert set(map(tuple, results[case]["xla_shapes"])) == want, results[case]


@pytest.mark.parametrize("case", ["packed", "packed_two_runs"])
def test_packed_sequences_over_a_split_time_axis_match_one_device(results, case):
  assert results[case] < 1e-5, results[case]


def test_a_split_value_size_is_an_error(results):
  message = results["value_split_error"]
  assert "`v`" in message and "axis 3" in message, message
