"""The XLA tier of `linear_scan`: `lax.associative_scan` over time.

`(a1, b1) o (a2, b2) = (a1 a2, a2 b1 + b2)` composes two steps of
`h -> a h + b`; the scan takes O(log T) elementwise passes and materializes
the prefix products of `a` beside the states.

Glossary of shapes: B batch, T time, D channels.
"""

import jax
import jax.numpy as jnp

from ops.linear_scan.reference import accumulation_dtype


def _combine(first, second):
  a1, b1 = first
  a2, b2 = second
  return a1 * a2, a2 * b1 + b2


def linear_scan_xla(a: jax.Array, b: jax.Array, *,
                    initial_state: jax.Array | None = None,
                    reverse: bool = False) -> tuple[jax.Array, jax.Array]:
  """Same contract as `linear_scan_reference`, computed associatively."""
  out_dtype = jnp.result_type(a, b)
  acc = accumulation_dtype(out_dtype)
  a = jnp.broadcast_to(a, b.shape).astype(acc)  # [B, T, D]
  b = b.astype(acc)  # [B, T, D]
  first = -1 if reverse else 0
  if initial_state is not None:
    # Fold h_{-1} into the first step processed: b_0 += a_0 h_{-1}.
    b = b.at[:, first].add(a[:, first] * initial_state.astype(acc))
  _, h = jax.lax.associative_scan(_combine, (a, b), axis=1, reverse=reverse)
  final = h[:, 0] if reverse else h[:, -1]
  return h.astype(out_dtype), final.astype(out_dtype)
