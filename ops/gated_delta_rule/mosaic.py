"""Mosaic GPU (Hopper) state walks of the gated delta rule, forward and reverse.

The walks are the serial part of the op: per (batch, head) the forward carries
the [K, V] state M through the chunks, `U = U~ - W M0`, `M1 = e^{b_L} M0 +
K^T (D U)` with `D = diag(e^{b_L - b})`, and forms the output on its way,
`Y = scale (E Q M0 + S U)` with `E = diag(e^b)` and the scores
`S = (Q K^T) * D_causal`; when a gradient will be taken it also stores the
state entering each chunk and U. The reverse (`walk_reverse`) carries the
adjoint back. There are only B x N walks (128 at B 8, N 16), about one per SM,
so a walk's time is its chain's latency per chunk times the number of chunks.
The Triton walks (`triton._states_kernel`, `triton._states_bwd_kernel`) are
the baseline (their time a chunk: BUILD_NOTES.md, "SSD and the gated delta
rule"). Here a block has three warpgroups:

- a memory warpgroup streams each chunk's operands into a ring of `slots`
  shared-memory slots with TMA, ahead of the chain;
- two compute warpgroups hold the f32 state in registers, 64 of its K rows
  each. Per chunk each writes its rows (in the input dtype) to shared memory
  (and, with residuals, hands them to TMA for the states output); then each
  forms 64 of the V columns of `[W; Q] M0` with one `wgmma`: W and Q share a
  64-row tile, one above the other, so `W M0` (for `U = U~ - W M0`) and
  `Q M0` (for Y) come from the rows a warpgroup's `wgmma` takes anyway, and
  `[W; Q] K^T` gives the scores. Each stores its U columns and their rows
  scaled by D to shared memory, then adds `K^T (D U)` for its K rows and forms
  `S U` for its V columns with two more `wgmma`s. Its [U; Y] tile leaves for
  global memory (TMA) during the next chunk's first `wgmma`s.

So the chain per chunk is two rounds of `wgmma`s and two warpgroup barriers,
and the loads and stores run beside it. The reverse walk has the same
structure on the adjoint G: `dU = scale S^T dY + D K G`, `G <- e^{b_L} G +
Q^T (scale E dY) - W^T dU`, with `S^T = (K Q^T) * D_causal^T` formed from the
same K operand as `K G` (the forward does not store the scores). Every `wgmma`
reads both operands from shared memory, so the kernels run unchanged in Mosaic
GPU interpret mode.

Rounding differs from the Triton walks where a decay scales an operand: the
forward multiplies K by D U rounded to the input dtype (the Triton walk rounds
`e^{b_L - b} K` and U), and the reverse multiplies Q by `scale E dY` rounded
(the Triton walk rounds `e^b Q`) and scales K G's rows by D in float32 after
the product.

Glossary: B batch, T time (a multiple of the chunk), N heads, G key groups,
K key size, V value size, L tokens per chunk, WG warpgroup.
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from ops import _pallas
from ops._mosaic_gpu import DTYPES
from ops._mosaic_gpu import SMEM_BUDGET
from ops._mosaic_gpu import num_sms
from ops._mosaic_gpu import swizzled
from ops._mosaic_gpu import takes as _mosaic_takes
from ops.gated_delta_rule import configs

_F32 = jnp.float32
# The walks' structure, which their code is written for (the tuned ring depth
# is configs.MosaicConfig's): the state's K rows split over two compute
# warpgroups of 64 wgmma rows each, and the registers split between them and
# the memory warpgroup, which only issues copies.
KEY_SIZE = VALUE_SIZE = 128   # the padded sizes the walk is written for
_ROWS = 64                    # a warpgroup's wgmma rows
_COMPUTE_WGS = 2
_COMPUTE_REGISTERS = 232
_MEMORY_REGISTERS = 40


def limit(dtype, key: int, value: int, chunk: int) -> str | None:
  """None when the Mosaic walk takes these (padded) sizes, else why not."""
  if jnp.dtype(dtype) not in DTYPES:
    return f"the Mosaic walk takes 16-bit inputs, got {jnp.dtype(dtype).name}"
  if (key, value) != (KEY_SIZE, VALUE_SIZE):
    return (f"the Mosaic walk takes padded K = V = {KEY_SIZE}, got K = {key}, "
            f"V = {value}")
  if not 16 <= chunk <= _ROWS // 2:  # the chunks tested (interpret mode) and timed
    return f"the Mosaic walk takes chunks of 16 to {_ROWS // 2} tokens, got {chunk}"
  return None


def takes(dtype, key: int, value: int, chunk: int) -> bool:
  """Whether the compiled Mosaic walk runs these inputs here (a Hopper GPU)."""
  return _mosaic_takes(dtype) and limit(dtype, key, value, chunk) is None


def _causal_decayed(causal, x, gap):
  """x * exp(gap) where `causal`, else 0: decayed scores. The gaps above the
  diagonal (and in padding rows) never reach the exponential, where they
  could overflow, nor do padding values reach the result."""
  return jnp.where(causal, x * jnp.exp(jnp.where(causal, gap, 0.0)), 0.0)


def _forward_kernel(q_gmem, k_gmem, w_gmem, ut_gmem, b_gmem, h0_gmem, *outs, chunk,
                    groups_per_key, slots, scale, residuals):
  """The forward walk with the output: per chunk `U = U~ - W M0`,
  `Y = scale (E Q M0 + S U)` with the scores `S = (Q K^T) * D_causal`, and
  `M1 = e^{b_L} M0 + K^T (D U)`. `outs`: y, the final state and, with
  `residuals`, the states entering each chunk and U."""
  y_gmem, final_gmem, *saved = outs
  L = chunk
  num_chunks = k_gmem.shape[1] // L
  dtype = w_gmem.dtype
  bi, n = lax.axis_index("batch"), lax.axis_index("heads")
  g = lax.div(n, jnp.int32(groups_per_key))
  half = _ROWS  # K rows of the state and V columns of U and Y per compute warpgroup

  def scoped(k_smem, kw_smem, wq_smem, ut_smem, b_smem, state_smem, uy_smem, du_smem,
             s_smem, loaded, free, state_ready, u_ready):
    wg = lax.axis_index("wg")

    @pl.when(wg < _COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
      mine = pl.ds(wg * half, half)  # this WG's K rows of M and V columns of U, Y
      wgmma_layout = plgpu.Layout.WGMMA
      rows_layout, cols_layout = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
      iota = lambda shape, axis: plgpu.broadcasted_iota(jnp.int32, shape, axis,
                                                        layout=wgmma_layout)
      # The scores' rows are the [W; Q] operand's rows L..2L-1 (token i = row - L).
      token = iota((_ROWS, L), 0) - L
      causal = (token >= iota((_ROWS, L), 1)) & (token < L)
      u_rows = iota((_ROWS, half), 0) < L  # the U / Y tile: U above, Y below
      m0 = plgpu.load(h0_gmem.at[bi, n, mine], layout=wgmma_layout, optimized=False)
      by_row = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])

      def flush(c, u, y):
        """Chunk c's [U; Y] tile to global memory (U only with residuals)."""
        tile = uy_smem.at[lax.rem(c, 2), wg]
        tile[...] = jnp.where(u_rows, u, y)
        plgpu.commit_smem()
        if residuals:
          plgpu.copy_smem_to_gmem(tile.at[pl.ds(0, L)], saved[1].at[bi, pl.ds(c * L, L), n, mine],
                                  commit_group=False)
        plgpu.copy_smem_to_gmem(tile.at[pl.ds(L, L)], y_gmem.at[bi, pl.ds(c * L, L), n, mine])

      def step(c, carry):
        m, u_last, y_last = carry
        parity, slot = lax.rem(c, 2), lax.rem(c, slots)
        # The state entering chunk c: to shared memory (the products read all K
        # rows of it) and, with residuals, by TMA to the states output. The
        # store two chunks back read this buffer; three newer groups may be in
        # flight (each chunk commits two: its state, and the last chunk's tile).
        if residuals:
          plgpu.wait_smem_to_gmem(3, wait_read_only=True)
        state_smem.at[parity, mine][...] = m.astype(dtype)
        plgpu.commit_smem()
        if residuals:
          plgpu.copy_smem_to_gmem(state_smem.at[parity, mine],
                                  saved[0].at[bi, n, c, mine])
        plgpu.barrier_arrive(state_ready)
        plgpu.barrier_wait(state_ready)
        plgpu.barrier_wait(loaded.at[slot])

        # [W; Q] M0[:, mine] (rows < L: W M0, rows L..2L-1: Q M0) and
        # [W; Q] K^T (rows L..2L-1: Q K^T); rows past 2L are padding.
        def products(wq_m0_ref, wq_k_ref):
          plgpu.wgmma(wq_m0_ref, wq_smem.at[slot], state_smem.at[parity, :, mine])
          plgpu.wgmma(wq_k_ref, wq_smem.at[slot], kw_smem.at[slot].transpose((1, 0)))
          # Off the chain while they run: the last chunk's tile leaves, and
          # this chunk's decays.
          pl.when(c > 0)(lambda: flush(c - 1, u_last, y_last))
          b = plgpu.load(b_smem.at[slot], layout=rows_layout)  # b, then b again
          b_tokens = plgpu.load(b_smem.at[slot, pl.ds(0, L)], layout=cols_layout)
          gap = by_row(b, (_ROWS, L)) - lax.broadcast_in_dim(b_tokens, (_ROWS, L), [1])
          score_decay = _causal_decayed(causal, 1.0, gap)
          return wq_m0_ref[...], wq_k_ref[...], b, score_decay
        wq_m0, wq_k, b, score_decay = pl.run_scoped(
            products, plgpu.ACC((_ROWS, half), _F32), plgpu.ACC((_ROWS, L), _F32))
        u_tilde = plgpu.load(ut_smem.at[slot, :, mine], layout=wgmma_layout)
        u = (u_tilde.astype(_F32) - wq_m0).astype(dtype)
        b_last = b_smem[slot, L - 1]
        # The tile two chunks back has left for global memory (newer: the last
        # chunk's tile and, with residuals, this chunk's state).
        plgpu.wait_smem_to_gmem(2 if residuals else 1, wait_read_only=True)
        uy_smem.at[parity, wg][...] = u
        du_smem.at[:, mine][...] = (
            u.astype(_F32) * by_row(jnp.exp(b_last - b), u.shape)).astype(dtype)
        s_smem.at[wg][...] = (wq_k * score_decay).astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(u_ready)
        plgpu.barrier_wait(u_ready)

        # M1[mine] = e^{b_L} M0[mine] + K[:, mine]^T (D U), and S U[:, mine].
        def update_and_su(update_ref, su_ref):
          plgpu.wgmma(update_ref, k_smem.at[slot, :, mine].transpose((1, 0)),
                      du_smem.at[pl.ds(0, L)])
          plgpu.wgmma(su_ref, s_smem.at[wg], uy_smem.at[parity, wg, pl.ds(0, L)])
          return update_ref[...], su_ref[...]
        update, su = pl.run_scoped(update_and_su, plgpu.ACC((half, VALUE_SIZE), _F32),
                                   plgpu.ACC((_ROWS, half), _F32))
        plgpu.barrier_arrive(free.at[slot])
        y = (scale * (by_row(jnp.exp(b), wq_m0.shape) * wq_m0 + su)).astype(dtype)
        return jnp.exp(b_last) * m + update, u, y

      zeros = plgpu.layout_cast(jnp.zeros((_ROWS, half), dtype), wgmma_layout)
      m, u, y = lax.fori_loop(0, num_chunks, step, (m0, zeros, zeros))
      flush(num_chunks - 1, u, y)
      final_gmem.at[bi, n, mine][...] = m
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

      def load(c, slot):
        rows, top, below = pl.ds(c * L, L), pl.ds(0, L), pl.ds(L, L)
        done = loaded.at[slot]
        plgpu.copy_gmem_to_smem(k_gmem.at[bi, rows, g], k_smem.at[slot], done)
        plgpu.copy_gmem_to_smem(k_gmem.at[bi, rows, g], kw_smem.at[slot], done)
        plgpu.copy_gmem_to_smem(w_gmem.at[bi, rows, n], wq_smem.at[slot, top], done)
        plgpu.copy_gmem_to_smem(q_gmem.at[bi, rows, g], wq_smem.at[slot, below], done)
        plgpu.copy_gmem_to_smem(ut_gmem.at[bi, rows, n], ut_smem.at[slot, top], done)
        load_twice(b_gmem.at[bi, n, rows], b_smem.at[slot], done, L)

      _stream(num_chunks, slots, load, free)

  wide, narrow = swizzled(dtype, KEY_SIZE), swizzled(dtype, L)
  pl.run_scoped(
      scoped,
      # Operands contracted over the chunk's L tokens (K^T (D U), S U) take
      # swizzles that span L: 64 bytes at L = 32.
      plgpu.SMEM((slots, L, KEY_SIZE), dtype, transforms=narrow),          # K
      plgpu.SMEM((slots, L, KEY_SIZE), dtype, transforms=wide),            # K, for Q K^T
      plgpu.SMEM((slots, _ROWS, KEY_SIZE), dtype, transforms=wide),        # [W; Q], padded
      plgpu.SMEM((slots, _ROWS, VALUE_SIZE), dtype, transforms=wide),      # U~, padded
      plgpu.SMEM((slots, _ROWS), _F32),                                    # [b; b]
      plgpu.SMEM((2, KEY_SIZE, VALUE_SIZE), dtype, transforms=wide),       # M0
      # [U; Y], a [64, 64] tile per warpgroup (TMA stores contiguous tiles only)
      plgpu.SMEM((2, _COMPUTE_WGS, _ROWS, half), dtype, transforms=narrow),
      plgpu.SMEM((_ROWS, VALUE_SIZE), dtype, transforms=narrow),           # D U
      plgpu.SMEM((_COMPUTE_WGS, _ROWS, L), dtype, transforms=narrow),      # S, padded
      plgpu.Barrier(num_arrivals=7, num_barriers=slots),   # a chunk's seven loads
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=slots),  # slot released
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS),            # both state halves written
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS),            # both D U halves written
      collective_axes="wg",
  )


