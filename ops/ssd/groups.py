"""Query/key groups: N heads reading G shared query/key groups (N % G == 0).

Mamba-2's `ngroups` (B and C shared by N // G heads), as grouped-query
attention shares keys; every tier of `ops.ssd` and `ops.gated_delta_rule`
expands the groups to heads the same way.

Glossary of shapes: N heads, G query/key groups, K key size.
"""

import jax
import jax.numpy as jnp


def expand_groups(x: jax.Array, num_heads: int) -> jax.Array:
  """[..., G, K] -> [..., N, K]: head n reads group n // (N // G)."""
  groups = x.shape[-2]
  if groups == num_heads:
    return x
  return jnp.repeat(x, num_heads // groups, axis=-2)
