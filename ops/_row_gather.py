"""Row gathers whose backward pass is a gather too.

`x[rows]` differentiates to a scatter-add of the rows' gradients into x's
shape, which on GPUs is much slower than a gather. When every row of x is
taken the same number of times k (the tokens of a top-k mixture of experts),
the positions that took row t, `inverse[t] = [i_0, .., i_{k-1}]`, turn that
scatter-add into a gather-sum.

Shapes: T rows of x, A = T * k gathered rows, D columns.
"""

import jax
import jax.numpy as jnp


def sum_gathered(values: jax.Array, inverse: jax.Array) -> jax.Array:
  """`out[t] = sum_j values[inverse[t, j]]`: [A, D], [T, k] int -> [T, D].

  Written as k gathers added in float32 rather than a reduction over a
  [T, k, D] gather, so that XLA makes one loop fusion of it, which its
  elementwise consumers (the token gradient's other terms) join.
  """
  total = values[inverse[:, 0]].astype(jnp.float32)
  for j in range(1, inverse.shape[1]):
    total = total + values[inverse[:, j]].astype(jnp.float32)
  return total.astype(values.dtype)


@jax.custom_vjp
def gather_rows(x: jax.Array, rows: jax.Array, inverse: jax.Array) -> jax.Array:
  """`x[rows]` ([T, D] -> [A, D]) whose gradient is `sum_gathered(dxs, inverse)`.

  Args:
    x: [T, D].
    rows: [A] int32 row of x for each output row.
    inverse: [T, k] int32, the k output rows that took each row of x (every
      row of x is taken exactly k times; A = T * k).
  """
  return x[rows]


def _gather_rows_fwd(x, rows, inverse):
  return x[rows], inverse


def _gather_rows_bwd(inverse, dxs):
  return sum_gathered(dxs, inverse), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)

