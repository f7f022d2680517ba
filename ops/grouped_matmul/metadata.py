"""Which (group, row tile) pairs a grouped-matmul grid visits.

Shared by the Triton (`triton.py`) and Mosaic GPU (`mosaic.py`) kernels: the
M rows are cut into `block_m` tiles and a tile that straddles a group boundary
is visited once per group it touches (MegaBlocks, https://arxiv.org/abs/2211.15841).
"""

import jax
import jax.numpy as jnp


def group_metadata(starts: jax.Array, ends: jax.Array, padded_rows: int,
                   block_m: int) -> tuple[jax.Array, ...]:
  """Per-grid-step (group, row tile, first row, end row) for `gmm`.

  Args:
    starts, ends: [G] row bounds of each group (contiguous, ends <= M).
    padded_rows: M rounded up to a multiple of `block_m`.
    block_m: rows per tile.

  Returns:
    group, tile, row_start, row_end: each [T] int32 with
    T = padded_rows // block_m + G. Group G is the pseudo-group of rows after
    the last group (its output is zero); steps past the real end have
    row_start == row_end == 0 and store nothing.
  """
  num_groups = starts.shape[0]
  # G + 1 segments that partition [0, padded_rows): the groups, then the rest.
  seg_ends = jnp.concatenate([ends, jnp.full((1,), padded_rows, jnp.int32)])
  seg_starts = jnp.concatenate([starts, ends[-1:]])
  first_tile = seg_starts // block_m
  num_tiles = jnp.where(seg_ends > seg_starts,
                        (seg_ends - 1) // block_m - first_tile + 1, 0)  # [G+1]
  inclusive = jnp.cumsum(num_tiles)  # [G+1]
  exclusive = inclusive - num_tiles
  steps = padded_rows // block_m + num_groups
  step = jnp.arange(steps, dtype=jnp.int32)  # [T]
  seg = jnp.sum(step[:, None] >= inclusive[None, :], axis=1).astype(jnp.int32)  # [T]
  valid = seg <= num_groups
  seg = jnp.minimum(seg, num_groups)
  tile = jnp.where(valid, first_tile[seg] + step - exclusive[seg], 0)
  row_start = jnp.where(valid, seg_starts[seg], 0)
  row_end = jnp.where(valid, seg_ends[seg], 0)
  return seg, tile.astype(jnp.int32), row_start, row_end
