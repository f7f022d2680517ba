"""`ssd` with its time axis split over mesh axes (context parallelism).

Within one device's chunk of tokens, SSD from the true entering state `H_in`
is SSD from zero plus `H_in` carried through the chunk's decays (the state
passing of Mamba-2's chunked algorithm, Dao and Gu 2024, across devices):

  S_t = S'_t + exp(G_t) H_in,   y_t = y'_t + exp(G_t) (H_in^T q_t)

with `G_t` the cumulative log-decay from the chunk's first token to t,
inclusive (`S_t = exp(log_decay_t) S_{t-1} + k_t v_t^T`). Each device runs the
chosen implementation on its chunk from zero, and `ops/_sequence_parallel.py`
passes the (final state [B, N, K, V], total log-decay [B, N]) pairs across the
devices to give each its `H_in`. The caller's `initial_state` enters the first
chunk through that pass.

Packed sequences (`cu_seqlens`, a batch of one): each device runs its chunk
with the offsets cut to its tokens, each sequence that starts on it from its
own initial state and the one carried in from the previous device from zero.
Only that carried sequence needs `H_in`, up to the chunk's first sequence
boundary: the pass carries the state of the sequence open at each chunk's
end, with a transition of 0 where a boundary lies in the chunk. Each
sequence's final state comes from the device holding its last token, summed
over the devices (one [S, N, K, V] psum).

Glossary of shapes: B batch, T time, N heads, G query/key groups (N % G == 0),
K key size, V value size, n chunks (devices along the sequence axes),
t = T / n tokens per chunk.
"""

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ops import _sequence_parallel
from ops import _sharding
from ops.ssd.groups import expand_groups
from ops.ssd.xla import einsum

_F32 = jnp.float32
_TOKENS = ("batch", "seq", "heads", None)  # q, k [B, T, G, K]; v, y [B, T, N, V]
_PER_HEAD = ("batch", "seq", "heads")  # log_decay [B, T, N]
_STATE = ("batch", "heads", None, None)  # initial_state, final_state [B, N, K, V]
_SEQUENCE_STATE = (None, "heads", None, None)  # with cu_seqlens: [S, N, K, V]


def plan(q: jax.Array, k: jax.Array, v: jax.Array, log_decay: jax.Array,
         initial_state: jax.Array | None, cu_seqlens: jax.Array | None
         ) -> _sharding.Plan | None:
  """How a call splits over the mesh when its time axis is split; None when
  no argument's time axis is split over an Explicit mesh axis.

  Raises:
    ValueError: naming the argument and the axis, when the arguments split
      their time (or batch, or head) axes differently or cannot be cut evenly
      alike, or when the key or value size is split.
  """
  if not _sequence_parallel.splits_time(q, k, v, log_decay):
    return None
  return _sharding.plan("ssd", (
      ("q", q, _TOKENS), ("k", k, _TOKENS), ("v", v, _TOKENS),
      ("log_decay", log_decay, _PER_HEAD),
      ("initial_state", initial_state, _STATE if cu_seqlens is None else _SEQUENCE_STATE),
      ("cu_seqlens", cu_seqlens, (None,))),
      split=("batch", "seq", "heads"))


def _step(state, summary):
  """The state leaving a chunk, from the state entering it."""
  final, total = summary  # [B, N, K, V], [B, N]
  return jnp.exp(total)[..., None, None] * state + final


def _decayed(state, summary):
  """`_step` with the chunk's total decay as a factor (0: a sequence boundary)."""
  final, decay = summary  # [B, N, K, V], [B, N]
  return decay[..., None, None] * state + final


