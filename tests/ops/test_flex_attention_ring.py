"""ops.flex_attention with its sequence axis split over a mesh (ring attention).

On 8 simulated CPU devices (one subprocess for the file), Explicit axes:
full attention with key lengths and a batch-dependent `mask_mod` (2 x 4,
batch x sequence), causal grouped-query attention over packed documents
(sequence split 8 ways: the zig-zag ring), a sliding window with a
position-dependent `score_mod` and `mask_mod` (2 x 4, heads x sequence), and
causal attention with a window over documents and key lengths with its
blocks on the kernels (interpret mode; 2 x 4, batch x sequence), each block's
mask a local window shifted by its offset. The
outputs and the gradients of q, k and v equal one device's; the compiled
fwd+bwd programs move only shards, by collective-permutes (no all-gather, no
array as long as the sequence); the causal schedule the ring ran balances the
devices' work, and the window's skips the blocks outside it.
`probjax_hk.dot_product_attention` on a split sequence runs the ring.
"""

import math

import numpy as np
import pytest

from ops.flex_attention import ring
from tests import simulated_devices

B, T, N, K, H = 2, 128, 4, 2, 16

_SCRIPT = r'''
import json
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import ops
from ops.flex_attention import pallas, ring
from tests.ops.compiled_programs import (collective_kinds, collectives, longest_axis, max_err,
                                        traced_error)

assert jax.device_count() == 8, jax.devices()
B, T, N, K, H = 2, 128, 4, 2, 16
out = {}

# The schedule each ring runs with, and the blocks traced on the kernels.
schedules, choose = [], ring.choose_schedule
ring.choose_schedule = lambda *a, **kw: schedules.append(choose(*a, **kw)) or schedules[-1]
kernel_blocks = []
for name in ("forward_with_lse", "backward_with_lse"):
  def counted(*a, _fn=getattr(pallas, name), _name=name, **kw):
    kernel_blocks.append(_name)
    return _fn(*a, **kw)
  setattr(pallas, name, counted)

keys = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(keys[0], (B, T, N, H))
k = jax.random.normal(keys[1], (B, T, K, H))
v = jax.random.normal(keys[2], (B, T, K, H))
lengths = jnp.array([T, 70], jnp.int32)  # the second row's last keys are padding
documents = (jnp.arange(T)[None] >= jnp.array([[50], [90]])).astype(jnp.int32)  # [B, T]

explicit = lambda shape, names: jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))
data_seq = explicit((2, 4), ("data", "seq"))
seq8 = explicit((8,), ("seq",))
heads_seq = explicit((2, 4), ("heads", "seq"))

def full(q, k, v, lengths, documents):
  return ops.flex_attention(q, k, v, key_value_seq_lengths=lengths,
                            mask_mod=lambda b, n, t, s: s < t + 40 + 16 * b)

def causal(q, k, v, lengths, documents):
  return ops.flex_attention(q, k, v, is_causal=True, segment_ids=documents)

def window(q, k, v, lengths, documents):
  alibi = lambda score, b, n, t, s: score - 0.1 * (n + 1.0) * jnp.abs(t - s)
  return ops.flex_attention(q, k, v, local_window_size=(20, 6), score_mod=alibi,
                            mask_mod=lambda b, n, t, s: t - s != 2)

def kernels(q, k, v, lengths, documents):
  return ops.flex_attention(q, k, v, is_causal=True, segment_ids=documents,
                            local_window_size=(40, 0), key_value_seq_lengths=lengths,
                            implementation="triton")

# name: attention, mesh, batch axis, heads axis.
CASES = {"full": (full, data_seq, "data", None), "causal": (causal, seq8, None, None),
         "window": (window, heads_seq, None, "heads"), "kernels": (kernels, data_seq, "data", None)}
args = (q, k, v, lengths, documents)

def value_and_grads(attention):
  def loss(q, k, v, lengths, documents):
    y = attention(q, k, v, lengths, documents)
    return jnp.sum(jnp.sin(y)), y
  return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

# One device: every case in one program.
wants = jax.jit(lambda *a: {n: value_and_grads(c[0])(*a) for n, c in CASES.items()})(*args)

for name, (attention, mesh, batch, heads) in CASES.items():
  specs = [P(batch, "seq", heads)] * 3 + [P(batch), P(batch, "seq")]
  placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
  schedules.clear()
  kernel_blocks.clear()
  with jax.set_mesh(mesh):
    program = jax.jit(value_and_grads(attention)).lower(*placed).compile()
    got = program(*placed)
  text = program.as_text()
  out[name] = {"err": max_err(got, wants[name]), "y_spec": list(got[0][1].sharding.spec),
               "collectives": collectives(text), "longest_axis": longest_axis(text),
               "kinds": sorted(set(collective_kinds(text))),
               "visits": [list(map(list, map(list, d))) for d in schedules[0].visits]
                         if schedules else None,
               "zigzag": schedules[0].zigzag if schedules else None,
               "windows": schedules[0].windows if schedules else None,
               "kernel_blocks": sorted(set(kernel_blocks))}

error = lambda fn, *args: traced_error(data_seq, fn, *args)
on = lambda x, spec: jax.device_put(x, NamedSharding(data_seq, spec))
# The sequence of q and k split over different axes.
out["mismatch_error"] = error(ops.flex_attention, on(q, P(None, "seq")), on(k, P(None, "data")),
                              on(v, P(None, "seq")))
# Keys that cannot be cut like the queries (60 over 4 devices would be, 66 not).
out["uneven_error"] = error(ops.flex_attention, on(q, P(None, "seq")), k[:, :66], v[:, :66])
# A kernel asked for by name declines a mod, which sees global positions.
out["kernel_error"] = error(
    lambda q: ops.flex_attention(q, q, q, mask_mod=lambda b, n, t, s: s <= t,
                                 implementation="triton"), on(q, P(None, "seq")))
# probjax_hk.dot_product_attention's default runs the ring on a split sequence.
import probjax_hk as pk
mha = lambda q, k, v: pk.dot_product_attention(q, k, v, is_causal=True)
placed = [on(x, P("data", "seq")) for x in (q, k, v)]
with jax.set_mesh(data_seq):
  out["mha_chosen"] = pk.choose_attention_implementation(*placed, is_causal=True)
  out["mha_err"] = max_err(jax.jit(mha)(*placed), jax.jit(mha)(q, k, v))
out["mha_bias_error"] = error(
    lambda q: pk.dot_product_attention(q, q, q, bias=jnp.zeros((1, 1, T, T))), placed[0])
print("RESULT" + json.dumps(out))
'''

