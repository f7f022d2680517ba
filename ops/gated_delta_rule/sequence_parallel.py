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

Glossary of shapes: B batch, T time, N heads, G query/key groups (N % G == 0),
K key size, V value size, n chunks (devices along the sequence axes),
t = T / n tokens per chunk.
"""

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


def plan(q: jax.Array, k: jax.Array, v: jax.Array, log_decay: jax.Array, beta: jax.Array,
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
  if not _sequence_parallel.splits_time(q, k, v, log_decay, beta):
    return None
  if cu_seqlens is not None:
    raise ValueError(
        "gated_delta_rule: `cu_seqlens` (packed sequences) cannot be used with the "
        "sequence axis (axis 1) of `q`, `k`, `v`, `log_decay` and `beta` split over mesh "
        "axes; not supported yet: keep the sequence axis whole, or pass a batch of "
        "sequences without it")
  return _sharding.plan("gated_delta_rule", (
      ("q", q, _TOKENS), ("k", k, _TOKENS), ("v", v, _TOKENS),
      ("log_decay", log_decay, _PER_HEAD), ("beta", beta, _PER_HEAD),
      ("initial_state", initial_state, _STATE)),
      split=("batch", "seq", "heads"))


def _step(state, summary):
  """The state leaving a chunk, from the state entering it."""
  final, transition = summary  # [B, N, K, V], [B, N, K, K]
  return einsum("bnkj,bnjv->bnkv", transition, state) + final


def _from_zero_and_identity(implementation: registry.Implementation, call: dict):
  """One chunk's (y' [B, t, N, V], scale P_t^T q_t [B, t, N, K], final state
  from zero [B, N, K, V], total transition P [B, N, K, K])."""
  v, key = call["v"], call["k"].shape[-1]
  batch, time, heads, value = v.shape
  identity = jnp.broadcast_to(jnp.eye(key, dtype=_F32), (batch, heads, key, key))
  no_values = jnp.zeros((batch, time, heads, key), v.dtype)
  widened = dict(call, v=jnp.concatenate([v, no_values], axis=-1),
                 initial_state=jnp.concatenate(
                     [jnp.zeros((batch, heads, key, value), _F32), identity], axis=-1))
  if implementation.supports(widened) is None:
    y, final = implementation.run(**widened)
    return y[..., :value], y[..., value:], final[..., :value], final[..., value:]
  # The kernel's value-size limit: the identity's columns in a run of their own.
  y, final = implementation.run(**dict(call, initial_state=None))
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
    y: [B, T, N, V], split as `v` is; final_state: [B, N, K, V] float32.
  """
  axes = _sequence_parallel.time_axes(split)

  def chunk(q, k, v, log_decay, beta, initial_state):  # [B, t, ...]; initial_state [B, N, K, V]
    call = dict(q=q, k=k, v=v, log_decay=log_decay, beta=beta, scale=scale,
                initial_state=None, chunk_size=chunk_size, cu_seqlens=None)
    y, carried, final, transition = _from_zero_and_identity(implementation, call)
    start = (jnp.zeros(final.shape, _F32) if initial_state is None
             else initial_state.astype(_F32))
    entering, final = _sequence_parallel.entering_states(
        _step, start, (final.astype(_F32), transition.astype(_F32)), axes)
    y = y.astype(_F32) + einsum("btnj,bnjv->btnv", carried, entering)
    return y.astype(v.dtype), final

  return _sequence_parallel.run(split, chunk, [_TOKENS, _STATE])
