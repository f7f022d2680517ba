"""`gated_delta_rule` with its time axis split over mesh axes (context parallelism).

In the [K, V] layout of `ops.ssd` the state after a token is linear jointly in
the state before it and the token's value,

  M_t = exp(g_t) (I - beta_t k_t k_t^T) M_{t-1} + beta_t k_t v_t^T,

so within one device's chunk of tokens, from the true entering state `H_in`,

  M_t = M'_t + P_t H_in,   y_t = y'_t + (scale P_t^T q_t)^T H_in

with `M'`, `y'` the chunk's states and outputs from zero and `P_t` [K, K] the
product of the chunk's transitions up to t, inclusive. Both come from one run
of the chosen implementation on values widened by K zero columns, from the
state [0_V, I_K]: each column evolves alone, the zero values write nothing
(whatever beta), so the first V columns are `M'`, `y'` and the last K are
`P_t` and `scale P_t^T q_t` (a second run, on zero values from I, where the
implementation cannot take V + K value columns). `ops/_sequence_parallel.py`
passes the (final state [B, N, K, V], total transition [B, N, K, K]) pairs
across the devices to give each its `H_in`; the caller's `initial_state`
enters the first chunk through that pass.

Packed sequences (`cu_seqlens`, a batch of one): each device runs its chunk
with the offsets cut to its tokens; the sequence carried in from the
previous device starts from [0_V, I_K] and every other from [its initial
state, 0_K], so the last K columns are that sequence's `P_t` and zero
elsewhere. The pass carries the state of the sequence open at each chunk's
end with its transition (0 unless it is the carried one), and one
[S, N, K, V] psum collects each sequence's final state from the device
holding its last token.

Glossary of shapes: B batch, T time, N heads, G query/key groups (N % G == 0),
K key size, V value size, n chunks (devices along the sequence axes),
t = T / n tokens per chunk.
"""

import functools

import jax
import jax.numpy as jnp

from ops import _sequence_parallel
from ops import _sharding
from ops import registry
from ops.ssd.xla import einsum

_F32 = jnp.float32
_TOKENS = ("batch", "seq", "heads", None)  # q, k [B, T, G, K]; v, y [B, T, N, V]
_PER_HEAD = ("batch", "seq", "heads")  # log_decay, beta [B, T, N]
_STATE = ("batch", "heads", None, None)  # initial_state, final_state [B, N, K, V]
_SEQUENCE_STATE = (None, "heads", None, None)  # with cu_seqlens: [S, N, K, V]


def plan(q: jax.Array, k: jax.Array, v: jax.Array, log_decay: jax.Array, beta: jax.Array,
         initial_state: jax.Array | None, cu_seqlens: jax.Array | None
         ) -> _sharding.Plan | None:
  """How a call splits over the mesh when its time axis is split; None when
  no argument's time axis is split over an Explicit mesh axis.

  Raises:
    ValueError: naming the argument and the axis, when the arguments split
      their time (or batch, or head) axes differently or cannot be cut evenly
      alike, or when the key or value size is split.
  """
  if not _sequence_parallel.splits_time(q, k, v, log_decay, beta):
    return None
  return _sharding.plan("gated_delta_rule", (
      ("q", q, _TOKENS), ("k", k, _TOKENS), ("v", v, _TOKENS),
      ("log_decay", log_decay, _PER_HEAD), ("beta", beta, _PER_HEAD),
      ("initial_state", initial_state, _STATE if cu_seqlens is None else _SEQUENCE_STATE),
      ("cu_seqlens", cu_seqlens, (None,))),
      split=("batch", "seq", "heads"))


def _step(state, summary):
  """The state leaving a chunk, from the state entering it."""
  final, transition = summary  # [B, N, K, V], [B, N, K, K]
  return einsum("bnkj,bnjv->bnkv", transition, state) + final


def _with_transitions(implementation: registry.Implementation, call: dict, start, identity):
  """One chunk's (y' [B, t, N, V], scale P_t^T q_t [B, t, N, K], final
  states [., N, K, V], transitions P [., N, K, K]) from the states `start`
  [., N, K, V] (None: zeros) and `identity` [., N, K, K] (I where P is
  wanted)."""
  v = call["v"]
  value, key = v.shape[-1], identity.shape[-1]
  no_values = jnp.zeros((*v.shape[:-1], key), v.dtype)
  zeros = jnp.zeros((*identity.shape[:-1], value), _F32)
  widened = dict(call, v=jnp.concatenate([v, no_values], axis=-1),
                 initial_state=jnp.concatenate([zeros if start is None else start, identity],
                                               axis=-1))
  if implementation.supports(widened) is None:
    y, final = implementation.run(**widened)
    return y[..., :value], y[..., value:], final[..., :value], final[..., value:]
  # The kernel's value-size limit: the identity's columns in a run of their own.
  y, final = implementation.run(**dict(call, initial_state=start))
  carried, transition = implementation.run(**dict(call, v=no_values, initial_state=identity))
  return y, carried, final, transition


