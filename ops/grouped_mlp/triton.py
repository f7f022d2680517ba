"""Triton kernels of `grouped_mlp`: the activation in the matmul epilogues.

A grouped MLP from two `ops.grouped_matmul` calls writes the hidden
pre-activation, reads it back for the activation, writes the activation, and
in the backward pass reads both again for the activation's derivative: two
extra passes over [M, F] each way, which at MoE sizes cost as much device time
as a grouped matmul. Here the activation runs on the first matmul's float32
accumulator before it is stored, and its derivative runs on the accumulator of
the hidden gradient `dy @ w_out[g]^T` before that is stored. The activation is
applied to a tile's *output*, never to an input tile: a tile changed in
registers cannot feed the tensor cores from shared memory, so an activation
on the second matmul's input tiles would slow that matmul (BUILD_NOTES.md,
"MoE").

Two kernels, on `ops.grouped_matmul.triton`'s tiles:
- `mlp_in`: h = x @ w_in[g], a = act(h); stores a, and h when a gradient will
  be needed;
- `hidden_grad`: dh = act'(h) * (dy @ w_out[g]^T).
`pallas.py` combines them with the plain grouped matmuls under one custom VJP.

SwiGLU's gate and value columns of a tile are computed by the same program
(two accumulators sharing each x tile), so the activation needs no exchange
between programs; `w_in` is padded half by half so that the value column of
gate column j is always `j + hidden`.

Glossary of shapes: M rows, D input width, F hidden width (Fi = F, or 2F for
SwiGLU, columns of w_in), D' output width, G groups; a `p` suffix means padded
to the tiles.
"""

import functools
from typing import NamedTuple

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from ops import _pallas
from ops.grouped_matmul import configs as gmm_configs
from ops.grouped_matmul.metadata import group_metadata
from ops.grouped_matmul.triton import tile_of_step
from ops.grouped_matmul.triton import tile_products
from ops.grouped_mlp.activations import activation_grads
from ops.grouped_mlp.activations import activation_value
from ops.grouped_mlp.activations import approximate_tanh
from ops.grouped_mlp.activations import col_offsets


def _tanh(fast):
  return plgpu.approx_tanh if fast else jnp.tanh


class _Tiling(NamedTuple):
  fast_math: bool  # approximate tanh (compiled, 16-bit inputs)
  num_groups: int
  k_steps: int
  block_m: int
  block_k: int
  block_n: int
  columns_fastest: bool


def _mlp_in_kernel(group_ref, tile_ref, start_ref, end_ref, x_ref, w_ref, act_ref,
                   *pre_ref, tiling, activation, hidden):
  tile = tile_of_step(group_ref, tile_ref, start_ref, end_ref,
                      num_groups=tiling.num_groups, block_m=tiling.block_m,
                      block_n=tiling.block_n, columns_fastest=tiling.columns_fastest)
  offsets = col_offsets(activation, hidden)
  accs = tile_products(x_ref, w_ref, tile, offsets, num_groups=tiling.num_groups,
                       k_steps=tiling.k_steps, block_k=tiling.block_k,
                       block_n=tiling.block_n, transpose_rhs=False)
  mask = tile.mine[:, None]
  act = activation_value(accs, activation, _tanh(tiling.fast_math))
  plgpu.store(act_ref.at[tile.rows, pl.ds(tile.col0, tiling.block_n)],
              act.astype(act_ref.dtype), mask=mask)
  if pre_ref:
    for acc, offset in zip(accs, offsets):
      plgpu.store(pre_ref[0].at[tile.rows, pl.ds(tile.col0 + offset, tiling.block_n)],
                  acc.astype(pre_ref[0].dtype), mask=mask)


