"""Reading one row of a value inside a Pallas Triton kernel."""

import jax
from jax import lax
import jax.numpy as jnp


def pick_row(x: jax.Array, row, *, keepdims: bool = False) -> jax.Array:
  """`x[row]` along axis 0 of a value inside a kernel, as a masked sum over
  that axis (Triton values cannot be indexed). `row` may be traced."""
  rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.sum(jnp.where(rows == row, x, 0.0), axis=0, keepdims=keepdims)