def _reverse_kernel(q_gmem, k_gmem, w_gmem, dy_gmem, b_gmem, dfinal_gmem,
                    dstates_gmem, du_gmem, dh0_gmem, *, chunk, groups_per_key, slots, scale):
  """The reversed walk: the adjoint G of the state leaving each chunk, from the
  last chunk back. Per chunk `dU = scale S^T dY + D K G` and
  `G <- e^{b_L} G + Q^T (scale E dY) - W^T dU` with `E = diag(e^b)`; warpgroup
  j forms dU's V columns j and G's K rows j. The transposed scores
  `S^T = (K Q^T) * D_causal^T` are formed here (the forward does not store
  them), from the same K operand as `K G`."""
  L = chunk
  num_chunks = k_gmem.shape[1] // L
  dtype = w_gmem.dtype
  bi, n = lax.axis_index("batch"), lax.axis_index("heads")
  g = lax.div(n, jnp.int32(groups_per_key))
  half = _ROWS

  def scoped(k_smem, q_smem, qw_smem, w_smem, dy_smem, st_smem, b_smem, g_smem,
             du_out_smem, du_smem, edy_smem, loaded, free, g_ready, du_ready):
    wg = lax.axis_index("wg")

    @pl.when(wg < _COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
      mine = pl.ds(wg * half, half)
      wgmma_layout = plgpu.Layout.WGMMA
      rows_layout, cols_layout = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
      iota = lambda axis: plgpu.broadcasted_iota(jnp.int32, (_ROWS, L), axis,
                                                 layout=wgmma_layout)
      # S^T's row j is key token j, its column i query token i (rows >= L: padding).
      causal = (iota(1) >= iota(0)) & (iota(0) < L)
      g0 = plgpu.load(dfinal_gmem.at[bi, n, mine], layout=wgmma_layout, optimized=False)

      def step(t, adj):
        c = num_chunks - 1 - t
        parity, slot = lax.rem(t, 2), lax.rem(t, slots)
        # G to shared memory (the D K G product reads all K rows) and, by TMA,
        # to the adjoint-states output; its store one chunk back read g_smem.
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        g_smem.at[mine][...] = adj.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(g_smem.at[mine], dstates_gmem.at[bi, n, c, mine])
        plgpu.barrier_arrive(g_ready)
        plgpu.barrier_wait(g_ready)
        plgpu.barrier_wait(loaded.at[slot])

        # dU[:, mine] = scale S^T dY + D K G (padded rows: never read).
        def k_products(kg_ref, kq_ref):
          plgpu.wgmma(kg_ref, k_smem.at[slot], g_smem.at[:, mine])
          plgpu.wgmma(kq_ref, k_smem.at[slot], qw_smem.at[slot].transpose((1, 0)))
          return kg_ref[...], kq_ref[...]
        kg, kq = pl.run_scoped(k_products, plgpu.ACC((_ROWS, half), _F32),
                               plgpu.ACC((_ROWS, L), _F32))
        b = plgpu.load(b_smem.at[slot], layout=rows_layout)
        b_tokens = plgpu.load(b_smem.at[slot, pl.ds(0, L)], layout=cols_layout)
        b_last = b_smem[slot, L - 1]
        gap = (lax.broadcast_in_dim(b_tokens, (_ROWS, L), [1])
               - lax.broadcast_in_dim(b, (_ROWS, L), [0]))
        scores_t = _causal_decayed(causal, kq, gap)
        st_smem.at[wg][...] = scores_t.astype(dtype)
        plgpu.commit_smem()
        def st_dy(acc_ref):
          plgpu.wgmma(acc_ref, st_smem.at[wg], dy_smem.at[slot, pl.ds(0, L), mine])
          return acc_ref[...]
        sdy = pl.run_scoped(st_dy, plgpu.ACC((_ROWS, half), _F32))
        rows = lambda x: lax.broadcast_in_dim(x, (_ROWS, half), [0])
        du = (scale * sdy + rows(jnp.exp(b_last - b)) * kg).astype(dtype)
        dy = plgpu.load(dy_smem.at[slot, :, mine], layout=wgmma_layout)
        plgpu.wait_smem_to_gmem(2, wait_read_only=True)  # du_out_smem[parity] is free
        du_out_smem.at[parity, wg][...] = du
        du_smem.at[:, mine][...] = -du
        edy_smem.at[:, mine][...] = (rows(scale * jnp.exp(b)) * dy.astype(_F32)).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(du_out_smem.at[parity, wg, pl.ds(0, L)],
                                du_gmem.at[bi, pl.ds(c * L, L), n, mine])
        plgpu.barrier_arrive(du_ready)
        plgpu.barrier_wait(du_ready)

        # G[mine] <- e^{b_L} G[mine] + Q[:, mine]^T (scale E dY) - W[:, mine]^T dU.
        def update(acc_ref):
          plgpu.wgmma(acc_ref, q_smem.at[slot, :, mine].transpose((1, 0)),
                      edy_smem.at[pl.ds(0, L)])
          plgpu.wgmma(acc_ref, w_smem.at[slot, :, mine].transpose((1, 0)),
                      du_smem.at[pl.ds(0, L)])
          return acc_ref[...]
        terms = pl.run_scoped(update, plgpu.ACC((half, VALUE_SIZE), _F32))
        plgpu.barrier_arrive(free.at[slot])
        return jnp.exp(b_last) * adj + terms

      adj = lax.fori_loop(0, num_chunks, step, g0)
      dh0_gmem.at[bi, n, mine][...] = adj
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

      def load(t, slot):
        c = num_chunks - 1 - t
        rows, head_rows = pl.ds(c * L, L), pl.ds(0, L)
        done = loaded.at[slot]
        plgpu.copy_gmem_to_smem(k_gmem.at[bi, rows, g], k_smem.at[slot, head_rows], done)
        plgpu.copy_gmem_to_smem(q_gmem.at[bi, rows, g], q_smem.at[slot], done)
        plgpu.copy_gmem_to_smem(q_gmem.at[bi, rows, g], qw_smem.at[slot], done)
        plgpu.copy_gmem_to_smem(w_gmem.at[bi, rows, n], w_smem.at[slot], done)
        plgpu.copy_gmem_to_smem(dy_gmem.at[bi, rows, n], dy_smem.at[slot, head_rows], done)
        plgpu.copy_gmem_to_smem(b_gmem.at[bi, n, rows], b_smem.at[slot, head_rows], done)

      _stream(num_chunks, slots, load, free)

  wide, narrow = swizzled(dtype, KEY_SIZE), swizzled(dtype, L)
  pl.run_scoped(
      scoped,
      plgpu.SMEM((slots, _ROWS, KEY_SIZE), dtype, transforms=wide),      # K, padded
      # Operands contracted over the chunk's L tokens: 64-byte swizzles at L = 32.
      plgpu.SMEM((slots, L, KEY_SIZE), dtype, transforms=narrow),        # Q
      plgpu.SMEM((slots, L, KEY_SIZE), dtype, transforms=wide),          # Q, for K Q^T
      plgpu.SMEM((slots, L, KEY_SIZE), dtype, transforms=narrow),        # W
      plgpu.SMEM((slots, _ROWS, VALUE_SIZE), dtype, transforms=narrow),  # dY, padded
      plgpu.SMEM((_COMPUTE_WGS, _ROWS, L), dtype, transforms=narrow),    # S^T, padded
      plgpu.SMEM((slots, _ROWS), _F32),                                  # b
      plgpu.SMEM((KEY_SIZE, VALUE_SIZE), dtype, transforms=wide),        # G
      plgpu.SMEM((2, _COMPUTE_WGS, _ROWS, half), dtype, transforms=swizzled(dtype, half)),
      plgpu.SMEM((_ROWS, VALUE_SIZE), dtype, transforms=narrow),         # -dU
      plgpu.SMEM((_ROWS, VALUE_SIZE), dtype, transforms=narrow),         # scale E dY
      plgpu.Barrier(num_arrivals=6, num_barriers=slots),   # a chunk's six loads
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=slots),
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS),            # both halves of G written
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS),            # both halves of dU, E dY
      collective_axes="wg",
  )


