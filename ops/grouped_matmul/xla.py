"""The XLA path of `grouped_matmul`: `jax.lax.ragged_dot` with fp32 accumulation.

Its gradients are XLA's own transposes of `ragged_dot` (a ragged dot against
the transposed weights for `lhs`, a ragged contraction over rows for `rhs`).
"""

import jax
import jax.numpy as jnp


def grouped_matmul_xla(lhs: jax.Array, rhs: jax.Array,
                       group_sizes: jax.Array) -> jax.Array:
  """[M, K] x [G, K, N] with [G] group sizes -> [M, N] in `lhs.dtype`."""
  out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                           preferred_element_type=jnp.float32)
  return out.astype(lhs.dtype)
