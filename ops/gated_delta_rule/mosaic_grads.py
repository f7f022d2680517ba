"""Mosaic GPU (Hopper) chunk gradients of the gated delta rule: dQ, dK, dV,
d log-decay and d beta in one kernel.

After the reverse walk has formed dU and the adjoint states, every chunk's
gradients are independent. The Triton path splits them into a value-gradient
kernel (no state) and a key-gradient kernel (the products with the state M0
entering the chunk and the adjoint dM1 of the state leaving it), which pass
`T^T dU` and the [L, L] adjoints through memory and read q, k, U and dY twice.
This kernel reads each chunk once (Q, K, V, U, dU, dY, T^T and the two
states: 114 KB in bf16 at K = V = 128, L = 32) and writes dQ, dK, dV.

Two identities keep it to products of operands it has in shared memory:
- The adjoint of `A` (T = (I + A)^-1, U~ = T R_u, W = T R_w, U = U~ - W M0):
  dT = dU ((I + A) U)^T, so dA = -T^T dT T^T = -(T^T dU) U^T, strictly lower
  (no product with the inverse's own adjoint chain).
- Transposes from operand order: with a1 = [T^T dU; dY] and uv = [U; V]
  (64-row tiles, token i in rows i and L + i; dru = T^T dU),
      X = a1 uv^T = [[dru U^T, dru V^T], [dY U^T, *]],
      Y = uv a1^T = [[U dru^T, U dY^T], *],
  hold every [L, L] block the gradients need, transposed where needed (and
  d beta's share through dV = beta dru on X's diagonal of dru V^T).

Rows 0..L-1 of every 64-row tile belong to dK and rows L..2L-1 to dQ:

    P1 = [T^T dU; dY] M0^T,   P2 = [U; V] dM1^T (rows 0..L-1 read),
    Z  = r1 * P1 + r2 * P2 + A5 [K; Q],
    A5 = [[dA~ + dA~^T, dS~^T], [dS~, 0]]

with r1 = [-beta e^b; scale e^b], r2 = [e^{b_L - b}; 0], dA~ = dA * beta_i *
D, dS~ = scale tril(dY U^T) * D (D the causal decays). A5 is formed in
registers from X and Y and goes through shared memory once, as the operand of
its product. The row and column sums that give d b and d beta leave as
64-entry vectors per chunk and compute warpgroup (`_VECTORS`), folded by the
caller.

A block walks a run of chunks of one (batch, head): a memory warpgroup streams
each chunk's row tiles and states, by halves of their V columns, into two
rings (the rows' two chunks deep where shared memory allows, the states' one
chunk), and two compute warpgroups share each chunk: each forms `T^T dU` for
one V half, then warpgroup 1 forms Y and hands it over while warpgroup 0
forms X, Z2 and A5, and each runs the state products and `A5 [K; Q]` for one
half of dQ's and dK's columns (M0's and dM1's rows).

With heads sharing keys its dQ and dK go out in float32 and only a one-chunk
row ring fits, which makes it slower than the two kernels it replaces, so the
op picks it only where every head has its own keys (timings and the variants
that lost: BUILD_NOTES.md, "SSD and the gated delta rule").

Glossary: B batch, T time (a multiple of the chunk), N heads, G key groups,
K key size, V value size, C chunks, L tokens per chunk (32 here), WG warpgroup.
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from ops._mosaic_gpu import swizzled
from ops.gated_delta_rule import configs
from ops.gated_delta_rule import mosaic

_F32 = jnp.float32
# The kernel's structure, which its code is written for (the tuned ring depth is
# configs.MosaicConfig's).
KEY = mosaic.KEY_SIZE           # the padded K = V the kernel is written for
CHUNK = 32                      # tokens per chunk: dK's rows, then dQ's, fill 64
_ROWS = 2 * CHUNK
_HALF = 64                      # V columns of a streamed unit
_UNITS = KEY // _HALF           # units per chunk
_COMPUTE_WGS = 2                # each takes a V half, then a K half
_COMPUTE_REGISTERS = 232
_MEMORY_REGISTERS = 40
# The 64-entry vectors per chunk and compute warpgroup in the `vectors` output:
# d b by row (token i in rows i and L + i) and d beta by row from the state
# products, the d b terms of the chunk's last token, and from the [L, L] terms
# (warpgroup 0's) d b by row, d beta by row and d b by column (minus; tokens
# in columns 0..L-1).
_VECTORS = DB, DBETA, END, DB_PAIRS, DBETA_PAIRS, DB_COLS = range(6)


def limit(dtype, key: int, value: int, chunk: int) -> str | None:
  """None when the kernel takes these (padded) sizes, else why not."""
  if (why := mosaic.limit(dtype, key, value, chunk)) is not None:
    return why
  if chunk != CHUNK:
    return f"the Mosaic chunk gradients take chunks of {CHUNK} tokens, got {chunk}"
  return None


def takes(dtype, key: int, value: int, chunk: int) -> bool:
  """Whether the compiled kernel runs these inputs here (a Hopper GPU)."""
  return mosaic.takes(dtype, key, value, chunk) and limit(dtype, key, value, chunk) is None


def _kernel(q_gmem, k_gmem, v_gmem, u_gmem, du_gmem, dy_gmem, tt_gmem, b_gmem, beta_gmem,
            states_gmem, dstates_gmem, dq_gmem, dk_gmem, dv_gmem, vectors_gmem, *,
            groups_per_key, chunks_per_block, slots, scale):
  # `slots` is the row ring's depth in units; the state ring holds one chunk
  # (its unit h in slot h).
  L = CHUNK
  dtype = q_gmem.dtype
  bi, n = lax.axis_index("batch"), lax.axis_index("heads")
  first = lax.axis_index("split") * chunks_per_block
  g = lax.div(n, jnp.int32(groups_per_key))
  top, below = pl.ds(0, L), pl.ds(L, L)

  shared_staging = dq_gmem.dtype == dtype

  def scoped(a1_smem, uv_smem, du_smem, m0_smem, dm1_smem, kq_smem, tt_smem, b_smem,
             beta_smem, y_smem, a5_smem, out_smem, vectors_smem,
             rows_loaded, rows_free, states_loaded, states_free, chunk_loaded, chunk_free,
             a1_ready, y_ready, a5_ready, *dv_staging):
    wg = lax.axis_index("wg")
    # dV leaves through the [dK; dQ] staging tiles when they have its dtype
    # (its store is read long before they are written again).
    dv_smem = out_smem if shared_staging else dv_staging[0]

    @pl.when(wg < _COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
      # This warpgroup's V half (its unit: T^T dU, dV) and K half (M0's and
      # dM1's rows, dQ's and dK's columns).
      mine = pl.ds(wg * _HALF, _HALF)
      layout = plgpu.Layout.WGMMA
      rows_layout, cols_layout = layout.reduce(1), layout.reduce(0)
      iota = lambda shape, axis: plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=layout)
      row_1d = plgpu.broadcasted_iota(jnp.int32, (_ROWS,), 0, layout=rows_layout)
      dk_rows = row_1d < L
      by_row = lambda x, cols=_HALF: lax.broadcast_in_dim(x, (_ROWS, cols), [0])
      by_col = lambda x: lax.broadcast_in_dim(x, (_ROWS, _ROWS), [1])
      # The [L, L] terms of d b and d beta are warpgroup 0's; warpgroup 1's
      # rows of them stay zero.
      zeros = plgpu.layout_cast(jnp.zeros((_ROWS,), _F32), rows_layout)
      for name in (DB_PAIRS, DBETA_PAIRS, DB_COLS):
        vectors_smem.at[wg, name][...] = zeros

      def step(t, carry):
        c_idx = first + t
        parity = lax.rem(t, 2)
        units = [lax.rem(_UNITS * t + h, slots) for h in range(_UNITS)]
        my_unit = lax.rem(_UNITS * t + wg, slots)
        tokens = pl.ds(c_idx * L, L)
        plgpu.barrier_wait(chunk_loaded.at[parity])
        b = plgpu.load(b_smem.at[parity], layout=rows_layout)      # [b; b]
        beta = plgpu.load(beta_smem.at[parity], layout=rows_layout)
        b_last = b_smem[parity, L - 1]
        eb = jnp.exp(b)

        # T^T dU for this warpgroup's V half (rows 0..L-1), written over the
        # rows of a1 that TMA left free; dV = beta T^T dU leaves from here.
        for slot in units:
          plgpu.barrier_wait(rows_loaded.at[slot])
        def form_dru(acc_ref):
          plgpu.wgmma(acc_ref, tt_smem.at[parity], du_smem.at[my_unit])
          return acc_ref[...]
        dru = pl.run_scoped(form_dru, plgpu.ACC((_ROWS, _HALF), _F32))
        # This warpgroup's stores of the last chunk read its staging tiles.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        dy = plgpu.load(a1_smem.at[my_unit], layout=layout)
        dk_half = iota((_ROWS, _HALF), 0) < L
        a1_smem.at[my_unit][...] = jnp.where(dk_half, dru, dy.astype(_F32)).astype(dtype)
        dv_smem.at[wg][...] = (by_row(beta) * dru).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dv_smem.at[wg, top], dv_gmem.at[bi, tokens, n, mine])
        del dru, dy
        plgpu.barrier_arrive(a1_ready)
        plgpu.barrier_wait(a1_ready)

        # The [L, L] blocks, split between the warpgroups: warpgroup 1 forms
        # Y = uv a1^T and hands it over; warpgroup 0 forms X = a1 uv^T,
        # Z2 = [K; Q] [K; Q]^T and from them A5 and the [L, L] terms of d b
        # and d beta.
        @pl.when(wg == 1)
        def _y():
          def form_y(y_ref):
            for slot in units:
              plgpu.wgmma(y_ref, uv_smem.at[slot], a1_smem.at[slot].transpose((1, 0)))
            return y_ref[...]
          # Rounded to the input dtype, as A5 is (it is only ever a term of A5).
          y_smem[...] = pl.run_scoped(form_y, plgpu.ACC((_ROWS, _ROWS), _F32)).astype(dtype)
          plgpu.commit_smem()
          plgpu.barrier_arrive(y_ready)

        @pl.when(wg == 0)
        def _pairs():
          def form_x_z2(x_ref, z2_ref):
            for slot in units:
              plgpu.wgmma(x_ref, a1_smem.at[slot], uv_smem.at[slot].transpose((1, 0)))
            plgpu.wgmma(z2_ref, kq_smem.at[parity], kq_smem.at[parity].transpose((1, 0)))
            return x_ref[...], z2_ref[...]
          x, z2 = pl.run_scoped(form_x_z2, *[plgpu.ACC((_ROWS, _ROWS), _F32)] * 2)
          # Token i = row mod L, token j = column mod L; rows < L are dK's,
          # columns < L multiply K. (Comparisons and `&` only: with boolean `~`
          # and `|` the Hopper lowering failed, converting an i1 vector.)
          r, c = iota((_ROWS, _ROWS), 0), iota((_ROWS, _ROWS), 1)
          diff = lax.rem(r, L) - lax.rem(c, L)                     # i - j
          b_cols = plgpu.load(b_smem.at[parity], layout=cols_layout)
          gap = by_row(b, _ROWS) - by_col(b_cols)                  # b_i - b_j
          # D_ij where i >= j, D_ji where j > i (never exponentiating a rise).
          decay = jnp.exp(jnp.where(diff >= 0, gap, -gap))
          beta_cols = plgpu.load(beta_smem.at[parity], layout=cols_layout)
          dk_left = (r < L) & (c < L)
          a_lower = dk_left & (diff > 0)                           # dA~ (dK rows, K cols)
          s = (r >= L) & (c < L) & (diff >= 0)                     # dS~ (dQ rows, K cols)
          # d beta through dV = beta T^T dU: the diagonal of X's (T^T dU) V^T.
          dbeta_v = jnp.sum(jnp.where((r < L) & (c >= L) & (diff == 0), x, 0.0), axis=1)
          plgpu.barrier_wait(y_ready)
          y = plgpu.load(y_smem, layout=layout).astype(_F32)
          a5 = decay * jnp.where(
              a_lower, -x * by_row(beta, _ROWS),
              jnp.where(dk_left & (diff < 0), -y * by_col(beta_cols),          # dA~^T
                        jnp.where((r < L) & (c >= L) & (diff <= 0), scale * y,   # dS~^T
                                  jnp.where(s, scale * x, 0.0))))
          a5_smem[...] = a5.astype(dtype)
          plgpu.commit_smem()
          plgpu.barrier_arrive(a5_ready)
          # d b through D (in A and S): p = (dA beta kk + dS qk) * D, rowsum -
          # colsum; d beta through A: rowsum(dA * D * kk).
          p = jnp.where(a_lower, a5 * z2, jnp.where(s, a5 * z2, 0.0))
          vectors_smem.at[wg, DB_PAIRS][...] = jnp.sum(p, axis=1)
          vectors_smem.at[wg, DB_COLS][...] = jnp.sum(p, axis=0)
          vectors_smem.at[wg, DBETA_PAIRS][...] = dbeta_v + jnp.sum(
              jnp.where(a_lower, -x * decay * z2, 0.0), axis=1)

        # The state products for this warpgroup's K half (M0's and dM1's rows).
        m_dot_dm = jnp.zeros((_ROWS,), _F32)
        for h in range(_UNITS):
          plgpu.barrier_wait(states_loaded.at[h])
          part = lambda ref: plgpu.load(ref.at[h, mine], layout=layout).astype(_F32)
          m_dot_dm += jnp.sum(part(m0_smem) * part(dm1_smem), axis=1)

        def state_products(p1_ref, p2_ref):
          for h, slot in enumerate(units):
            plgpu.wgmma(p1_ref, a1_smem.at[slot], m0_smem.at[h, mine].transpose((1, 0)))
            plgpu.wgmma(p2_ref, uv_smem.at[slot], dm1_smem.at[h, mine].transpose((1, 0)))
          return p1_ref[...], p2_ref[...]
        p1, p2 = pl.run_scoped(state_products, *[plgpu.ACC((_ROWS, _HALF), _F32)] * 2)
        for h, slot in enumerate(units):
          plgpu.barrier_arrive(states_free.at[h])
          plgpu.barrier_arrive(rows_free.at[slot])
        kq = plgpu.load(kq_smem.at[parity, :, mine], layout=layout).astype(_F32)  # [K; Q]
        r1 = jnp.where(dk_rows, -beta * eb, scale * eb)
        r2 = jnp.where(dk_rows, jnp.exp(b_last - b), 0.0)
        s1 = jnp.sum(p1 * kq, axis=1)
        s2 = jnp.where(dk_rows, jnp.sum(p2 * kq, axis=1), 0.0)
        z = by_row(r1) * p1 + by_row(r2) * jnp.where(by_row(dk_rows), p2, 0.0)
        del p1, p2, kq

        pl.when(wg == 1)(lambda: plgpu.barrier_wait(a5_ready))
        def pair_terms(acc_ref):
          plgpu.wgmma(acc_ref, a5_smem, kq_smem.at[parity, :, mine])
          return acc_ref[...]
        z += pl.run_scoped(pair_terms, plgpu.ACC((_ROWS, _HALF), _F32))
        plgpu.barrier_arrive(chunk_free.at[parity])

        if shared_staging:  # dV's store, issued at the top of the step, is read
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem.at[wg][...] = z.astype(out_smem.dtype)
        end_terms = r2 * s2
        vectors_smem.at[wg, DB][...] = r1 * s1 - end_terms
        vectors_smem.at[wg, DBETA][...] = jnp.where(dk_rows, -eb * s1, 0.0)
        vectors_smem.at[wg, END][...] = end_terms + jnp.exp(b_last) * m_dot_dm
        plgpu.commit_smem()
        mosaic.store_halves(out_smem.at[wg], dk_gmem.at[bi, tokens, n, mine],
                            dq_gmem.at[bi, tokens, n, mine], L)
        plgpu.copy_smem_to_gmem(vectors_smem.at[wg], vectors_gmem.at[bi, n, c_idx, wg])
        return carry

      lax.fori_loop(0, chunks_per_block, step, 0)
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

      @pl.loop(0, chunks_per_block)
      def _load(t):
        c_idx = first + t
        parity = lax.rem(t, 2)
        tokens = pl.ds(c_idx * L, L)
        slots_of = [lax.rem(_UNITS * t + h, slots) for h in range(_UNITS)]
        for h, slot in enumerate(slots_of):
          unit = _UNITS * t + h
          pl.when(unit >= slots)(lambda: plgpu.barrier_wait(rows_free.at[slot]))
          cols, done = pl.ds(h * _HALF, _HALF), rows_loaded.at[slot]
          plgpu.copy_gmem_to_smem(dy_gmem.at[bi, tokens, n, cols], a1_smem.at[slot, below],
                                  done)
          plgpu.copy_gmem_to_smem(u_gmem.at[bi, tokens, n, cols], uv_smem.at[slot, top], done)
          plgpu.copy_gmem_to_smem(v_gmem.at[bi, tokens, n, cols], uv_smem.at[slot, below],
                                  done)
          plgpu.copy_gmem_to_smem(du_gmem.at[bi, tokens, n, cols], du_smem.at[slot], done)
        pl.when(t >= 2)(lambda: plgpu.barrier_wait(chunk_free.at[parity]))
        done = chunk_loaded.at[parity]
        plgpu.copy_gmem_to_smem(k_gmem.at[bi, tokens, g], kq_smem.at[parity, top], done)
        plgpu.copy_gmem_to_smem(q_gmem.at[bi, tokens, g], kq_smem.at[parity, below], done)
        plgpu.copy_gmem_to_smem(tt_gmem.at[bi, n, tokens], tt_smem.at[parity, top], done)
        for ref, smem in ((b_gmem, b_smem), (beta_gmem, beta_smem)):
          mosaic.load_twice(ref.at[bi, n, tokens], smem.at[parity], done, L)
        for h in range(_UNITS):
          pl.when(t >= 1)(lambda: plgpu.barrier_wait(states_free.at[h]))
          cols, done = pl.ds(h * _HALF, _HALF), states_loaded.at[h]
          plgpu.copy_gmem_to_smem(states_gmem.at[bi, n, c_idx, :, cols], m0_smem.at[h], done)
          plgpu.copy_gmem_to_smem(dstates_gmem.at[bi, n, c_idx, :, cols], dm1_smem.at[h],
                                  done)

      mosaic.drain(rows_free, _UNITS * chunks_per_block, slots)
      mosaic.drain(states_free, _UNITS * chunks_per_block, _UNITS)
      mosaic.drain(chunk_free, chunks_per_block, 2)

  half = swizzled(dtype, _HALF)  # operands contracted over 64 V columns or 64 rows
  narrow = swizzled(dtype, L)    # T^T dU, contracted over the chunk's L tokens
  out_dtype = dq_gmem.dtype
  both = _COMPUTE_WGS
  dv_staging = [] if shared_staging else [
      plgpu.SMEM((both, _ROWS, _HALF), dtype, transforms=half)]  # [dV; *] by V half
  pl.run_scoped(
      scoped,
      plgpu.SMEM((slots, _ROWS, _HALF), dtype, transforms=half),      # [T^T dU; dY]
      plgpu.SMEM((slots, _ROWS, _HALF), dtype, transforms=half),      # [U; V]
      plgpu.SMEM((slots, L, _HALF), dtype, transforms=narrow),        # dU
      plgpu.SMEM((_UNITS, KEY, _HALF), dtype, transforms=half),       # M0
      plgpu.SMEM((_UNITS, KEY, _HALF), dtype, transforms=half),       # dM1
      plgpu.SMEM((2, _ROWS, KEY), dtype, transforms=half),            # [K; Q]
      plgpu.SMEM((2, _ROWS, L), dtype, transforms=narrow),            # [T^T; *]
      plgpu.SMEM((2, _ROWS), _F32),                                   # [b; b]
      plgpu.SMEM((2, _ROWS), _F32),                                   # [beta; beta]
      plgpu.SMEM((_ROWS, _ROWS), dtype),                              # Y, handed over
      plgpu.SMEM((_ROWS, _ROWS), dtype, transforms=half),             # A5
      plgpu.SMEM((both, _ROWS, _HALF), out_dtype,
                 transforms=swizzled(out_dtype, _HALF)),              # [dK; dQ] by K half
      plgpu.SMEM((both, len(_VECTORS), _ROWS), _F32),                 # the vectors
      plgpu.Barrier(num_arrivals=4, num_barriers=slots),   # a unit's four row loads
      plgpu.Barrier(num_arrivals=both, num_barriers=slots),
      plgpu.Barrier(num_arrivals=2, num_barriers=_UNITS),  # a unit's two state halves
      plgpu.Barrier(num_arrivals=both, num_barriers=_UNITS),
      plgpu.Barrier(num_arrivals=7, num_barriers=2),       # a chunk's seven loads
      plgpu.Barrier(num_arrivals=both, num_barriers=2),
      plgpu.Barrier(num_arrivals=both),                    # both halves of a1 written
      plgpu.Barrier(num_arrivals=1),                       # Y handed over
      plgpu.Barrier(num_arrivals=1),                       # A5 written
      *dv_staging,
      collective_axes="wg",
  )


def _smem_bytes(dtype, out_dtype, slots):
  """Shared memory of a block (the `run_scoped` allocations above, less barriers)."""
  item, out_item = jnp.dtype(dtype).itemsize, jnp.dtype(out_dtype).itemsize
  row_unit = (2 * _ROWS * _HALF + CHUNK * _HALF) * item
  states = _UNITS * 2 * KEY * _HALF * item
  per_chunk = (_ROWS * KEY + _ROWS * CHUNK) * item + 2 * _ROWS * 4
  # Y and A5, [dK; dQ] by half, [dV; *] by half unless it shares those, the vectors
  dv_staging = 0 if out_dtype == dtype else _ROWS * KEY * item
  staging = (2 * _ROWS * _ROWS * item + _ROWS * KEY * out_item + dv_staging
             + _COMPUTE_WGS * len(_VECTORS) * _ROWS * 4)
  return slots * row_unit + states + 2 * per_chunk + staging


def default_slots(dtype, out_dtype) -> int:
  """The deepest row ring that fits in shared memory, up to the tuned
  `configs.MosaicConfig.chunk_grads_slots` units."""
  deepest = configs.MosaicConfig().chunk_grads_slots
  fits = [s for s in range(_UNITS, deepest + 1)
          if _smem_bytes(dtype, out_dtype, s) <= mosaic.SMEM_BUDGET]
  return max(fits, default=_UNITS)  # chunk_grads' shared-memory check names a misfit


def chunk_grads(q, k, v, u, du, dy, tt, b, beta, states, dstates, *, scale: float,
                slots: int | None = None, splits: int | None = None,
                interpret: bool = False):
  """Every chunk's gradients after the reverse walk, on the Mosaic GPU kernel.

  Args:
    q, k: [B, T, G, K] (T a multiple of 32, K = 128), 16-bit.
    v, u, du, dy: [B, T, N, V] (V = 128): the values, the forward's U, the
      reverse walk's dU and the output's cotangent, in q's dtype.
    tt: [B, N, T, L] in q's dtype, each chunk's T^T (T = (I + A)^-1).
    b, beta: [B, N, T] float32, the chunk-local cumulative log-decay and beta.
    states, dstates: [B, N, C, K, V] in q's dtype, the state entering each
      chunk and the adjoint of the state leaving it.
    scale: the output scale.
    slots: units (V halves) of the ring of row tiles (default: the deepest
      that fits in shared memory, up to the tuned
      `configs.MosaicConfig.chunk_grads_slots`: two chunks, 4, when dQ and dK
      are in q's dtype, 2 when they are float32); the states' ring holds one
      chunk.
    splits: blocks per (batch, head), each a run of chunks (default: as many
      as fill the GPU's SMs once).
    interpret: run in Mosaic GPU interpret mode (the CPU).

  Returns:
    dQ, dK [B, T, N, K] (in q's dtype when N = G, else float32, to be summed
    over each group's heads), dV [B, T, N, V] in q's dtype, and d b, d beta
    [B, N, T] float32 (this step's shares: d b here is through the chunk-local
    cumulative log-decay).
  """
  batch, time, groups, key = q.shape
  heads, value = dy.shape[2:]
  rep = heads // groups
  out_dtype = q.dtype if rep == 1 else _F32
  if (why := limit(q.dtype, key, value, CHUNK)) is not None:
    raise ValueError(f"chunk_grads: {why}")
  slots = slots or default_slots(q.dtype, out_dtype)
  mosaic._check("chunk_grads", q.dtype, key, value, time, CHUNK, slots)
  mosaic.check_smem("chunk_grads", slots, _smem_bytes(q.dtype, out_dtype, slots))
  num_chunks = time // CHUNK
  splits = mosaic.runs_per_head("chunk_grads", batch, heads, num_chunks, splits)
  kernel = functools.partial(_kernel, groups_per_key=rep, chunks_per_block=num_chunks // splits,
                             slots=slots, scale=scale)
  grads = jax.ShapeDtypeStruct((batch, time, heads, key), out_dtype)
  out_type = (grads, grads, jax.ShapeDtypeStruct(dy.shape, q.dtype),
              jax.ShapeDtypeStruct((batch, heads, num_chunks, _COMPUTE_WGS, len(_VECTORS),
                                    _ROWS), _F32))
  dq, dk, dv, vectors = mosaic.launch(
      kernel, name="gated_delta_chunk_grads_mosaic", batch=batch, heads=heads,
      out_type=out_type, args=(q, k, v, u, du, dy, tt, b, beta, states, dstates),
      interpret=interpret, runs=splits, compute_wgs=_COMPUTE_WGS)
  # Token i's terms are in rows i (dK's) and L + i (dQ's), and column i.
  L = CHUNK
  vectors = vectors.sum(3)  # the compute warpgroups' shares
  at = lambda name: vectors[:, :, :, name]
  by_token = lambda name: at(name)[..., :L] + at(name)[..., L:]
  db = by_token(DB) + by_token(DB_PAIRS) - at(DB_COLS)[..., :L]
  db = db.at[..., L - 1].add(at(END).sum(-1))
  dbeta = at(DBETA)[..., :L] + at(DBETA_PAIRS)[..., :L]
  return dq, dk, dv, db.reshape(batch, heads, time), dbeta.reshape(batch, heads, time)
