"""Mosaic GPU (Hopper) backward of flex attention: dK, dV and dQ in one launch.

The Triton backward (`triton_backward.py`) runs two launches, dK/dV per key tile and dQ
per query tile, and the second recomputes the logits, the probabilities and
dP: seven products per (query tile, key tile) pair where five suffice. Adding
dQ from the dK/dV kernel with per-element atomic adds is slower than the two
launches (one atomic operation per element; BUILD_NOTES.md, "flex_attention").
This kernel follows FlashAttention-3 (https://arxiv.org/abs/2407.08608) instead:

- A CUDA block owns 2 x `block_k` key rows of one (batch, key/value head) and
  has three warpgroups. One (the memory warpgroup) streams the query-side
  tiles (Q, dO, and the rows of lse and delta) of every query head of the
  group into a ring of `max_concurrent_steps` shared-memory slots with TMA.
  Each of the other two owns `block_k` of the key rows and runs, per query
  tile: S^T = K Q^T, P^T = exp2(S^T c - lse), dV += P^T dO, dP^T = V dO^T,
  dS^T = P^T (dP^T - delta), dK += dS^T Q, with its accumulators in
  registers.
- dQ: both warpgroups write their dS^T rows into one shared [2 block_k,
  block_q] tile; on alternate steps one of them forms dS K (contracting over
  the block's 2 x block_k keys) and adds the f32 [block_q, H] result to a
  global dQ buffer with one TMA bulk reduction (`reduction_op="add"`), so the
  L2 adds whole tiles instead of one word per atomic operation.

- With `ds_slots=2` the dS^T tile has two slots, step t writing slot t % 2,
  and only the warpgroup that forms step t's dQ waits for both halves; the
  other runs on into its next step under that product.
- With `pipelined` a compute warpgroup issues S^T and dP^T together and
  computes P^T while dP^T runs, issues dV's product before it reads dP^T and
  dK's before it stores its dS^T rows, and waits for both at the end of the
  step (FlashAttention-3's overlap inside a warpgroup).

Its tiles are `configs.MosaicBackwardConfig` (the tuned ones per head size in
tuned.json); what they measured against the Triton backward and cuDNN on an
H200: BUILD_NOTES.md, "flex_attention".

At head size 32 the dS^T tile takes K's 64-byte swizzle rather than its own
128-byte one: wgmma reads both operands of the dQ product `dS K` with one
swizzle.

Masks are those of the Mosaic forward (causal, `(left, right)` windows, key
lengths; no segments or mods), evaluated on tile indices over the query-tile
ranges of the whole block (`masks.query_tiles`): tiles in them that are not
fully open run a masked body.

dQ is accumulated in float32 in an order that varies between runs. Mosaic GPU
interpret mode (jax 0.11.2) has no TMA reductions, no wgmma operand in
registers and no `run_state`; there (`interpret=True`) each block writes its
dQ terms to its own slice of a [blocks, ...] buffer that XLA sums, and the
register operands go through shared memory (`mosaic._add_product`).

Glossary: B batch, Tp / Sp padded query / key tokens, N query heads, K
key/value heads, G = N // K, Hp padded head size, WG warpgroup.
"""

import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from ops import _pallas
from ops._mosaic_gpu import DTYPES
from ops._mosaic_gpu import swizzled
from ops.flex_attention import masks
from ops.flex_attention import mosaic
from ops.flex_attention import mosaic_tiles
from ops.flex_attention.configs import MosaicBackwardConfig
from ops.flex_attention.configs import NUM_COMPUTE_WGS
from ops.flex_attention.masks import i32

_LOG2E = math.log2(math.e)
HEAD_SIZES = (32, 64, 128)  # Padded head sizes the kernel takes.


def takes(dtype, head_dim: int, seq_q: int, seq_kv: int,
          config: MosaicBackwardConfig, *, segments: bool, mods: bool) -> bool:
  """Whether this kernel runs a backward call (else the Triton kernels do):
  16-bit inputs at a padded head size it has, no segment ids or mods, and
  sequences that fill a query tile and a block's key rows."""
  return (jnp.dtype(dtype) in DTYPES and not segments and not mods
          and seq_q >= config.block_q and seq_kv >= config.keys_per_block
          and _config_limit(config, head_dim) is None)


