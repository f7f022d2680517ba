"""Mosaic GPU (Hopper) kernel for the grouped matmul: TMA, wgmma, warp specialization.

The Triton kernel in `triton.py` cannot use Hopper's tensor memory accelerator
(TMA) or split a block's warps into loaders and multipliers, so at the MoE sizes it
stays well below cuBLAS's dense rate. This kernel does the same computation
on Mosaic GPU: one grid step per (group, row tile), and a tile that straddles a
group boundary is visited once per group (see `metadata.group_metadata`, which
`_step_of` computes in registers).

- One persistent CUDA block per SM walks the (step, column block) grid.
- Each block has three warpgroups. One issues the TMA loads of the lhs and rhs
  tiles into a ring of `max_concurrent_steps` shared-memory slots. The other two
  run `wgmma` on them, each into its own [tile_m, tile_n] float32 accumulator;
  the block's tile is two of those side by side, along N or along M.
- The epilogue runs, chunk by chunk, an optional elementwise function of the
  accumulators and of extra tiles it loads (the grouped MLP's activation and
  its derivative). It then stores the results with TMA:
  - a tile its group owns whole goes through a swizzled buffer, one store a
    chunk;
  - a TMA store has a static shape, so a straddling tile's rows (a run of 0 to
    tile_m) go through a plain buffer as power-of-two runs, at most
    log2(tile_m) + 1 stores.

What it measures against the Triton kernel and a dense matmul of the same
work, and the tile variants that lost: BUILD_NOTES.md, "MoE".

The same code runs on the CPU in Mosaic GPU interpret mode
(`plgpu.InterpretGPUParams`), which is how the tests check it.

Glossary: M rows, K contraction, N output columns, G groups, T grid steps over
row tiles (`cdiv(M, block_m) + G`), WG warpgroup.
"""

import dataclasses
import functools
from typing import Callable, NamedTuple, Sequence

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from ops import _mosaic_gpu
from ops import _pallas
from ops import _shapes
from ops import tuning
from ops._mosaic_gpu import SMEM_BUDGET
from ops._mosaic_gpu import num_sms
from ops._mosaic_gpu import swizzled
from ops.grouped_matmul import configs
from ops.grouped_matmul.configs import NUM_COMPUTE_WGS

def _store_rows(smem, gmem, first: jax.Array, count: jax.Array, rows: int):
  """TMA-stores rows [first, first + count) of `smem` [rows, C] to the same
  rows of `gmem` [rows, C], as power-of-two runs (count <= rows)."""
  offset = first
  size = rows
  while size >= 1:
    run = size

    @pl.when((count & run) != 0)
    def _():
      plgpu.copy_smem_to_gmem(smem.at[pl.ds(offset, run)], gmem.at[pl.ds(offset, run)])

    offset = offset + (count & run)
    size //= 2


class Epilogue(NamedTuple):
  """What the epilogue reads and writes, beyond the accumulators.

  fn: `(accs, extras) -> results`, elementwise on [tile_m, epilogue_n] float32
    chunks of the accumulators and of the extra tiles; None returns the
    accumulators.
  extras: (input index, column offset) per extra tile the epilogue reads.
  results: (output index, column offset) per result it writes.
  """
  fn: Callable | None
  extras: tuple[tuple[int, int], ...]
  results: tuple[tuple[int, int], ...]


