"""Mosaic GPU (Hopper) kernel for the transposed grouped matmul, the weight
gradient of the grouped matmul: `out[g] = lhs[rows of g]^T @ dout[rows of g]`.

The Triton `tgmm` (`triton.py`) masks the rows of other groups as it loads
them. TMA loads whole tiles, so here the rows outside the group are zeroed in
shared memory, in the two tiles at a group's ends only.

- One persistent CUDA block per SM walks the (group, K block, N block) output
  tiles.
- Each block has three warpgroups. One issues the TMA loads of the lhs
  [block_m, block_k] and dout [block_m, block_n] tiles of the group's row
  tiles into a ring of shared-memory slots. The other two each own half of
  dout's columns: they zero the rows outside the group in their half of a
  boundary tile, then run `wgmma` of the lhs tile, transposed, against it into
  a [block_k, block_n / 2] float32 accumulator.
- The epilogue stores the accumulator in `epilogue_n`-column chunks through a
  swizzled buffer (float32 for float32 master weights).

An empty group still runs one (masked) step, so that its output tile is
written as zeros.

Faster than the Triton `tgmm` at the MoE sizes on an H200 (BUILD_NOTES.md,
"MoE").

Glossary: M rows, K lhs columns (output rows), N dout columns, G groups, WG
warpgroup.
"""

import dataclasses
import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from ops import _pallas
from ops import _shapes
from ops._mosaic_gpu import SMEM_BUDGET
from ops._mosaic_gpu import num_sms
from ops._mosaic_gpu import swizzled
from ops.grouped_matmul import configs
from ops.grouped_matmul.configs import NUM_COMPUTE_WGS
from ops.grouped_matmul.mosaic import check_dtype


def choose_config(out_dtype, preferred: configs.MosaicTgmmConfig | None = None
                  ) -> configs.MosaicTgmmConfig:
  """`preferred` (default: the tuned tiles) with as many pipeline stages as
  fit in shared memory."""
  if preferred is None:
    preferred = configs.MosaicTgmmConfig()
  for steps in range(preferred.max_concurrent_steps, 1, -1):
    config = dataclasses.replace(preferred, max_concurrent_steps=steps)
    if config.smem_bytes(out_dtype) <= SMEM_BUDGET:
      return config
  raise ValueError(f"no pipeline depth of {preferred} fits in shared memory")