def _config_limit(config: MosaicBackwardConfig, head_dim: int) -> str | None:
  if config.dq_column_chunks > 1 and head_dim // config.dq_column_chunks < 64:
    return (f"`dq_column_chunks` {config.dq_column_chunks} leaves slices of fewer "
            f"than 64 columns at head size {head_dim}")
  return mosaic_tiles.config_limit(config, head_dim, kernel="backward", head_sizes=HEAD_SIZES)


def check_config(config: MosaicBackwardConfig, head_dim: int) -> None:
  if (limit := _config_limit(config, head_dim)) is not None:
    raise ValueError(limit)


def _kernel(kv_len_gmem, q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem,
            dq_gmem, dk_gmem, dv_gmem, *, st, config: MosaicBackwardConfig,
            query_tiles, is_open, interpret: bool):
  """One block: 2 x block_k key rows of one (batch, key/value head)."""
  bq, bk, slots = config.block_q, config.block_k, config.max_concurrent_steps
  hp = q_gmem.shape[-1]
  dtype = q_gmem.dtype
  seq_q = q_gmem.shape[1]
  groups = st.groups
  batch, kv_head = lax.axis_index("batch"), lax.axis_index("kv_heads")
  block = lax.axis_index("k_blocks")
  k0 = block * config.keys_per_block
  kv_len = masks.key_length(st, kv_len_gmem, batch)
  c = st.scale * _LOG2E  # logits -> base-2 units

  # The query tiles of the block, [lo, hi), of which [full_lo, full_hi) are
  # fully open; the same for every query head of the group.
  lo, full_lo, full_hi, hi = (i32(x) for x in query_tiles(
      k0, bq, config.keys_per_block, kv_len, seq_q))
  hi = jnp.maximum(hi, lo)
  per_head = hi - lo
  num_steps = per_head * groups

  def step_tile(t):
    """Step t -> (query head of the group, query tile index)."""
    g = lax.div(t, jnp.maximum(per_head, 1))
    return g, lo + t - g * per_head

  def scoped(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
             stage_smem, kv_ready, q_ready, do_ready, lse_ready, delta_ready,
             q_free, do_free, lse_free, delta_free, ds_ready, ds_free):
    wg = lax.axis_index("wg")

    @pl.when(wg < NUM_COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(config.compute_registers, action="increase")
      rows = pl.ds(wg * bk, bk)
      k_rows, v_rows = k_smem.at[rows], v_smem.at[rows]
      stage = None if stage_smem is None else stage_smem.at[wg]
      plgpu.barrier_wait(kv_ready)
      zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32),
                                              plgpu.Layout.WGMMA)
      col = plgpu.Layout.WGMMA.reduce(0)

      def probabilities(s_t, lse, i, masked):
        """P^T = exp2(S^T c - lse) [bk, bq] in f32, masked."""
        p_t = jnp.exp2(s_t * c - lax.broadcast_in_dim(lse, s_t.shape, [1]))
        if masked:
          layout = plgpu.Layout.WGMMA
          k_idx = k0 + wg * bk + plgpu.broadcasted_iota(jnp.int32, (bk, bq), 0, layout=layout)
          q_idx = i * bq + plgpu.broadcasted_iota(jnp.int32, (bk, bq), 1, layout=layout)
          p_t = jnp.where(is_open(q_idx, k_idx, kv_len), p_t, 0.0)
        return p_t

      def load_row(ready, free, row_smem, slot):
        plgpu.barrier_wait(ready.at[slot])
        row = plgpu.load(row_smem.at[slot], layout=col)
        plgpu.barrier_arrive(free.at[slot])
        return row

      def grad_logits(p_t, dp_t, delta):
        """dS^T = P^T (dP^T - delta), in the inputs' dtype."""
        return (p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))).astype(dtype)

      def store_ds(t, ds_slot, ds16):
        """This warpgroup's rows of step t's dS^T into its shared slot."""
        # The slot's last dQ product (step t - ds_slots) has read it.
        pl.when(t >= config.ds_slots)(lambda: plgpu.barrier_wait(ds_free.at[ds_slot]))
        ds_smem.at[ds_slot, rows][...] = ds16
        plgpu.commit_smem()
        plgpu.barrier_arrive(ds_ready.at[ds_slot])
        if config.ds_slots == 1:  # both wait, so that the barrier's phases match
          plgpu.barrier_wait(ds_ready.at[0])

      def body(t, carry, masked):
        dk, dv = carry
        g, i = step_tile(t)
        slot = lax.rem(t, slots)
        q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
        ds_slot = lax.rem(t, config.ds_slots)
        logits = lambda acc_ref: plgpu.wgmma(acc_ref, k_rows, q_tile.transpose((1, 0)))
        grad_p = lambda acc_ref: plgpu.wgmma(acc_ref, v_rows, do_tile.transpose((1, 0)))

        plgpu.barrier_wait(q_ready.at[slot])
        if config.pipelined and not interpret:
          plgpu.barrier_wait(do_ready.at[slot])
          def overlapped(refs):
            s_ref, dp_ref, dv_ref, dk_ref = refs
            logits(s_ref)
            grad_p(dp_ref)
            s_t = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S^T only
            lse = load_row(lse_ready, lse_free, lse_smem, slot)
            p_t = probabilities(s_t, lse, i, masked)
            plgpu.wgmma(dv_ref, p_t.astype(dtype), do_tile)
            dp_t = plgpu.wgmma_accumulator_load(dp_ref, wait_n=1)  # dV's may run on
            delta = load_row(delta_ready, delta_free, delta_smem, slot)
            ds16 = grad_logits(p_t, dp_t, delta)
            plgpu.wgmma(dk_ref, ds16, q_tile)
            store_ds(t, ds_slot, ds16)
            plgpu.wgmma_wait(0)
          _, _, dv, dk = pl.run_state(overlapped)(
              (plgpu.ACC.init(zeros((bk, bq))), plgpu.ACC.init(zeros((bk, bq))),
               plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
          plgpu.barrier_arrive(do_free.at[slot])
          plgpu.barrier_arrive(q_free.at[slot])
        else:
          def product(issue):
            def run(acc_ref):
              issue(acc_ref)
              return acc_ref[...]
            return pl.run_scoped(run, plgpu.ACC((bk, bq), jnp.float32))
          s_t = product(logits)  # [bk, bq]
          p_t = probabilities(s_t, load_row(lse_ready, lse_free, lse_smem, slot), i, masked)
          plgpu.barrier_wait(do_ready.at[slot])
          dv = mosaic._add_product(dv, p_t.astype(dtype), do_tile, stage)
          dp_t = product(grad_p)
          plgpu.barrier_arrive(do_free.at[slot])
          ds16 = grad_logits(p_t, dp_t, load_row(delta_ready, delta_free, delta_smem, slot))
          dk = mosaic._add_product(dk, ds16, q_tile, stage)
          plgpu.barrier_arrive(q_free.at[slot])
          store_ds(t, ds_slot, ds16)

        # dQ = dS K over the block's keys, from both halves of the step's
        # dS^T: one warpgroup (alternating) forms and adds the tile.
        @pl.when(lax.rem(t, NUM_COMPUTE_WGS) == wg)
        def _dq():
          if config.ds_slots > 1:
            plgpu.barrier_wait(ds_ready.at[ds_slot])
          tile = dq_smem.at[wg]
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # its last add has read it
          width = hp // config.dq_column_chunks
          for chunk in range(config.dq_column_chunks):
            columns = pl.ds(chunk * width, width)
            def dsk(acc_ref):
              plgpu.wgmma(acc_ref, ds_smem.at[ds_slot].transpose((1, 0)),
                          k_smem.at[:, columns])
              return acc_ref[...]
            dq = pl.run_scoped(dsk, plgpu.ACC((bq, width), jnp.float32))
            if chunk == config.dq_column_chunks - 1:
              plgpu.barrier_arrive(ds_free.at[ds_slot])
            tile.at[:, columns][...] = dq
          plgpu.commit_smem()
          n = kv_head * groups + g
          if interpret:  # No TMA reductions: this block's own slice, summed in XLA.
            plgpu.copy_smem_to_gmem(tile, dq_gmem.at[block, batch, pl.ds(i * bq, bq), n])
          else:
            plgpu.copy_smem_to_gmem(tile, dq_gmem.at[batch, pl.ds(i * bq, bq), n],
                                    reduction_op="add")
        return dk, dv

      def loops(g, carry):
        base = g * per_head - lo  # step of query tile i: base + i
        step = lambda masked: lambda i, carry: body(base + i, carry, masked)
        if not st.any_mask:
          return lax.fori_loop(lo, hi, step(False), carry)
        carry = lax.fori_loop(lo, full_lo, step(True), carry)
        carry = lax.fori_loop(full_lo, full_hi, step(False), carry)
        return lax.fori_loop(full_hi, hi, step(True), carry)

      dk, dv = lax.fori_loop(0, groups, loops, (zeros((bk, hp)), zeros((bk, hp))))
      # The last dQ products have read K and dS: K's rows can take dK.
      for ds_slot in range(config.ds_slots):
        pl.when(num_steps > ds_slot)(lambda: plgpu.barrier_wait(ds_free.at[ds_slot]))
      plgpu.wait_smem_to_gmem(0)
      k_rows[...] = (dk * st.scale).astype(dtype)
      v_rows[...] = dv.astype(dtype)
      plgpu.commit_smem()
      out_rows = (batch, pl.ds(k0 + wg * bk, bk), kv_head)
      plgpu.copy_smem_to_gmem(k_rows, dk_gmem.at[out_rows])
      plgpu.copy_smem_to_gmem(v_rows, dv_gmem.at[out_rows])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(config.memory_registers, action="decrease")
      keys = (batch, pl.ds(k0, config.keys_per_block), kv_head)
      plgpu.copy_gmem_to_smem(k_gmem.at[keys], k_smem, kv_ready)
      plgpu.copy_gmem_to_smem(v_gmem.at[keys], v_smem, kv_ready)

      def load(t, slot):
        g, i = step_tile(t)
        n = kv_head * groups + g
        tile = (batch, pl.ds(i * bq, bq), n)
        row = (batch, n, pl.ds(i * bq, bq))
        plgpu.copy_gmem_to_smem(q_gmem.at[tile], q_smem.at[slot], q_ready.at[slot])
        plgpu.copy_gmem_to_smem(do_gmem.at[tile], do_smem.at[slot], do_ready.at[slot])
        plgpu.copy_gmem_to_smem(lse_gmem.at[row], lse_smem.at[slot], lse_ready.at[slot])
        plgpu.copy_gmem_to_smem(delta_gmem.at[row], delta_smem.at[slot],
                                delta_ready.at[slot])

      def wait_free(slot):
        for free in (q_free, do_free, lse_free, delta_free):
          plgpu.barrier_wait(free.at[slot])

      first = jnp.minimum(num_steps, slots)
      @pl.loop(0, first)
      def _fill(t):
        load(t, t)

      @pl.loop(first, num_steps)
      def _steady(t):
        slot = lax.rem(t, slots)
        wait_free(slot)
        load(t, slot)

      # See every phase of the barriers it waits on (interpret mode checks).
      @pl.loop(jnp.maximum(0, num_steps - slots), num_steps)
      def _drain(t):
        wait_free(lax.rem(t, slots))

  transforms = swizzled(dtype, hp)
  ring = lambda dt, shape, **kw: plgpu.SMEM((slots, *shape), dt, **kw)
  released = lambda: plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=slots)
  pl.run_scoped(
      scoped,
      plgpu.SMEM((config.keys_per_block, hp), dtype, transforms=transforms),  # K
      plgpu.SMEM((config.keys_per_block, hp), dtype, transforms=transforms),  # V
      ring(dtype, (bq, hp), transforms=transforms),  # Q
      ring(dtype, (bq, hp), transforms=transforms),  # dO
      ring(jnp.float32, (bq,)),  # lse
      ring(jnp.float32, (bq,)),  # delta
      plgpu.SMEM((config.ds_slots, config.keys_per_block, bq), dtype,
                 transforms=swizzled(dtype, min(bq, hp))),  # dS^T
      plgpu.SMEM((NUM_COMPUTE_WGS, bq, hp), jnp.float32,
                 transforms=swizzled(jnp.float32, hp)),  # dQ tiles
      # The staging buffer of the register operands, interpret mode only.
      (plgpu.SMEM((NUM_COMPUTE_WGS, bk, bq), dtype, transforms=swizzled(dtype, bq))
       if interpret else None),
      plgpu.Barrier(num_arrivals=2),  # K and V loaded
      plgpu.Barrier(num_barriers=slots),
      plgpu.Barrier(num_barriers=slots),
      plgpu.Barrier(num_barriers=slots),
      plgpu.Barrier(num_barriers=slots),
      released(), released(), released(), released(),
      plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=config.ds_slots),  # dS^T written
      plgpu.Barrier(num_barriers=config.ds_slots),  # dS^T read by the dQ product
      collective_axes="wg",
  )