def gated_delta_rule_split(implementation: registry.Implementation, split: _sharding.Plan, *,
                           scale: float | None, chunk_size: int | None
                           ) -> tuple[jax.Array, jax.Array]:
  """`gated_delta_rule` on `split`'s arrays with the time axis split over its mesh axes.

  Args:
    implementation: the chosen implementation; its `run(q=, k=, v=,
      log_decay=, beta=, scale=, initial_state=, chunk_size=, cu_seqlens=) ->
      (y, final_state)` runs on each device's chunk ([B, t, ...]).
    split: `plan(...)`, splitting "seq".
    scale, chunk_size: as `gated_delta_rule`'s, for each device's chunk.

  Returns:
    y: [B, T, N, V], split as `v` is; final_state: [B, N, K, V] float32
    ([S, N, K, V] with `cu_seqlens`).
  """
  axes = _sequence_parallel.time_axes(split)
  if split.args[-1] is not None:  # cu_seqlens
    return _sequence_parallel.run(
        split, functools.partial(_packed, implementation, axes, scale, chunk_size),
        [_TOKENS, _SEQUENCE_STATE])

  def chunk(q, k, v, log_decay, beta, initial_state, cu_seqlens):  # [B, t, ...]; [B, N, K, V]
    del cu_seqlens  # None here: `_packed` takes packed sequences
    call = dict(q=q, k=k, v=v, log_decay=log_decay, beta=beta, scale=scale,
                initial_state=None, chunk_size=chunk_size, cu_seqlens=None)
    batch, heads, key = v.shape[0], v.shape[2], k.shape[-1]
    identity = jnp.broadcast_to(jnp.eye(key, dtype=_F32), (batch, heads, key, key))
    y, carried, final, transition = _with_transitions(implementation, call, None, identity)
    start = (jnp.zeros(final.shape, _F32) if initial_state is None
             else initial_state.astype(_F32))
    entering, final = _sequence_parallel.entering_states(
        _step, start, (final.astype(_F32), transition.astype(_F32)), axes)
    y = y.astype(_F32) + einsum("btnj,bnjv->btnv", carried, entering)
    return y.astype(v.dtype), final

  return _sequence_parallel.run(split, chunk, [_TOKENS, _STATE])


def _packed(implementation: registry.Implementation, axes, scale, chunk_size, q, k, v,
            log_decay, beta, initial_state, cu_seqlens):
  """One device's chunk ([1, t, ...]) of packed sequences: (y [1, t, N, V],
  every sequence's final state [S, N, K, V] float32, the same on every device)."""
  t = q.shape[1]
  packed = _sequence_parallel.packed_chunk(cu_seqlens, axes, t)
  heads, key, value = v.shape[2], k.shape[-1], v.shape[-1]
  initial = (jnp.zeros((packed.ends.shape[0], heads, key, value), _F32)
             if initial_state is None else initial_state.astype(_F32))
  is_carried = packed.carried[:, None, None, None]
  call = dict(q=q, k=k, v=v, log_decay=log_decay, beta=beta, scale=scale, initial_state=None,
              chunk_size=chunk_size, cu_seqlens=packed.offsets)
  y, carried_y, finals, transitions = _with_transitions(
      implementation, call, jnp.where(is_carried, 0.0, initial),
      jnp.where(is_carried, jnp.eye(key, dtype=_F32), jnp.zeros((*initial.shape[:2], key, key),
                                                                  _F32)))  # [S, N, K, K]
  finals, transitions = finals.astype(_F32), transitions.astype(_F32)
  # The state leaving the chunk: that of the sequence holding its last token,
  # whose transition is 0 unless it is the carried one.
  entering, _ = _sequence_parallel.entering_states(
      _step, jnp.zeros((1, heads, key, value), _F32),
      (finals[packed.last][None], transitions[packed.last][None]), axes)  # [1, N, K, V]: H_in
  y = y.astype(_F32) + einsum("btnj,bnjv->btnv", carried_y.astype(_F32), entering)
  finals = finals + einsum("snkj,njv->snkv", transitions, entering[0])
  return y.astype(v.dtype), _sequence_parallel.collect_finals(packed, t, finals, initial, axes)