def _mlp_hidden_grad_kernel(group_ref, tile_ref, start_ref, end_ref, dy_ref, w_ref,
                            pre_ref, dpre_ref, *, tiling, activation, hidden):
  tile = tile_of_step(group_ref, tile_ref, start_ref, end_ref,
                      num_groups=tiling.num_groups, block_m=tiling.block_m,
                      block_n=tiling.block_n, columns_fastest=tiling.columns_fastest)
  [da] = tile_products(dy_ref, w_ref, tile, (0,), num_groups=tiling.num_groups,
                       k_steps=tiling.k_steps, block_k=tiling.block_k,
                       block_n=tiling.block_n, transpose_rhs=True)
  offsets = col_offsets(activation, hidden)
  col_sets = [pl.ds(tile.col0 + offset, tiling.block_n) for offset in offsets]
  pre = [plgpu.load(pre_ref.at[tile.rows, cols]).astype(jnp.float32)
         for cols in col_sets]
  grads = activation_grads(da, pre, activation, _tanh(tiling.fast_math))
  for grad, cols in zip(grads, col_sets):
    plgpu.store(dpre_ref.at[tile.rows, cols], grad.astype(dpre_ref.dtype),
                mask=tile.mine[:, None])


def _row_tile_call(kernel, lhs, rhs, starts, ends, out_shapes, *, hidden, activation,
                   bs: gmm_configs.TritonConfig, name, interpret, extra=()):
  """Runs a `gmm`-style kernel over (row tile, hidden column block) programs.

  `lhs` [Mp, Kp] and `rhs` are already padded to the tiles; the programs
  cover `hidden` output columns (each half's, for SwiGLU).
  """
  padded_rows, padded_k = lhs.shape
  metadata = group_metadata(starts, ends, padded_rows, bs.block_m)
  tiling = _Tiling(fast_math=approximate_tanh(lhs.dtype, interpret),
                   num_groups=rhs.shape[0], k_steps=padded_k // bs.block_k,
                   block_m=bs.block_m, block_k=bs.block_k, block_n=bs.block_n,
                   columns_fastest=bs.columns_fastest)
  grid = (metadata[0].shape[0], hidden // bs.block_n)
  return _pallas.pallas_call(
      functools.partial(kernel, tiling=tiling, activation=activation, hidden=hidden),
      out_shape=out_shapes,
      grid=grid[::-1] if bs.columns_fastest else grid,
      compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps,
                                           num_stages=bs.num_stages),
      interpret=interpret,
      name=name,
  )(*metadata, lhs, rhs, *extra)


def mlp_in(x, w_in, starts, ends, *, activation: str, hidden: int, save_hidden: bool,
           block_sizes: gmm_configs.TritonConfig, interpret: bool) -> list[jax.Array]:
  """[a] or [a, h]: a [Mp, Fp] = act(h), h [Mp, Fip] = x @ w_in[g].

  Args:
    x: [Mp, Dp], the rows padded to `block_sizes.block_m`.
    w_in: [G, Dp, Fip], each half's hidden columns padded to `hidden`.
    hidden: Fp, the padded hidden width (of each half, for SwiGLU).
  """
  out_shapes = [jax.ShapeDtypeStruct((x.shape[0], hidden), x.dtype)]
  if save_hidden:
    out_shapes.append(jax.ShapeDtypeStruct((x.shape[0], w_in.shape[2]), x.dtype))
  return _row_tile_call(_mlp_in_kernel, x, w_in, starts, ends, out_shapes,
                        hidden=hidden, activation=activation, bs=block_sizes,
                        name="grouped_mlp_in", interpret=interpret)


def hidden_grad(dy, w_out, h, starts, ends, *, activation: str,
                block_sizes: gmm_configs.TritonConfig, interpret: bool) -> jax.Array:
  """dh [Mp, Fip] = act'(h) * (dy @ w_out[g]^T), for dy [Mp, D'p], w_out
  [G, Fp, D'p] and h [Mp, Fip]."""
  return _row_tile_call(_mlp_hidden_grad_kernel, dy, w_out, starts, ends,
                        jax.ShapeDtypeStruct((dy.shape[0], h.shape[1]), dy.dtype),
                        hidden=w_out.shape[1], activation=activation, bs=block_sizes,
                        name="grouped_mlp_hidden_grad", interpret=interpret,
                        extra=(h,))