# name: (sequence shards, batch per device, query heads per device).
_CASES = {"full": (4, B // 2, N), "causal": (8, B, N), "window": (4, B, N // 2),
          "kernels": (4, B // 2, N)}


@pytest.fixture(scope="module")
def results():
  return simulated_devices.run(_SCRIPT, timeout=600)


@pytest.mark.parametrize("case", _CASES)
def test_matches_one_device(results, case):
  # The kernels' blocks sum in another order than one device's kernel (f32).
  assert results[case]["err"] < (3e-5 if case == "kernels" else 1e-5), results[case]
  batch = "data" if case in ("full", "kernels") else None
  heads = "heads" if case == "window" else None
  assert results[case]["y_spec"][:3] == [batch, "seq", heads], results[case]  # split as q


@pytest.mark.parametrize("case", _CASES)
def test_moves_only_shards_by_collective_permutes(results, case):
  """Every collective but the loss's scalar sum is a collective-permute of at
  most one device's shard of q; the key/value shard itself is among them, and
  no array on a device is as long as the sequence."""
  shards, batch, heads = _CASES[case]
  tokens = T // shards
  assert results[case]["kinds"] == ["collective-permute"], results[case]
  permuted = [tuple(s) for s in results[case]["collectives"] if s]
  assert max(map(math.prod, permuted)) <= batch * tokens * heads * H, results[case]
  assert (batch, tokens, heads * K // N, H) in permuted, results[case]
  assert results[case]["longest_axis"] < T, results[case]


def _work(visits) -> np.ndarray:
  """[devices, steps]: the blocks each device computes at each step, in
  shard-by-shard units (a zig-zag tile pair is a quarter)."""
  visits = np.asarray(visits)
  return visits.sum(axis=(2, 3)) / visits.shape[2] ** 2


def test_causal_ring_balances_the_devices(results):
  """Each device's work is within 10 % of the mean, and so is the ring's
  critical path (the steps run in lockstep) per device."""
  assert results["causal"]["zigzag"], results["causal"]
  work = _work(results["causal"]["visits"])
  per_device = work.sum(axis=1)
  assert np.all(np.abs(per_device - per_device.mean()) <= 0.1 * per_device.mean()), work
  assert work.max(axis=0).sum() <= 1.1 * per_device.mean(), work


def test_the_balance_check_can_fail():
  """The contiguous split of the same call is unbalanced: device d computes d + 1 blocks."""
  contiguous = ring.schedule(8, T, T, is_causal=True, window=None, zigzag=False)
  per_device = _work(contiguous.visits).sum(axis=1)
  assert per_device.tolist() == list(range(1, 9)), per_device
  assert not np.all(np.abs(per_device - per_device.mean()) <= 0.1 * per_device.mean())


def test_window_ring_skips_blocks_outside_the_window(results):
  """(20, 6) over 32-token shards: each query shard meets its own key shard
  and its two neighbours only (one neighbour at either end)."""
  visits = np.asarray(results["window"]["visits"])[..., 0, 0]  # [devices, steps]
  assert not results["window"]["zigzag"]
  assert visits.sum(axis=1).tolist() == [2, 3, 3, 2], visits
  assert results["full"]["visits"] and np.all(results["full"]["visits"]), results["full"]


def test_arguments_split_differently_are_an_error(results):
  message = results["mismatch_error"]
  assert "`k`" in message and "sequence axis" in message, message
  message = results["uneven_error"]
  assert "`k`" in message and "66" in message and "sequence axis" in message, message


def test_kernels_run_every_block_with_a_local_window(results):
  """A causal ring with a window, documents and key lengths runs its forward
  and backward blocks on the kernels, the blocks off the diagonal with the
  window shifted by their offset (and the unmasked ones with none); the XLA
  rings run none."""
  case = results["kernels"]
  assert case["kernel_blocks"] == ["backward_with_lse", "forward_with_lse"], case
  windows = [tuple(w) for w in case["windows"]]
  # 16-token tiles: the diagonal blocks causal only (the window does not cut
  # them), blocks wholly inside the window unmasked, and the window's edge
  # cutting blocks at a shifted left bound.
  assert (None, 0) in windows and (None, None) in windows, windows
  assert any(w[0] not in (None, 40) for w in windows), windows
  assert not any(results[c]["kernel_blocks"] for c in ("full", "causal", "window"))


def test_a_kernel_named_declines_a_mod(results):
  message = results["kernel_error"]
  assert "`q`" in message and "sequence axis" in message and "mask_mod" in message, message
  assert "'xla'" in message, message


def test_dot_product_attention_runs_the_ring(results):
  """The models' attention: 'xla' (the default off GPUs) runs the ring on a
  split sequence; what the ring cannot take is an error naming the split."""
  assert results["mha_chosen"] == "xla", results
  assert results["mha_err"] < 1e-5, results
  message = results["mha_bias_error"]
  assert "`q`" in message and "ring attention" in message and "bias" in message, message
