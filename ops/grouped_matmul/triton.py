"""Triton kernels for `grouped_matmul`, forward and backward.

The approach is the "group metadata" grouped GEMM of MegaBlocks
(https://arxiv.org/abs/2211.15841) and JAX's megablox: the M rows are cut into
`block_m` tiles, and a small on-device precomputation lists, for every grid
step, one (group, row tile) pair. A tile that straddles a group boundary is
visited once per group it touches and each visit stores only its own group's
rows, so no two grid steps write the same output row. The list has a static
length, `cdiv(M, block_m) + G` (each of the G boundaries adds at most one
visit), and steps past its real end store nothing.

Two kernels:
- `gmm`:  out[rows of g] = lhs[rows of g] @ rhs[g]       (forward; with
  `transpose_rhs=True` it is the input gradient `dout @ rhs[g]^T`),
- `tgmm`: drhs[g] = lhs[rows of g]^T @ dout[rows of g]   (weight gradient),
  a grid over (G, K blocks, N blocks) whose inner loop walks that group's row
  tiles.
`pallas.py` ties them, and the Mosaic GPU kernels, into the custom VJP.

Rows after the last group (possible when `sum(group_sizes) < M`) are a
pseudo-group G whose output is zero, as in `jax.lax.ragged_dot`.

Glossary of shapes: M rows, K contraction, N output columns, G groups,
T grid steps over row tiles (`cdiv(M, block_m) + G`).
"""

import functools
from typing import NamedTuple

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from ops import _backend
from ops import _pallas
from ops import _shapes
from ops._triton import dot
from ops.grouped_matmul import configs
from ops.grouped_matmul.metadata import group_metadata


class Tile(NamedTuple):
  """Where one `gmm` grid step works (see `tile_of_step`)."""
  group: jax.Array   # this visit's group; G for the rows after the last group
  weight: jax.Array  # the rhs index: `group` clipped to G - 1
  rows: pl.Slice     # the block_m rows of the tile
  col0: jax.Array    # first output column of the program
  mine: jax.Array    # [block_m] bool, rows of the tile that belong to `group`


def tile_of_step(group_ref, tile_ref, start_ref, end_ref, *, num_groups, block_m,
                 block_n, columns_fastest) -> Tile:
  """Reads the group metadata for the current program of a `gmm`-style grid."""
  if columns_fastest:
    col_block, step = pl.program_id(0), pl.program_id(1)
  else:
    step, col_block = pl.program_id(0), pl.program_id(1)
  group = group_ref[step]
  row0 = pl.multiple_of(tile_ref[step] * block_m, block_m)
  row_ids = row0 + jnp.arange(block_m)
  mine = (row_ids >= start_ref[step]) & (row_ids < end_ref[step])
  return Tile(group=group, weight=jnp.minimum(group, num_groups - 1),
              rows=pl.ds(row0, block_m),
              col0=pl.multiple_of(col_block * block_n, block_n), mine=mine)


def tile_products(lhs_ref, rhs_ref, tile: Tile, col_offsets, *, num_groups, k_steps,
                  block_k, block_n, transpose_rhs):
  """`lhs[rows] @ rhs[weight][:, cols]` for the tile, one per column offset.

  Args:
    col_offsets: static offsets added to the tile's columns; several offsets
      share each lhs tile load (SwiGLU's gate and value halves).

  Returns:
    A list of [block_m, block_n] float32 accumulators, zero for the rows after
    the last group.
  """
  col_sets = [pl.ds(tile.col0 + offset, block_n) for offset in col_offsets]

  def body(k, accs):
    ks = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
    a = plgpu.load(lhs_ref.at[tile.rows, ks])  # [bm, bk]
    if transpose_rhs:
      return [acc + dot(a, plgpu.load(rhs_ref.at[tile.weight, cols, ks]), trans_b=True)
              for acc, cols in zip(accs, col_sets)]  # rhs tile [bn, bk]
    return [acc + dot(a, plgpu.load(rhs_ref.at[tile.weight, ks, cols]))
            for acc, cols in zip(accs, col_sets)]  # rhs tile [bk, bn]

  zeros = [jnp.zeros((tile.rows.size, block_n), jnp.float32) for _ in col_sets]
  accs = jax.lax.fori_loop(0, k_steps, body, zeros)
  # The pseudo-group (rows after the last group) multiplies by no weight.
  return [jnp.where(tile.group < num_groups, acc, 0.0) for acc in accs]


def _gmm_kernel(group_ref, tile_ref, start_ref, end_ref, lhs_ref, rhs_ref, out_ref,
                *, num_groups, k_steps, block_m, block_k, block_n, transpose_rhs,
                columns_fastest):
  tile = tile_of_step(group_ref, tile_ref, start_ref, end_ref, num_groups=num_groups,
                      block_m=block_m, block_n=block_n, columns_fastest=columns_fastest)
  [acc] = tile_products(lhs_ref, rhs_ref, tile, (0,), num_groups=num_groups,
                        k_steps=k_steps, block_k=block_k, block_n=block_n,
                        transpose_rhs=transpose_rhs)
  plgpu.store(out_ref.at[tile.rows, pl.ds(tile.col0, block_n)],
              acc.astype(out_ref.dtype), mask=tile.mine[:, None])


