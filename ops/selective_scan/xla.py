"""The XLA tier of `selective_scan`: `lax.associative_scan` over time.

It materializes the decays and the states, `[B, T, D, S]` each, which is why
it runs out of memory long before the Pallas kernel (which keeps `[D, S]` on
chip).

Glossary of shapes: B batch, T time, D channels, S state size.
"""

import jax
import jax.numpy as jnp

from ops.selective_scan.step import finish_output
from ops.selective_scan.step import prepare_delta


def _combine(first, second):
  a1, b1 = first
  a2, b2 = second
  return a1 * a2, a2 * b1 + b2


def per_channel(x: jax.Array, width: int) -> jax.Array:
  """B or C, [B, T, S], per group [B, T, G, S] or time-invariant [D, S], as
  float32 broadcastable to [B, T, D, S] (channel d reads group d // (D / G))."""
  x = x.astype(jnp.float32)
  if x.ndim == 2:
    return x
  return jnp.repeat(x, width // x.shape[2], axis=2) if x.ndim == 4 else x[:, :, None, :]


def selective_scan_xla(u, delta, A, B, C, *, D=None, z=None, delta_bias=None,
                       delta_softplus=False, initial_state=None, reverse=False,
                       return_final_state=True):
  """Same contract as `selective_scan_reference`, computed associatively."""
  delta = prepare_delta(delta, delta_bias, delta_softplus)              # [B, T, D]
  decay = jnp.exp(delta[..., None] * A.astype(jnp.float32))              # [B, T, D, S]
  width = u.shape[2]
  x = (delta * u.astype(jnp.float32))[..., None] * per_channel(B, width)  # [B, T, D, S]
  first = -1 if reverse else 0
  if initial_state is not None:
    x = x.at[:, first].add(decay[:, first] * initial_state.astype(jnp.float32))
  _, h = jax.lax.associative_scan(_combine, (decay, x), axis=1, reverse=reverse)
  y = jnp.sum(h * per_channel(C, width), axis=-1)                       # [B, T, D]
  final = (h[:, 0] if reverse else h[:, -1]) if return_final_state else None
  return finish_output(y, u, D, z), final