def ssd_split(ssd: Callable, split: _sharding.Plan, *,
              chunk_size: int | None) -> tuple[jax.Array, jax.Array]:
  """`ssd` on `split`'s arrays with the time axis split over its mesh axes.

  Args:
    ssd: the implementation, `ssd(q=, k=, v=, log_decay=, initial_state=,
      chunk_size=, cu_seqlens=) -> (y, final_state)`, run on each device's
      chunk ([B, t, ...]) from a zero state.
    split: `plan(...)`, splitting "seq".
    chunk_size: as `ssd`'s, for each device's chunk.

  Returns:
    y: [B, T, N, V], split as `v` is; final_state: [B, N, K, V] float32
    ([S, N, K, V] with `cu_seqlens`).
  """
  axes = _sequence_parallel.time_axes(split)
  if split.args[-1] is not None:  # cu_seqlens
    return _sequence_parallel.run(split, functools.partial(_packed, ssd, axes, chunk_size),
                                  [_TOKENS, _SEQUENCE_STATE])

  def chunk(q, k, v, log_decay, initial_state, cu_seqlens):  # [B, t, ...]; [B, N, K, V]; None
    del cu_seqlens  # None here: `_packed` takes packed sequences
    y, final = ssd(q=q, k=k, v=v, log_decay=log_decay, initial_state=None,
                   chunk_size=chunk_size, cu_seqlens=None)  # from zero
    cumulative = jnp.cumsum(log_decay.astype(_F32), axis=1)  # [B, t, N]: G_t, inclusive
    start = (jnp.zeros(final.shape, _F32) if initial_state is None
             else initial_state.astype(_F32))
    entering, final = _sequence_parallel.entering_states(
        _step, start, (final.astype(_F32), cumulative[:, -1]), axes)
    heads = v.shape[2]
    carried = einsum("btnk,bnkv->btnv", expand_groups(q, heads),
                     entering.astype(v.dtype))  # [B, t, N, V]: H_in^T q_t
    y = y.astype(_F32) + jnp.exp(cumulative)[..., None] * carried
    return y.astype(v.dtype), final

  return _sequence_parallel.run(split, chunk, [_TOKENS, _STATE])


def _packed(ssd: Callable, axes, chunk_size, q, k, v, log_decay, initial_state, cu_seqlens):
  """One device's chunk ([1, t, ...]) of packed sequences: (y [1, t, N, V],
  every sequence's final state [S, N, K, V] float32, the same on every device)."""
  t = q.shape[1]
  packed = _sequence_parallel.packed_chunk(cu_seqlens, axes, t)
  t0, ends, carried = packed.first, packed.ends, packed.carried
  heads, key, value = v.shape[2], q.shape[-1], v.shape[-1]
  initial = (jnp.zeros((ends.shape[0], heads, key, value), _F32) if initial_state is None
             else initial_state.astype(_F32))
  y, finals = ssd(q=q, k=k, v=v, log_decay=log_decay,
                  initial_state=jnp.where(carried[:, None, None, None], 0.0, initial),
                  chunk_size=chunk_size, cu_seqlens=packed.offsets)
  finals = finals.astype(_F32)
  cumulative = jnp.cumsum(log_decay.astype(_F32), axis=1)  # [1, t, N]: G_t from the chunk's start
  # The carried sequence runs up to the chunk's first boundary.
  boundary = jnp.min(jnp.where(ends > t0, ends, t0 + t)) - t0
  open_through = boundary >= t  # no boundary inside: the carried state passes through
  decay = jnp.where(open_through & carried.any(), jnp.exp(cumulative[:, -1]), 0.0)  # [1, N]
  # The state leaving the chunk: that of the sequence holding its last token.
  entering, _ = _sequence_parallel.entering_states(
      _decayed, jnp.zeros((1, heads, key, value), _F32), (finals[packed.last][None], decay), axes)
  entering = jnp.where(carried.any(), entering, 0.0)  # [1, N, K, V]: H_in
  through = jnp.exp(cumulative) * (jnp.arange(t) < boundary)[None, :, None]  # [1, t, N]
  carried_y = einsum("btnk,bnkv->btnv", expand_groups(q, heads), entering.astype(v.dtype))
  y = y.astype(_F32) + through[..., None] * carried_y
  # The carried sequence's final state, where it ends on this device.
  at_end = jnp.exp(cumulative[0, jnp.clip(boundary - 1, 0, t - 1)])  # [N]
  finals = finals + jnp.where(carried & (ends <= t0 + t), 1.0, 0.0)[:, None, None, None] * (
      at_end[:, None, None] * entering[0])[None]
  return y.astype(v.dtype), _sequence_parallel.collect_finals(packed, t, finals, initial, axes)