def gmm(lhs: jax.Array, rhs: jax.Array, starts: jax.Array, ends: jax.Array, *,
        transpose_rhs: bool = False, out_dtype=None,
        block_sizes: configs.TritonConfig | None = None,
        interpret: bool | None = None) -> jax.Array:
  """Grouped matmul kernel.

  Args:
    lhs: [M, K].
    rhs: [G, K, N], or [G, N, K] with `transpose_rhs=True`.
    starts, ends: [G] int32 row bounds of each group.
    transpose_rhs: multiply by `rhs[g]^T` (the input gradient).
    out_dtype: the result's dtype (default `lhs.dtype`), the float32
      accumulator rounded once to it.
    block_sizes: tile sizes; defaults from `configs.TritonConfig.get_default`.
    interpret: Pallas interpret mode; default `ops._backend.pallas_interpret()`.

  Returns:
    [M, N] in `out_dtype`.
  """
  num_rows, k = lhs.shape
  num_groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bs = block_sizes or configs.TritonConfig.get_default(num_rows, k, n)
  interpret = _backend.pallas_interpret() if interpret is None else interpret
  bm, bk, bn = bs.block_m, bs.block_k, bs.block_n
  lhs_p = _shapes.pad_axis(_shapes.pad_axis(lhs, 0, bm), 1, bk)  # [Mp, Kp]
  rhs_p = _shapes.pad_axis(_shapes.pad_axis(rhs, 1, bn if transpose_rhs else bk), 2,
                           bk if transpose_rhs else bn)
  padded_rows, padded_k = lhs_p.shape
  padded_n = _shapes.round_up(n, bn)
  metadata = group_metadata(starts, ends, padded_rows, bm)
  steps = metadata[0].shape[0]
  kernel = functools.partial(
      _gmm_kernel, num_groups=num_groups, k_steps=padded_k // bk, block_m=bm,
      block_k=bk, block_n=bn, transpose_rhs=transpose_rhs,
      columns_fastest=bs.columns_fastest)
  grid = (steps, padded_n // bn)
  out = _pallas.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((padded_rows, padded_n), out_dtype or lhs.dtype),
      grid=grid[::-1] if bs.columns_fastest else grid,
      compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps,
                                           num_stages=bs.num_stages),
      interpret=interpret,
      name="grouped_matmul",
  )(*metadata, lhs_p, rhs_p)
  return out[:num_rows, :n]


def _tgmm_kernel(start_ref, end_ref, lhs_ref, dout_ref, out_ref, *, block_m,
                 block_k, block_n):
  group, k_block, n_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  row_start, row_end = start_ref[group], end_ref[group]
  ks = pl.ds(pl.multiple_of(k_block * block_k, block_k), block_k)
  cols = pl.ds(pl.multiple_of(n_block * block_n, block_n), block_n)
  first = row_start // block_m
  last = jnp.where(row_end > row_start, (row_end + block_m - 1) // block_m, first)

  def body(tile, acc):
    row0 = pl.multiple_of(tile * block_m, block_m)
    rows = pl.ds(row0, block_m)
    row_ids = row0 + jnp.arange(block_m)
    mine = ((row_ids >= row_start) & (row_ids < row_end))[:, None]  # [bm, 1]
    a = plgpu.load(lhs_ref.at[rows, ks], mask=mine, other=0.0)  # [bm, bk]
    b = plgpu.load(dout_ref.at[rows, cols], mask=mine, other=0.0)  # [bm, bn]
    return acc + dot(a, b, trans_a=True)

  acc = jax.lax.fori_loop(first, last, body, jnp.zeros((block_k, block_n), jnp.float32))
  plgpu.store(out_ref.at[group, ks, cols], acc.astype(out_ref.dtype))


def tgmm(lhs: jax.Array, dout: jax.Array, starts: jax.Array, ends: jax.Array, *,
         out_dtype=None, block_sizes: configs.TritonConfig | None = None,
         interpret: bool | None = None) -> jax.Array:
  """Transposed grouped matmul: the weight gradient of `gmm`.

  Args:
    lhs: [M, K].
    dout: [M, N].
    starts, ends: [G] int32 row bounds of each group.
    out_dtype: the result's dtype (default `lhs.dtype`); float32 stores the
      accumulator as it is, for float32 master weights.

  Returns:
    [G, K, N] in `out_dtype`: `lhs[rows of g]^T @ dout[rows of g]` (zero for
    an empty group).
  """
  num_rows, k = lhs.shape
  n = dout.shape[1]
  num_groups = starts.shape[0]
  bs = block_sizes or configs.TritonConfig.get_default(num_rows, k, n)
  interpret = _backend.pallas_interpret() if interpret is None else interpret
  bm, bk, bn = bs.tgmm_block_m, bs.tgmm_block_k, bs.tgmm_block_n
  lhs_p = _shapes.pad_axis(_shapes.pad_axis(lhs, 0, bm), 1, bk)  # [Mp, Kp]
  dout_p = _shapes.pad_axis(_shapes.pad_axis(dout, 0, bm), 1, bn)  # [Mp, Np]
  padded_k, padded_n = lhs_p.shape[1], dout_p.shape[1]
  kernel = functools.partial(_tgmm_kernel, block_m=bm, block_k=bk, block_n=bn)
  out = _pallas.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_groups, padded_k, padded_n),
                                     out_dtype or lhs.dtype),
      grid=(num_groups, padded_k // bk, padded_n // bn),
      compiler_params=plgpu.CompilerParams(num_warps=bs.tgmm_num_warps,
                                           num_stages=bs.tgmm_num_stages),
      interpret=interpret,
      name="transposed_grouped_matmul",
  )(starts, ends, lhs_p, dout_p)
  return out[:, :k, :n]