def backward(st, q, k, v, kv_len, lse, delta, dout, *, config: MosaicBackwardConfig,
             query_tiles, is_open, interpret: bool = False):
  """The gradients of `pallas._flex` on the Mosaic GPU kernel.

  Args:
    st: `static.Static` (scale, window, key-length mask, groups); no segments
      or mods.
    q, dout: [B, Tp, N, Hp] 16-bit; k, v: [B, Sp, K, Hp].
    kv_len: [B] int32 key lengths (<= Sp), or None: every row has `st.key_length`.
    lse, delta: [B, N, Tp] f32, the forward's base-2 log-sum-exp and
      rowsum(dO * O).
    config: the tiles; Tp must be a multiple of block_q, Sp of 2 x block_k.
    query_tiles: `(k0, bq, bk, kv_len, seq_q) -> (lo, full_lo, full_hi, hi)`,
      the query-tile ranges of a key tile (`masks.query_tiles` for `st`).
    is_open: `(q_idx, k_idx, kv_len) -> bool` on index tiles (`masks.is_open`).
    interpret: run in Mosaic GPU interpret mode (the CPU).

  Returns:
    (dq, dk, dv) in the inputs' dtype and shapes.
  """
  batch, seq_q, num_heads, hp = q.shape
  seq_kv, num_kv = k.shape[1], k.shape[2]
  check_config(config, hp)
  if seq_q % config.block_q or seq_kv % config.keys_per_block:
    raise ValueError(f"mosaic_backward: Tp = {seq_q} must be a multiple of "
                     f"{config.block_q} and Sp = {seq_kv} of {config.keys_per_block}")
  num_blocks = seq_kv // config.keys_per_block
  dq_shape = ((num_blocks,) if interpret else ()) + q.shape
  dq_acc = jax.new_ref(jnp.zeros(dq_shape, jnp.float32))
  kernel = functools.partial(_kernel, st=st, config=config, query_tiles=query_tiles,
                             is_open=is_open, interpret=interpret)
  lengths, kernel = masks.key_length_operand(kv_len, kernel)
  dk, dv = _pallas.mosaic_kernel(
      kernel, out_type=(jax.ShapeDtypeStruct(k.shape, k.dtype),
                        jax.ShapeDtypeStruct(v.shape, v.dtype)),
      grid=(num_kv, num_blocks, batch), grid_names=("kv_heads", "k_blocks", "batch"),
      num_threads=NUM_COMPUTE_WGS + 1, thread_name="wg",
      kernel_name="flex_attention_mosaic_bwd",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(*lengths, q, k, v, dout, lse, delta, dq_acc)
  dq = jax.freeze(dq_acc)
  if interpret:
    dq = dq.sum(axis=0)
  # Under shard_map the kernel's outputs come back typed as not varying (its
  # Ref operand cannot be typed as varying); `pallas._flex_bwd` types the
  # gradients as q, k and v.
  return (dq * st.scale).astype(q.dtype), dk, dv
