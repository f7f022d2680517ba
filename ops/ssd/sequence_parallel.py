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

Glossary of shapes: B batch, T time, N heads, G query/key groups (N % G == 0),
K key size, V value size, n chunks (devices along the sequence axes),
t = T / n tokens per chunk.
"""

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


def plan(q: jax.Array, k: jax.Array, v: jax.Array, log_decay: jax.Array,
         initial_state: jax.Array | None, cu_seqlens: jax.Array | None
         ) -> _sharding.Plan | None:
  """How a call splits over the mesh when its time axis is split; None when
  no argument's time axis is split over an Explicit mesh axis.

  Raises:
    ValueError: naming the argument and the axis, when the arguments split
      their time (or batch, or head) axes differently or cannot be cut evenly
      alike, when the key or value size is split, or with `cu_seqlens`
      (packed sequences across a split time axis are not supported yet).
  """
  if not _sequence_parallel.splits_time(q, k, v, log_decay):
    return None
  if cu_seqlens is not None:
    raise ValueError(
        "ssd: `cu_seqlens` (packed sequences) cannot be used with the sequence axis "
        "(axis 1) of `q`, `k`, `v` and `log_decay` split over mesh axes; not supported "
        "yet: keep the sequence axis whole, or pass a batch of sequences without it")
  return _sharding.plan("ssd", (
      ("q", q, _TOKENS), ("k", k, _TOKENS), ("v", v, _TOKENS),
      ("log_decay", log_decay, _PER_HEAD), ("initial_state", initial_state, _STATE)),
      split=("batch", "seq", "heads"))


def _step(state, summary):
  """The state leaving a chunk, from the state entering it."""
  final, total = summary  # [B, N, K, V], [B, N]
  return jnp.exp(total)[..., None, None] * state + final


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
    y: [B, T, N, V], split as `v` is; final_state: [B, N, K, V] float32.
  """
  axes = _sequence_parallel.time_axes(split)

  def chunk(q, k, v, log_decay, initial_state):  # [B, t, ...] each; initial_state [B, N, K, V]
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