def _tgmm_kernel(starts_gmem, ends_gmem, lhs_gmem, dout_gmem, out_gmem, *,
                 config: configs.MosaicTgmmConfig, num_groups: int, k_blocks: int,
                 n_blocks: int):
  dtype, out_dtype = lhs_gmem.dtype, out_gmem.dtype
  bm, bk, bn = config.block_m, config.block_k, config.block_n
  tn = bn // NUM_COMPUTE_WGS
  en = config.epilogue_n(out_dtype)

  def pipeline(body, compute_context, num_steps, first):
    # Row tile `first + t` at step t: the index maps close over the group's
    # first tile, so the refs never need a dynamically offset slice.
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(num_steps,), memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((bm, bk), lambda t: (first + t, 0),
                            transforms=swizzled(dtype, bk)),
            plgpu.BlockSpec((bm, bn), lambda t: (first + t, 0),
                            transforms=swizzled(dtype, bn)),
        ],
        wg_axis="wg", num_compute_wgs=NUM_COMPUTE_WGS,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context)

  num_row_tiles = lhs_gmem.shape[0] // bm
  ignore = lambda *_, **__: None
  lhs_cols = lambda kb: lhs_gmem.at[:, pl.ds(kb * bk, bk)]
  dout_cols = lambda nb: dout_gmem.at[:, pl.ds(nb * bn, bn)]

  @functools.partial(
      pl.run_scoped,
      # A traced step count, as the loop's: a static one would shrink the ring.
      allocations=pipeline(ignore, ignore, jnp.int32(1), 0).get_allocations(
          lhs_cols(0), dout_cols(0)),
      out_smem=plgpu.SMEM((NUM_COMPUTE_WGS, bk, en), out_dtype,
                          transforms=swizzled(out_dtype, en)),
      collective_axes="wg",
  )
  def scope(allocations, out_smem):
    wg = lax.axis_index("wg")
    wg_cols = pl.ds(wg * tn, tn)

    @plgpu.nd_loop((num_groups * k_blocks * n_blocks,), collective_axes="sm")
    def loop(info):
      (index,) = info.index
      group = index // (k_blocks * n_blocks)
      kb = index // n_blocks % k_blocks
      nb = index % n_blocks
      start, end = starts_gmem[group], ends_gmem[group]
      # An empty group at the end of the rows starts past the last tile: its
      # one (masked) step reads the last tile instead.
      first = jnp.minimum(start // bm, num_row_tiles - 1)
      num_steps = jnp.maximum((end + bm - 1) // bm - first, 1)

      def compute_context(run_pipeline):
        @functools.partial(pl.run_scoped, acc=plgpu.ACC((bk, tn), jnp.float32))
        def _(acc):
          run_pipeline(acc)
          value = acc[...]
          for chunk in range(tn // en):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            out_smem[wg] = value[:, chunk * en:(chunk + 1) * en].astype(out_dtype)
            plgpu.commit_smem()
            cols = pl.ds(nb * bn + wg * tn + chunk * en, en)
            plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                    out_gmem.at[group, pl.ds(kb * bk, bk), cols])

      def mma(indices, lhs_smem, dout_smem, acc):
        (step,) = indices
        row0 = (first + step) * bm
        mine = dout_smem.at[:, wg_cols]  # this warpgroup's columns only

        @pl.when((row0 < start) | (row0 + bm > end))
        def _():
          rows = row0 + plgpu.layout_cast(
              lax.broadcasted_iota(jnp.int32, (bm, tn), 0), plgpu.Layout.WGMMA)
          keep = ((rows >= start) & (rows < end)).astype(dtype)
          mine[...] = mine[...] * keep
          plgpu.commit_smem()

        plgpu.wgmma(acc, lhs_smem.transpose((1, 0)), mine)
        plgpu.wgmma_wait(0)
        return acc

      pipeline(mma, compute_context, num_steps, first)(
          lhs_cols(kb), dout_cols(nb), allocations=allocations)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def tgmm(lhs: jax.Array, dout: jax.Array, starts: jax.Array, ends: jax.Array, *,
         out_dtype=None, config: configs.MosaicTgmmConfig | None = None,
         interpret: bool = False) -> jax.Array:
  """Transposed grouped matmul on Mosaic GPU.

  Args:
    lhs: [M, K] bfloat16 or float16.
    dout: [M, N], lhs's dtype.
    starts, ends: [G] int32 row bounds of each group (contiguous groups).
    out_dtype: the result's dtype (default lhs's); float32 stores the
      accumulator as it is.
    config: the tiles; default `choose_config(out_dtype)`.
    interpret: run in Mosaic GPU interpret mode (the CPU).

  Returns:
    [G, K, N]: `lhs[starts[g]:ends[g]]^T @ dout[starts[g]:ends[g]]` (zero for
    an empty group).
  """
  check_dtype(lhs.dtype, "tgmm", "lhs")
  if dout.dtype != lhs.dtype:
    raise ValueError(f"tgmm: `dout` must have lhs's dtype {lhs.dtype}, got {dout.dtype}")
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  config = config or choose_config(out_dtype)
  num_rows, k = lhs.shape
  n = dout.shape[1]
  num_groups = starts.shape[0]
  bm, bk, bn = config.block_m, config.block_k, config.block_n
  lhs_p = _shapes.pad_axis(_shapes.pad_axis(lhs, 0, bm), 1, bk)
  dout_p = _shapes.pad_axis(_shapes.pad_axis(dout, 0, bm), 1, bn)
  k_blocks, n_blocks = lhs_p.shape[1] // bk, dout_p.shape[1] // bn
  kernel = functools.partial(_tgmm_kernel, config=config, num_groups=num_groups,
                             k_blocks=k_blocks, n_blocks=n_blocks)
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  call = _pallas.mosaic_kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((num_groups, k_blocks * bk, n_blocks * bn), out_dtype),
      grid=(4 if interpret else num_sms(),), grid_names=("sm",),
      num_threads=NUM_COMPUTE_WGS + 1, thread_name="wg", compiler_params=params,
      interpret=plgpu.InterpretGPUParams() if interpret else None)
  out = call(starts.astype(jnp.int32), ends.astype(jnp.int32), lhs_p, dout_p)
  return out[:, :k, :n]
