"""The specification of `grouped_matmul`: one dense matmul per group.

`jax.lax.ragged_dot` semantics: the rows of `lhs` are split into `G`
contiguous groups of `group_sizes[g]` rows, in order, and the rows of group `g`
are multiplied by `rhs[g]`. Rows after the last group are zero in the output.

Glossary of shapes: M rows, K contraction, N output columns, G groups.
"""

import jax
import jax.numpy as jnp


def group_bounds(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
  """Start and end row of each group, clipped to `[0, num_rows]`.

  Args:
    group_sizes: [G] non-negative integers.
    num_rows: M.

  Returns:
    (starts, ends), each [G] int32. A group that would run past row M is cut
    at M, and the groups after it are empty.
  """
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)  # [G]
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])  # [G]
  return starts, ends


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array,
                             group_sizes: jax.Array) -> jax.Array:
  """Grouped matmul by a scan over groups of masked dense matmuls (fp32).

  Args:
    lhs: [M, K].
    rhs: [G, K, N].
    group_sizes: [G] integers.

  Returns:
    [M, N] in `lhs.dtype`: row i of group g is `lhs[i] @ rhs[g]`.
  """
  num_rows = lhs.shape[0]
  starts, ends = group_bounds(group_sizes, num_rows)
  rows = jnp.arange(num_rows)  # [M]
  lhs32 = lhs.astype(jnp.float32)

  def one_group(out, xs):
    w, start, end = xs  # [K, N], [], []
    in_group = (rows >= start) & (rows < end)  # [M]
    y = jnp.dot(lhs32, w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out + jnp.where(in_group[:, None], y, 0.0), None

  out = jnp.zeros((num_rows, rhs.shape[2]), jnp.float32)  # [M, N]
  out, _ = jax.lax.scan(one_group, out, (rhs, starts, ends))
  return out.astype(lhs.dtype)
