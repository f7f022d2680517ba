"""`selective_scan` with its time axis split over mesh axes (context parallelism).

The state is linear in the state entering a chunk of time steps: from the
true entering state `h_in`, the chunk's states are its states from zero plus
`h_in` carried through its decays,

  h_t = h'_t + exp(A * sum_{s <= t in the chunk} delta_s) * h_in    # [B, D, S]

(with `reverse`, the sum runs over s >= t), so its outputs before the skip
and the gate are

  y_t = y'_t + sum_S C_t * exp(A * sum_{s <= t} delta_s) * h_in.

Each device scans its chunk from zero with the chosen implementation, without
`D` and `z` and with `u` in float32 (so `y'` is not rounded before the
correction), sums its step sizes, and `ops/_sequence_parallel.py` passes the
(final state [B, D, S], summed step sizes [B, D]) pairs across the devices to
give each its `h_in`; the device then corrects `y'` and applies the skip and
the gate (`finish_output`) to the corrected outputs. The caller's
`initial_state` enters the first chunk through that pass.

Glossary of shapes: B batch, T time, D channels, S state size, n chunks
(devices along the sequence axes), t = T / n steps per chunk.
"""

from typing import Callable

import jax
import jax.numpy as jnp

from ops import _sequence_parallel
from ops import _sharding
from ops.selective_scan.step import finish_output
from ops.selective_scan.step import prepare_delta
from ops.selective_scan.xla import per_channel

_TOKEN = ("batch", "seq", "channels")  # u, delta, z, y [B, T, D]
_STATE = ("batch", "channels", None)  # initial_state, final_state [B, D, S]


def plan(named_args) -> _sharding.Plan | None:
  """How a call splits over the mesh, its time axis included; None when no
  per-step array's time axis is split over Explicit mesh axes (the call then
  runs as the op otherwise would).

  Args:
    named_args: (argument name, array or None, layout) of every argument, in
      the order the implementation takes them, "seq" labelling time axes
      (axis 1 of the per-step arrays).

  Raises:
    ValueError: naming the argument and the axis, when the per-step arrays
      split their time (or batch, or channel) axes differently, when one
      cannot be cut evenly the way another is, or when any other axis (the
      state size) is split.
  """
  # Time-invariant B and C ([D, S]) have no time axis.
  per_step = [x for _, x, layout in named_args if layout[1:2] == ("seq",)]
  if not _sequence_parallel.splits_time(*per_step):
    return None
  return _sharding.plan("selective_scan", named_args, split=("batch", "seq", "channels"))


def _decay(log_decay: jax.Array, A: jax.Array) -> jax.Array:
  """exp(A * summed step sizes): [..., D] and [D, S] -> [..., D, S]."""
  return jnp.exp(log_decay[..., None] * A.astype(jnp.float32))


def selective_scan_split(scan: Callable, split: _sharding.Plan, *, delta_softplus: bool,
                         reverse: bool, return_final_state: bool
                         ) -> tuple[jax.Array, jax.Array | None]:
  """`selective_scan` on `split`'s arrays with the time axis split over its mesh axes.

  Args:
    scan: the implementation, taking `selective_scan`'s arguments by keyword
      and returning (y, final_state); run on each device's chunk ([B, t, D])
      from a zero state.
    split: `plan(...)` of (u, delta, A, B, C, D, z, delta_bias,
      initial_state), splitting "seq".
    delta_softplus, reverse, return_final_state: as `selective_scan`'s; with
      `reverse` the chunks are taken from the last device to the first.

  Returns:
    y: [B, T, D] in `u`'s dtype, split as `u` is; final_state: [B, D, S]
    float32, or None unless `return_final_state`.
  """
  axes = _sequence_parallel.time_axes(split)

  def chunk(u, delta, A, B, C, D, z, delta_bias, initial_state):
    y, final = scan(u=u.astype(jnp.float32), delta=delta, A=A, B=B, C=C, D=None, z=None,
                    delta_bias=delta_bias, delta_softplus=delta_softplus,
                    initial_state=None, reverse=reverse, return_final_state=True)
    # h_in's decay at each step: exp(A * the step sizes summed up to it).
    log_decay = jax.lax.cumsum(prepare_delta(delta, delta_bias, delta_softplus), axis=1,
                               reverse=reverse)  # [B, t, D]
    total = log_decay[:, 0] if reverse else log_decay[:, -1]  # [B, D]
    start = (jnp.zeros(final.shape, jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))

    def step(state, summary):  # the state leaving a chunk, from the one entering it
      chunk_final, chunk_total = summary  # [B, D, S], [B, D]
      return _decay(chunk_total, A) * state + chunk_final

    entering, final = _sequence_parallel.entering_states(
        step, start, (final.astype(jnp.float32), total), axes, reverse=reverse)
    width = u.shape[2]
    carried = _decay(log_decay, A) * entering[:, None]  # [B, t, D, S]
    y = y.astype(jnp.float32) + jnp.sum(per_channel(C, width) * carried, axis=-1)
    y = finish_output(y, u, D, z)
    return (y, final) if return_final_state else y

  if not return_final_state:
    return _sequence_parallel.run(split, chunk, _TOKEN), None
  return _sequence_parallel.run(split, chunk, [_TOKEN, _STATE])