def _stream(num_chunks, slots, load, free):
  """The memory warpgroup: `load(t, slot)` for t = 0, 1, ..., each into the
  ring slot the compute warpgroups released `slots` chunks before."""
  @pl.loop(0, num_chunks)
  def _load(t):
    slot = lax.rem(t, slots)
    pl.when(t >= slots)(lambda: plgpu.barrier_wait(free.at[slot]))
    load(t, slot)

  drain(free, num_chunks, slots)


def load_twice(src, dst, done, rows: int):
  """`src` (`rows` rows) by TMA into rows 0..rows-1 and rows..2 rows-1 of
  `dst`: a vector for both halves of a 64-row tile (two arrivals on `done`)."""
  plgpu.copy_gmem_to_smem(src, dst.at[pl.ds(0, rows)], done)
  plgpu.copy_gmem_to_smem(src, dst.at[pl.ds(rows, rows)], done)


def store_halves(tile, top, below, rows: int):
  """Rows 0..rows-1 of a shared-memory tile to `top` and rows..2 rows-1 to
  `below` by TMA, in the bulk group of the next store that commits one."""
  plgpu.copy_smem_to_gmem(tile.at[pl.ds(0, rows)], top, commit_group=False)
  plgpu.copy_smem_to_gmem(tile.at[pl.ds(rows, rows)], below, commit_group=False)


