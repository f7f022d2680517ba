"""`linear_scan` with its time axis split over mesh axes (context parallelism).

Within one device's chunk of time steps, the scan from the true entering
state `h_in` is the scan from zero plus `h_in` carried through the chunk's
decays:

  h_t = h'_t + (prod_{s <= t in the chunk} a_s) * h_in

(with `reverse`, the product runs over s >= t). Each device scans its chunk
from zero with the chosen implementation, takes the running product of its
`a` (whose last row is the chunk's total decay), and `ops/_sequence_parallel.py`
passes the (final state, total decay) pairs, [n, B, D] each, across the
devices to give each its `h_in`. The caller's `initial_state` enters the
first chunk through that pass.

Glossary of shapes: B batch, T time, D channels, n chunks (devices along the
sequence axes), t = T / n steps per chunk.
"""

from typing import Callable

import jax
import jax.numpy as jnp

from ops import _sequence_parallel
from ops import _sharding
from ops.linear_scan.reference import accumulation_dtype

_LAYOUT = ("batch", "seq", "channels")  # a [B, T, D], b
_STATE = ("batch", "channels")  # initial_state, final_state [B, D]


def plan(a: jax.Array, b: jax.Array, initial_state: jax.Array | None) -> _sharding.Plan:
  """How a call splits over the mesh, its time axis included.

  Raises:
    ValueError: naming the argument and the axis, when `a` and `b` split
      their time (or batch, or channel) axes differently, or when one cannot
      be cut evenly the way the other is.
  """
  return _sharding.plan("linear_scan", (
      ("a", a, _LAYOUT if a.ndim == 3 else ("channels",)), ("b", b, _LAYOUT),
      ("initial_state", initial_state, _STATE)), split=("batch", "seq", "channels"))


def _step(state, summary):
  """The state leaving a chunk, from the state entering it."""
  final, decay = summary  # [B, D] each
  return decay * state + final


def linear_scan_split(scan: Callable, split: _sharding.Plan, *,
                      reverse: bool) -> tuple[jax.Array, jax.Array]:
  """`linear_scan` on `split`'s arrays with the time axis split over its mesh axes.

  Args:
    scan: the implementation, `scan(a=, b=, initial_state=, reverse=) -> (h,
      final_state)`, run on each device's chunk ([B, t, D]) from a zero state.
    split: `plan(a, b, initial_state)`, splitting "seq".
    reverse: as `linear_scan`'s; the chunks are then taken from the last
      device to the first.

  Returns:
    h: [B, T, D], split as `b` is; final_state: [B, D].
  """
  axes = _sequence_parallel.time_axes(split)

  def chunk(a, b, initial_state):  # a [B, t, D] or [D], b [B, t, D], initial_state [B, D]
    h, final = scan(a=a, b=b, initial_state=None, reverse=reverse)  # from zero
    out_dtype = h.dtype
    acc = jnp.promote_types(out_dtype, accumulation_dtype(out_dtype))
    decays = jax.lax.cumprod(jnp.broadcast_to(a, b.shape).astype(acc), axis=1,
                             reverse=reverse)  # [B, t, D]: h_in's weight in h_t
    total = decays[:, 0] if reverse else decays[:, -1]  # [B, D]
    start = (jnp.zeros(total.shape, acc) if initial_state is None
             else initial_state.astype(acc))
    entering, final = _sequence_parallel.entering_states(
        _step, start, (final.astype(acc), total), axes, reverse=reverse)
    h = h.astype(acc) + decays * entering[:, None]
    return h.astype(out_dtype), final.astype(out_dtype)

  return _sequence_parallel.run(split, chunk, [_LAYOUT, _STATE])
