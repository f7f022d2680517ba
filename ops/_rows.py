"""Rows of values inside Pallas Triton kernels: which time steps a tile walks,
and reading one row of a value."""

import jax
from jax import lax
import jax.numpy as jnp


def tile_steps(j, chunk: int, unroll: int, reverse: bool) -> list:
  """The time indices (within a chunk of `chunk` steps) of tile `j`'s `unroll`
  steps, in processing order: with `reverse`, tiles and the steps inside them
  run from the end of the chunk back. `j` may be traced."""
  tile = chunk // unroll - 1 - j if reverse else j
  order = range(unroll - 1, -1, -1) if reverse else range(unroll)
  return [tile * unroll + r for r in order]


def pick_row(x: jax.Array, row, *, keepdims: bool = False) -> jax.Array:
  """`x[row]` along axis 0 of a value inside a kernel, as a masked sum over
  that axis (Triton values cannot be indexed). `row` may be traced."""
  rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.sum(jnp.where(rows == row, x, 0.0), axis=0, keepdims=keepdims)