def drain(free, count: int, slots: int):
  """Waits on the last `slots` of `count` releases of a ring's `free`
  barriers, the ones a loader that waits only before reusing a slot never
  sees (interpret mode checks that every phase is waited on)."""
  @pl.loop(max(count - slots, 0), count)
  def _drain(t):
    plgpu.barrier_wait(free.at[lax.rem(t, slots)])


def runs_per_head(caller, batch: int, heads: int, num_chunks: int,
                  runs: int | None = None) -> int:
  """Runs of chunks per (batch, head) for the gradient kernels, whose chunks are
  independent: `runs` if given (it must divide the chunk count), else the
  largest divisor of the chunk count that keeps the blocks within one wave
  (one block per SM: their rings fill most of its shared memory)."""
  if runs is None:
    room = max(1, num_sms() // (batch * heads))
    return max(d for d in range(1, min(room, num_chunks) + 1) if num_chunks % d == 0)
  if num_chunks % runs:
    raise ValueError(f"{caller}: `splits` {runs} must divide the {num_chunks} chunks")
  return runs


def check_smem(caller, slots: int, need: int):
  """Raises when a block with `slots` ring units needs more shared memory than
  a block has."""
  if need > SMEM_BUDGET:
    raise ValueError(f"{caller}: `slots` {slots} needs {need} bytes of shared memory, over "
                     f"the {SMEM_BUDGET} a block has")


def _check(caller, dtype, key, value, time, chunk, slots):
  if (why := limit(dtype, key, value, chunk)) is not None:
    raise ValueError(f"{caller}: {why}")
  if time % chunk:
    raise ValueError(f"{caller}: T = {time} must be a multiple of `chunk` {chunk}")
  if slots < 2:
    raise ValueError(f"{caller}: `slots` must be >= 2, got {slots}")


def launch(kernel, *, name, batch, heads, out_type, args, interpret, runs=None,
           compute_wgs=_COMPUTE_WGS):
  """One block per (head, batch), or per run of chunks of one with `runs`, of
  `compute_wgs` compute warpgroups and a memory warpgroup."""
  grid, names = (heads, batch), ("heads", "batch")
  if runs is not None:
    grid, names = grid + (runs,), names + ("split",)
  return _pallas.mosaic_kernel(
      kernel, out_type=out_type, grid=grid, grid_names=names,
      num_threads=compute_wgs + 1, thread_name="wg", kernel_name=name,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(*args)


def walk_forward(q, k, w, u_tilde, b, h0, *, chunk: int, scale: float,
                 residuals: bool = True, slots: int | None = None,
                 interpret: bool = False):
  """The forward state walk with the output, on the Mosaic GPU kernel.

  Args:
    q, k: [B, T, G, K] queries and keys (T a multiple of `chunk`, K = 128).
    w, u_tilde: [B, T, N, K] and [B, T, N, V] (V = 128), the prepare kernel's
      W and U~, in k's 16-bit dtype.
    b: [B, N, T] float32, the chunk-local cumulative log-decay.
    h0: [B, N, K, V] float32 initial state.
    chunk: tokens per chunk (16 to 32).
    scale: the output scale.
    residuals: also return what the backward reads (the states and U).
    slots: shared-memory slots of the input ring (2 or more; None: the
      tuned `configs.MosaicConfig.walk_slots`).
    interpret: run in Mosaic GPU interpret mode (the CPU).

  Returns:
    (y [B, T, N, V] in k's dtype, the final state [B, N, K, V] float32, and
    with `residuals` the pair (states [B, N, C, K, V] entering each chunk,
    U [B, T, N, V]) in k's dtype, else None).
  """
  batch, time, groups, key = k.shape
  heads, value = u_tilde.shape[2:]
  slots = configs.MosaicConfig().walk_slots if slots is None else slots
  _check("walk_forward", k.dtype, key, value, time, chunk, slots)
  kernel = functools.partial(_forward_kernel, chunk=chunk, groups_per_key=heads // groups,
                             slots=slots, scale=scale, residuals=residuals)
  rows = jax.ShapeDtypeStruct(u_tilde.shape, k.dtype)
  out_type = (rows, jax.ShapeDtypeStruct((batch, heads, key, value), _F32))
  if residuals:
    out_type += (jax.ShapeDtypeStruct((batch, heads, time // chunk, key, value), k.dtype),
                 rows)
  y, final, *saved = launch(kernel, name="gated_delta_states_mosaic", batch=batch,
                             heads=heads, out_type=out_type,
                             args=(q, k, w, u_tilde, b, h0), interpret=interpret)
  return y, final, (tuple(saved) if residuals else None)


def walk_reverse(q, k, w, dy, b, dfinal, *, chunk: int, scale: float,
                 slots: int | None = None, interpret: bool = False):
  """The backward's reversed state walk on the Mosaic GPU kernel.

  Args:
    q, k: [B, T, G, K] (T a multiple of `chunk`, K = 128), 16-bit.
    w: [B, T, N, K], the prepare kernel's W; dy: [B, T, N, V] (V = 128), the
      output's cotangent; both in q's dtype.
    b: [B, N, T] float32, the chunk-local cumulative log-decay.
    dfinal: [B, N, K, V] float32, the final state's cotangent.
    chunk, scale: the chunk (16 to 32 tokens) and the output scale.
    slots, interpret: as in `walk_forward`.

  Returns:
    (the adjoint of the state leaving each chunk [B, N, C, K, V] and dU
    [B, T, N, V], in q's dtype; d initial_state [B, N, K, V] float32).
  """
  batch, time, groups, key = k.shape
  heads, value = dy.shape[2:]
  slots = configs.MosaicConfig().walk_slots if slots is None else slots
  _check("walk_reverse", k.dtype, key, value, time, chunk, slots)
  kernel = functools.partial(_reverse_kernel, chunk=chunk, groups_per_key=heads // groups,
                             slots=slots, scale=scale)
  out_type = (jax.ShapeDtypeStruct((batch, heads, time // chunk, key, value), k.dtype),
              jax.ShapeDtypeStruct(dy.shape, k.dtype),
              jax.ShapeDtypeStruct((batch, heads, key, value), _F32))
  return launch(kernel, name="gated_delta_states_reverse_mosaic", batch=batch,
                 heads=heads, out_type=out_type, args=(q, k, w, dy, b, dfinal),
                 interpret=interpret)
