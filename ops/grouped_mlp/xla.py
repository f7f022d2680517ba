"""The XLA path of `grouped_mlp`: two `jax.lax.ragged_dot`s around the activation.

XLA differentiates it; the hidden pre-activation and activation are written to
memory between the ops, which the Pallas path avoids.
"""

import jax

from ops.grouped_matmul.xla import grouped_matmul_xla
from ops.grouped_mlp.activations import activate
from ops.grouped_mlp.activations import Activation


def grouped_mlp_xla(x: jax.Array, w_in: jax.Array, w_out: jax.Array,
                    group_sizes: jax.Array, *,
                    activation: Activation) -> jax.Array:
  """[M, D] -> [M, D'] in `x.dtype` (shapes as `grouped_mlp_reference`)."""
  h = grouped_matmul_xla(x, w_in.astype(x.dtype), group_sizes)
  return grouped_matmul_xla(activate(h, activation), w_out.astype(x.dtype),
                            group_sizes)