def _segments(ends: Sequence[jax.Array], *, block_m: int, padded_rows: int):
  """Per segment (the G groups, then the rows after the last group): its
  index, rows [start, end), first row tile, number of row tiles it touches and
  the visits of the segments before it; and the total number of visits.

  `metadata.group_metadata`'s arithmetic, unrolled over the G + 1 segments in
  scalar registers (the ends are read once per kernel).
  """
  segments = []
  seg_start, visits_before = jnp.int32(0), jnp.int32(0)
  for g, seg_end in enumerate(list(ends) + [jnp.int32(padded_rows)]):
    first_tile = seg_start // block_m
    num_tiles = jnp.where(seg_end > seg_start,
                          (seg_end - 1) // block_m - first_tile + 1, 0)
    segments.append((g, seg_start, seg_end, first_tile, num_tiles, visits_before))
    visits_before = visits_before + num_tiles
    seg_start = seg_end
  return segments, visits_before


def _step_of(segments, step: jax.Array):
  """(group, row tile, first row, end row) of visit `step` (< the number of
  visits), from `_segments`.

  This replaces four per-step loads from global memory at the start of every
  tile, which the memory warpgroup would wait on before its first TMA load.
  """
  zero = jnp.int32(0)
  group = tile = row_start = row_end = zero
  for g, seg_start, seg_end, first_tile, num_tiles, visits_before in segments:
    mine = (step >= visits_before) & (step < visits_before + num_tiles)
    group = jnp.where(mine, g, group)
    tile = jnp.where(mine, first_tile + step - visits_before, tile)
    row_start = jnp.where(mine, seg_start, row_start)
    row_end = jnp.where(mine, seg_end, row_end)
  return group, tile, row_start, row_end


def _pipeline_state(info) -> jax.Array:
  """Where a block's tile stands in the chain of its tiles' pipelines.

  Chained pipelines let the memory warpgroup load the next tile's first
  slots while the compute warpgroups run this tile's epilogue. The first
  tile fills the ring (START), the last one waits for every slot to be
  consumed (STOP). (A block with one tile runs an unchained pipeline.)
  """
  local, count = info.local_index, info.num_local_steps
  return jnp.where(local == 0, int(plgpu.PipelinePipeline.START),
                   jnp.where(local == count - 1, int(plgpu.PipelinePipeline.STOP),
                             int(plgpu.PipelinePipeline.STEADY))).astype(jnp.int32)


def _gmm_kernel(ends_gmem, lhs_gmem, rhs_gmem, *rest, config: configs.MosaicConfig,
                num_groups: int, num_col_blocks: int,
                col_offsets: Sequence[int], num_inputs: int, epilogue: Epilogue,
                transpose_rhs: bool):
  in_gmem, out_gmem = rest[:num_inputs], rest[num_inputs:]
  dtype = lhs_gmem.dtype
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  tm, tn = config.wg_tile
  en = config.epilogue_n
  k_steps = lhs_gmem.shape[1] // bk
  num_accs = len(col_offsets)
  out_dtype = out_gmem[0].dtype
  if any(o.dtype != out_dtype for o in out_gmem):
    raise ValueError("mosaic.gmm: every output must have one dtype")

  def spec(block, index):
    return plgpu.BlockSpec(block, index, transforms=swizzled(dtype, block[1]))
  lhs_spec = spec((bm, bk), lambda k: (0, k))
  if transpose_rhs:
    rhs_spec = spec((bn, bk), lambda k: (0, k))
  else:
    rhs_spec = spec((bk, bn), lambda k: (k, 0))

  # A block's tiles chain their pipelines (see `_pipeline_state`) where the
  # pipeline allows it: whole rings per tile.
  chained = k_steps % config.max_concurrent_steps == 0

  def pipeline(body, compute_context, state=None):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_steps,), memory_registers=40,
        in_specs=[lhs_spec] + [rhs_spec] * num_accs,
        wg_axis="wg", num_compute_wgs=NUM_COMPUTE_WGS,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context, pipeline_state=state)

  ignore = lambda *_, **__: None
  chunk_shape = (NUM_COMPUTE_WGS, tm, en)
  # Buffers alternate within a tile; with an odd number of stores per tile the
  # next tile would start on the buffer just stored from, so use one.
  slots = config.store_slots if (tn // en * len(epilogue.results)) % 2 == 0 else 1

  @functools.partial(
      pl.run_scoped,
      allocations=pipeline(ignore, ignore).get_allocations(
          lhs_gmem, *[rhs_gmem] * num_accs),
      # Whole tiles go through swizzled buffers (no bank conflicts when the
      # accumulator's fragments are written); a tile that straddles a group
      # boundary through a plain one, whose rows can be sliced anywhere.
      store_smem=[plgpu.SMEM(chunk_shape, out_dtype,
                             transforms=swizzled(out_dtype, en))
                  for _ in range(slots)],
      ragged_smem=plgpu.SMEM(chunk_shape, out_dtype),
      extra_smem=[plgpu.SMEM(chunk_shape, in_gmem[i].dtype,
                             transforms=swizzled(in_gmem[i].dtype, en))
                  for i, _ in epilogue.extras],
      extra_barrier=(plgpu.Barrier(num_barriers=NUM_COMPUTE_WGS)
                     if epilogue.extras else None),
      collective_axes="wg",
  )
  def scope(allocations, store_smem, ragged_smem, extra_smem, extra_barrier):
    wg = lax.axis_index("wg")
    if config.split == "m":
      wg_rows, wg_cols, wg_row0 = pl.ds(wg * tm, tm), slice(None), wg * tm
    else:
      wg_rows, wg_cols, wg_row0 = slice(None), pl.ds(wg * tn, tn), 0

    ends = [ends_gmem[g] for g in range(num_groups)]
    segments, num_visits = _segments(ends, block_m=bm, padded_rows=lhs_gmem.shape[0])

    # Only the visits the groups need (at most cdiv(M, block_m) + G): every tile a block
    # walks has rows to compute, so its pipelines can chain.
    @plgpu.nd_loop((num_visits * num_col_blocks,), collective_axes="sm")
    def loop(info):
      (index,) = info.index
      # A row tile's column blocks back to back: its lhs rows stay in L2.
      step, col_block = index // num_col_blocks, index % num_col_blocks
      group, tile, row_start, row_end = _step_of(segments, step)
      row0 = tile * bm
      first = jnp.maximum(row_start - row0, 0)  # rows of the tile it owns
      last = jnp.minimum(row_end - row0, bm)
      whole = (first == 0) & (last == bm)
      weight = jnp.minimum(group, num_groups - 1)
      block_rows = pl.ds(row0, bm)
      # This warpgroup's share of the owned rows, relative to its own tile.
      wg_first = jnp.clip(first - wg_row0, 0, tm)
      wg_count = jnp.clip(last - wg_row0, 0, tm) - wg_first

      def chunk_of(gmem, offset, chunk):
        return gmem.at[block_rows, pl.ds(col_block * bn + offset, bn)].at[
            wg_rows, wg_cols].at[:, pl.ds(chunk * en, en)]

      def store(value, dst, slot):
        @pl.when(whole)
        def _():
          smem = store_smem[slot]
          # The store that last read this buffer must be done with it.
          plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
          smem[wg] = value
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(smem.at[wg], dst)

        @pl.when(jnp.logical_not(whole))
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          ragged_smem[wg] = value
          plgpu.commit_smem()
          _store_rows(ragged_smem.at[wg], dst, wg_first, wg_count, tm)

      def compute_context(run_pipeline):
        @functools.partial(
            pl.run_scoped,
            accs=[plgpu.ACC((tm, tn), jnp.float32) for _ in range(num_accs)])
        def _(accs):
          run_pipeline(accs)
          # The pseudo-group (rows after the last group) multiplies by no weight.
          live = (group < num_groups).astype(jnp.float32)
          values = [acc[...] * live for acc in accs]
          count = 0
          for chunk in range(tn // en):
            cols = slice(chunk * en, (chunk + 1) * en)
            for (i, offset), e_smem in zip(epilogue.extras, extra_smem):
              plgpu.copy_gmem_to_smem(chunk_of(in_gmem[i], offset, chunk),
                                      e_smem.at[wg], extra_barrier.at[wg])
              plgpu.barrier_wait(extra_barrier.at[wg])
            extras = [e_smem[wg].astype(jnp.float32) for e_smem in extra_smem]
            parts = [v[:, cols] for v in values]
            results = epilogue.fn(parts, extras) if epilogue.fn else parts
            for result, (i, offset) in zip(results, epilogue.results):
              store(result.astype(out_dtype), chunk_of(out_gmem[i], offset, chunk),
                    count % slots)
              count += 1

      def mma(_, lhs_smem, *rhs_and_accs):
        rhs_smems, accs = rhs_and_accs[:num_accs], rhs_and_accs[num_accs]
        for rhs_smem, acc in zip(rhs_smems, accs):
          b = (rhs_smem.at[wg_cols, :].transpose((1, 0)) if transpose_rhs
               else rhs_smem.at[:, wg_cols])
          plgpu.wgmma(acc, lhs_smem.at[wg_rows], b)
        plgpu.wgmma_wait(0)
        return accs

      cols = [pl.ds(col_block * bn + o, bn) for o in col_offsets]
      if transpose_rhs:
        rhs_tiles = [rhs_gmem.at[weight, c, :] for c in cols]
      else:
        rhs_tiles = [rhs_gmem.at[weight, :, c] for c in cols]
      def run(state):
        pipeline(mma, compute_context, state)(lhs_gmem.at[block_rows, :], *rhs_tiles,
                                              allocations=allocations)

      if not chained:
        run(None)
      else:
        # A chain needs two tiles: its first fills the ring, its last drains it.
        alone = info.num_local_steps == 1
        pl.when(alone)(lambda: run(None))
        pl.when(jnp.logical_not(alone))(lambda: run(_pipeline_state(info)))

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def candidates() -> configs.MosaicCandidates:
  """The tuned tiles `choose_config` picks from, for this device."""
  return tuning.tuned("grouped_matmul", configs.MosaicCandidates)


def _waves(config: configs.MosaicConfig, *, rows: int, n: int, num_groups: int) -> int:
  """Waves of (row tile, column block) visits over the SMs, at most: a tile
  straddling a group boundary is visited once per group (`_segments`)."""
  visits = (-(-rows // config.block_m) + num_groups) * -(-n // config.block_n)
  return -(-visits // num_sms())


def choose_config(n: int, *, num_accs: int = 1, num_extras: int = 0,
                  rows: int | None = None, num_groups: int = 0, out_itemsize: int = 2,
                  preferred: Sequence[configs.MosaicConfig] | None = None
                  ) -> configs.MosaicConfig:
  """The first preferred tiles that fit a kernel with these epilogue needs
  (`out_itemsize`: bytes per element of the outputs); default `preferred`:
  the tuned candidates (`candidates()`).

  A tile wider than N (padded to 128) is skipped, and with two accumulators
  (SwiGLU) a warpgroup tile of more than 64 x 128: two [128, 128] float32
  accumulators take all of a thread's registers.
  Given the `rows` and `num_groups` of a plain grouped matmul (no epilogue),
  the candidates' `few_waves` tiles replace the first choice where they need
  few enough waves (`MosaicCandidates.few_waves_max_ratio`).
  """
  tuned = candidates()
  if preferred is None:
    preferred = tuned.preferred
  first = _fitting(preferred, n, num_accs=num_accs, num_extras=num_extras,
                   out_itemsize=out_itemsize)
  few_waves = tuned.few_waves
  if rows is not None and num_accs == 1 and num_extras == 0 and few_waves.block_n <= n:
    shape = dict(rows=rows, n=n, num_groups=num_groups)
    if _waves(few_waves, **shape) <= tuned.few_waves_max_ratio * _waves(first, **shape):
      return _fitting((few_waves,), n, num_accs=1, num_extras=0,
                      out_itemsize=out_itemsize)
  return first


def _fitting(preferred, n, *, num_accs, num_extras, out_itemsize) -> configs.MosaicConfig:
  """The first of `preferred` that `choose_config`'s limits allow, with as many
  stages and store buffers as fit in shared memory."""
  for config in preferred:
    if config.block_n > max(n, 128):
      continue
    if num_accs > 1 and config.wg_tile[0] * config.wg_tile[1] > 64 * 128:
      continue
    for steps in range(config.max_concurrent_steps, 1, -1):
      for slots in range(config.store_slots, 0, -1):
        candidate = dataclasses.replace(config, max_concurrent_steps=steps,
                                        store_slots=slots)
        if candidate.smem_bytes(num_accs=num_accs, num_extras=num_extras,
                                out_itemsize=out_itemsize) <= SMEM_BUDGET:
          return candidate
  raise ValueError(f"no Mosaic GPU tile fits {num_accs} accumulators and "
                   f"{num_extras} extra tiles")


def check_dtype(dtype, op: str, name: str) -> None:
  """Raises a ValueError naming `op`'s argument `name` unless it is 16-bit."""
  if jnp.dtype(dtype) not in _mosaic_gpu.DTYPES:
    raise ValueError(f"{op}: the Mosaic GPU kernels take bfloat16 or float16 "
                     f"`{name}`, got {jnp.dtype(dtype)}")


def preferred(dtype) -> bool:
  """Whether `ops.grouped_matmul`'s Pallas path runs this kernel (else Triton's).

  Mosaic GPU's wgmma and TMA are Hopper's (compute capability 9.x); the kernels
  take 16-bit inputs (float32 stays on the Triton kernels, which multiply it at
  full precision).
  """
  return _mosaic_gpu.takes(dtype)


def gmm(lhs: jax.Array, rhs: jax.Array, ends: jax.Array, *,
        transpose_rhs: bool = False, config: configs.MosaicConfig | None = None,
        col_offsets: Sequence[int] = (0,), inputs: Sequence[jax.Array] = (),
        outputs: Sequence[jax.ShapeDtypeStruct] | None = None,
        epilogue: Epilogue | None = None, approx_math: bool = False,
        interpret: bool = False) -> list[jax.Array]:
  """Grouped matmul on Mosaic GPU, with an optional fused epilogue.

  A program's output columns are `cols = col_block * block_n + [0, block_n)`.

  Args:
    lhs: [M, K] bfloat16 or float16.
    rhs: [G, K, N'] (or [G, N', K] with `transpose_rhs`), lhs's dtype.
    ends: [G] int32 end row of each group; the groups are contiguous from row 0
      (`reference.group_bounds`), so group g is rows [ends[g-1], ends[g]).
    col_offsets: static column offsets; accumulator i multiplies by rhs columns
      `cols + col_offsets[i]` (SwiGLU's gate and value halves). The programs
      cover N = N' - max(col_offsets) columns.
    inputs: [M, *] arrays whose tiles the epilogue reads (`epilogue.extras`).
    outputs: shapes and dtypes of the outputs, each [M, *]; default one
      [M, N] in lhs's dtype per accumulator.
    epilogue: what runs between the accumulators and the stores; default: each
      accumulator i is stored to output i.
    config: the tiles; default `choose_config` for this epilogue.
    approx_math: approximate transcendental functions in the epilogue (tanh).
    interpret: run in Mosaic GPU interpret mode (the CPU).

  Returns:
    The outputs; rows after the last group are zero in the stored results.
  """
  num_rows, k = lhs.shape
  num_groups = rhs.shape[0]
  n = (rhs.shape[1] if transpose_rhs else rhs.shape[2]) - max(col_offsets)
  if outputs is None:
    outputs = [jax.ShapeDtypeStruct((num_rows, n), lhs.dtype)] * len(col_offsets)
  if epilogue is None:
    epilogue = Epilogue(None, (), tuple((i, 0) for i in range(len(col_offsets))))
  config = config or choose_config(
      n, num_accs=len(col_offsets), num_extras=len(epilogue.extras), rows=num_rows,
      num_groups=num_groups, out_itemsize=max(jnp.dtype(o.dtype).itemsize for o in outputs))
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  for name, size, multiple in (("K", k, bk), ("N", n, bn)):
    if size % multiple:
      raise ValueError(f"mosaic.gmm: {name} = {size} must be a multiple of {multiple}")
  lhs_p = _shapes.pad_axis(lhs, 0, bm)
  padded_rows = lhs_p.shape[0]
  inputs_p = [_shapes.pad_axis(x, 0, bm) for x in inputs]
  kernel = functools.partial(
      _gmm_kernel, config=config, num_groups=num_groups,
      num_col_blocks=n // bn, col_offsets=tuple(col_offsets),
      num_inputs=len(inputs), epilogue=epilogue, transpose_rhs=transpose_rhs)
  out_type = [jax.ShapeDtypeStruct((padded_rows,) + o.shape[1:], o.dtype)
              for o in outputs]
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                approx_math=approx_math)
  # Interpret mode simulates every block: four still share the steps out
  # (each walks several), at a fraction of an SM count's cost.
  call = _pallas.mosaic_kernel(
      kernel, out_type=out_type, grid=(4 if interpret else num_sms(),),
      grid_names=("sm",), num_threads=NUM_COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=params,
      interpret=plgpu.InterpretGPUParams() if interpret else None)
  outs = call(ends.astype(jnp.int32), lhs_p, rhs, *inputs_p)
  return [o[:num_rows] for o in outs]
