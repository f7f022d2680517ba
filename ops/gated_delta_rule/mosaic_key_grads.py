"""Mosaic GPU (Hopper) key gradients of the gated delta rule: dQ and dK.

The key-gradient step is the op's largest memory stream: per chunk it reads
the state entering the chunk M0 and the adjoint of the state leaving it dM1
([K, V] each, 64 KB together in bf16 at K = V = 128) to form three [L, K]
products that reduce over V,

    dY M0^T,  (T^T dU) M0^T  and  U dM1^T,

and the Frobenius product <M0, dM1> (for d log-decay at the chunk's end).
The Triton kernel (`triton._key_grad_kernel`) does this and reads `T^T dU`
from the value-gradient kernel. Here one block
walks a run of chunks of one (batch, head), and a memory warpgroup streams
them through shared memory with TMA ahead of one compute warpgroup, in units
of half a chunk's V columns (the halves of M0, dM1, dY, dU and U: 44 KB); a
unit's slot is released once its state products are done, so the next
chunk's units load under the rest of this one (2 units by default, one chunk:
a third does not fit beside the other buffers). `T^T dU` is formed here, from
dU and the prepare kernel's T^T, so it never goes through memory.

The compute warpgroup works on 64-row tiles whose rows 0..L-1 belong to dQ and
rows L..2L-1 to dK (token i in rows i and L + i):

    P1 = [dY; T^T dU] M0^T        (per V half: [*; T^T] dU, its rows L..2L-1
                                   written under dY's, then one wgmma)
    P2 = [* ; U] dM1^T            (rows L..2L-1 only are read)
    Z  = r1 * P1 + r2 * P2 + A5 [Q; K]

with row scales r1 = [scale e^b; -beta e^b], r2 = [0; e^{b_L - b}], and
A5 = [[0, dS~], [dS~^T, dA~ + dA~^T]] the [2L, 2L] block of the chunk's
[L, L] adjoints (the decayed score adjoint dS~ and `A`'s dA~) that the
value-gradient kernel writes in this form for this kernel. Then Z's rows are
dQ and dK. The row sums that give d b and d beta,

    s1 = rowsum(P1 * [Q; K]),  s2 = rowsum(P2 * [Q; K]),

leave as three 64-entry vectors per chunk (d b and d beta by row, and the
terms of d b at the chunk's last token), folded by the caller.

Glossary: B batch, T time (a multiple of the chunk), N heads, G key groups,
K key size, V value size, C chunks, L tokens per chunk, WG warpgroup.
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
# configs.MosaicConfig's): one compute warpgroup and a memory warpgroup.
KEY = mosaic.KEY_SIZE           # the padded K = V the kernel is written for
_ROWS = 64                      # the wgmma rows: dQ's L rows, then dK's
_HALF = 64                      # V columns of a streamed unit
_UNITS = 2                      # units per chunk (V = 128)
_COMPUTE_REGISTERS = 232
_MEMORY_REGISTERS = 40
# Vectors per chunk in the `rows` output: d b by row, d beta by row, the d b
# terms of the chunk's last token.
DB, DBETA, END = range(3)


def _kernel(q_gmem, k_gmem, u_gmem, du_gmem, tt_gmem, dy_gmem, b_gmem, beta_gmem, pairs_gmem,
            states_gmem, dstates_gmem, dq_gmem, dk_gmem, rows_gmem, *, chunk,
            groups_per_key, chunks_per_block, slots, scale):
  L = chunk
  dtype = q_gmem.dtype
  bi, n = lax.axis_index("batch"), lax.axis_index("heads")
  first = lax.axis_index("split") * chunks_per_block
  g = lax.div(n, jnp.int32(groups_per_key))
  size = 2 * L  # the rows that carry tokens (the rest: padding at L = 16)

  def scoped(a1_smem, du_smem, a2_smem, m0_smem, dm1_smem, qk_smem, pairs_smem, tt_smem,
             b_smem, beta_smem, out_smem, rows_smem, unit_loaded, unit_free, chunk_loaded,
             chunk_free):
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _compute():
      plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
      wgmma_layout = plgpu.Layout.WGMMA
      rows_layout = wgmma_layout.reduce(1)
      row = plgpu.broadcasted_iota(jnp.int32, (_ROWS,), 0, layout=rows_layout)
      dq_rows, dk_rows = row < L, (row >= L) & (row < size)
      dq_rows_2d = plgpu.broadcasted_iota(jnp.int32, (_ROWS, _HALF), 0,
                                          layout=wgmma_layout) < L
      by_row = lambda x: lax.broadcast_in_dim(x, (_ROWS, KEY), [0])

      def step(t, carry):
        c = first + t
        parity = lax.rem(t, 2)
        units = [lax.rem(_UNITS * t + h, slots) for h in range(_UNITS)]

        plgpu.barrier_wait(chunk_loaded.at[parity])

        def products(p1_ref, p2_ref):
          for slot in units:
            plgpu.barrier_wait(unit_loaded.at[slot])
            # T^T dU for this unit's V columns, in rows L..2L-1 (T^T's rows).
            def form_dru(acc_ref):
              plgpu.wgmma(acc_ref, tt_smem.at[parity], du_smem.at[slot])
              return acc_ref[...]
            dru = pl.run_scoped(form_dru, plgpu.ACC((_ROWS, _HALF), _F32))
            # [dY; T^T dU] back into dY's tile: the wgmma's A operand.
            dy = plgpu.load(a1_smem.at[slot], layout=wgmma_layout)
            a1_smem.at[slot][...] = jnp.where(dq_rows_2d, dy.astype(_F32), dru).astype(dtype)
            plgpu.commit_smem()
            plgpu.wgmma(p1_ref, a1_smem.at[slot], m0_smem.at[slot].transpose((1, 0)))
            plgpu.wgmma(p2_ref, a2_smem.at[slot], dm1_smem.at[slot].transpose((1, 0)))
          # <M0, dM1> by row of M0 (rows r and 64 + r summed), under the wgmmas.
          m_dot_dm = jnp.zeros((_ROWS,), _F32)
          for slot in units:
            for top in range(0, KEY, _ROWS):
              part = lambda ref: plgpu.load(ref.at[slot, pl.ds(top, _ROWS)],
                                            layout=wgmma_layout).astype(_F32)
              m_dot_dm += jnp.sum(part(m0_smem) * part(dm1_smem), axis=1)
          return p1_ref[...], p2_ref[...], m_dot_dm
        p1, p2, m_dot_dm = pl.run_scoped(
            products, plgpu.ACC((_ROWS, KEY), _F32), plgpu.ACC((_ROWS, KEY), _F32))
        for slot in units:
          plgpu.barrier_arrive(unit_free.at[slot])

        valid = row < size
        b = jnp.where(valid, plgpu.load(b_smem.at[parity], layout=rows_layout), 0.0)
        beta = jnp.where(valid, plgpu.load(beta_smem.at[parity], layout=rows_layout), 0.0)
        b_last = b_smem[parity, L - 1]
        eb, e_end = jnp.exp(b), jnp.exp(b_last - b)
        r1 = jnp.where(dq_rows, scale * eb, -beta * eb)
        r2 = jnp.where(dk_rows, e_end, 0.0)
        qk = plgpu.load(qk_smem.at[parity], layout=wgmma_layout).astype(_F32)
        s1 = jnp.where(valid, jnp.sum(p1 * qk, axis=1), 0.0)
        s2 = jnp.where(dk_rows, jnp.sum(jnp.where(by_row(dk_rows), p2, 0.0) * qk, axis=1), 0.0)
        z = by_row(r1) * p1 + jnp.where(by_row(dk_rows), by_row(r2) * p2, 0.0)

        def pair_terms(acc_ref):
          plgpu.wgmma(acc_ref, pairs_smem.at[parity], qk_smem.at[parity, pl.ds(0, size)])
          return acc_ref[...]
        # (A zero accumulator and an add: interpret mode runs no ACC.init.)
        z += pl.run_scoped(pair_terms, plgpu.ACC((_ROWS, KEY), _F32))
        plgpu.barrier_arrive(chunk_free.at[parity])

        # The last chunk's stores read these buffers: done with them first.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[...] = z.astype(out_smem.dtype)
        end_terms = r2 * s2
        rows_smem.at[DB][...] = r1 * s1 - end_terms
        rows_smem.at[DBETA][...] = jnp.where(dk_rows, -eb * s1, 0.0)
        rows_smem.at[END][...] = end_terms + jnp.exp(b_last) * m_dot_dm
        plgpu.commit_smem()
        tokens = pl.ds(c * L, L)
        mosaic.store_halves(out_smem, dq_gmem.at[bi, tokens, n], dk_gmem.at[bi, tokens, n], L)
        plgpu.copy_smem_to_gmem(rows_smem, rows_gmem.at[bi, n, c])
        return carry

      lax.fori_loop(0, chunks_per_block, step, 0)
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
      plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

      @pl.loop(0, chunks_per_block)
      def _load(t):
        c = first + t
        parity = lax.rem(t, 2)
        tokens, top, below = pl.ds(c * L, L), pl.ds(0, L), pl.ds(L, L)
        for h in range(_UNITS):
          unit = _UNITS * t + h
          slot = lax.rem(unit, slots)
          pl.when(unit >= slots)(lambda: plgpu.barrier_wait(unit_free.at[slot]))
          cols, done = pl.ds(h * _HALF, _HALF), unit_loaded.at[slot]
          plgpu.copy_gmem_to_smem(dy_gmem.at[bi, tokens, n, cols], a1_smem.at[slot, top], done)
          plgpu.copy_gmem_to_smem(du_gmem.at[bi, tokens, n, cols], du_smem.at[slot], done)
          plgpu.copy_gmem_to_smem(u_gmem.at[bi, tokens, n, cols], a2_smem.at[slot, below], done)
          plgpu.copy_gmem_to_smem(states_gmem.at[bi, n, c, :, cols], m0_smem.at[slot], done)
          plgpu.copy_gmem_to_smem(dstates_gmem.at[bi, n, c, :, cols], dm1_smem.at[slot], done)
        pl.when(t >= 2)(lambda: plgpu.barrier_wait(chunk_free.at[parity]))
        done = chunk_loaded.at[parity]
        plgpu.copy_gmem_to_smem(q_gmem.at[bi, tokens, g], qk_smem.at[parity, top], done)
        plgpu.copy_gmem_to_smem(k_gmem.at[bi, tokens, g], qk_smem.at[parity, below], done)
        plgpu.copy_gmem_to_smem(pairs_gmem.at[bi, n, c], pairs_smem.at[parity, pl.ds(0, size)],
                                done)
        plgpu.copy_gmem_to_smem(tt_gmem.at[bi, n, tokens], tt_smem.at[parity, below], done)
        for ref, smem in ((b_gmem, b_smem), (beta_gmem, beta_smem)):
          mosaic.load_twice(ref.at[bi, n, tokens], smem.at[parity], done, L)

      mosaic.drain(unit_free, _UNITS * chunks_per_block, slots)
      mosaic.drain(chunk_free, chunks_per_block, 2)

  half = swizzled(dtype, _HALF)  # operands contracted over a unit's 64 V columns
  pairs = swizzled(dtype, size)  # A5 [Q; K], contracted over the chunk's 2L tokens
  narrow = swizzled(dtype, L)    # T^T dU, contracted over the chunk's L tokens
  out_dtype = dq_gmem.dtype
  pl.run_scoped(
      scoped,
      plgpu.SMEM((slots, _ROWS, _HALF), dtype, transforms=half),      # [dY; *], [dY; T^T dU]
      plgpu.SMEM((slots, L, _HALF), dtype, transforms=narrow),        # dU
      plgpu.SMEM((slots, _ROWS, _HALF), dtype, transforms=half),      # [*; U]
      plgpu.SMEM((slots, KEY, _HALF), dtype, transforms=half),        # M0
      plgpu.SMEM((slots, KEY, _HALF), dtype, transforms=half),        # dM1
      plgpu.SMEM((2, _ROWS, KEY), dtype, transforms=pairs),           # [Q; K], padded
      plgpu.SMEM((2, _ROWS, size), dtype, transforms=pairs),          # A5, padded
      plgpu.SMEM((2, _ROWS, L), dtype, transforms=narrow),            # [*; T^T]
      plgpu.SMEM((2, _ROWS), _F32),                                   # [b; b]
      plgpu.SMEM((2, _ROWS), _F32),                                   # [beta; beta]
      plgpu.SMEM((_ROWS, KEY), out_dtype, transforms=swizzled(out_dtype, KEY)),  # [dQ; dK]
      plgpu.SMEM((3, _ROWS), _F32),                                   # the row vectors
      plgpu.Barrier(num_arrivals=5, num_barriers=slots),   # a unit's five loads
      plgpu.Barrier(num_arrivals=1, num_barriers=slots),   # unit released
      plgpu.Barrier(num_arrivals=8, num_barriers=2),       # a chunk's eight loads
      plgpu.Barrier(num_arrivals=1, num_barriers=2),       # chunk released
      collective_axes="wg",
  )



def _smem_bytes(dtype, out_dtype, chunk, slots):
  """Shared memory of a block (the `run_scoped` allocations below, less barriers)."""
  item, out_item = jnp.dtype(dtype).itemsize, jnp.dtype(out_dtype).itemsize
  unit = (2 * _ROWS * _HALF + chunk * _HALF + 2 * KEY * _HALF) * item
  per_chunk = (_ROWS * KEY + _ROWS * 2 * chunk + _ROWS * chunk) * item + 2 * _ROWS * 4
  return slots * unit + 2 * per_chunk + _ROWS * KEY * out_item + 3 * _ROWS * 4


def key_grads(q, k, u, du, tt, dy, b, beta, pairs, states, dstates, *, chunk: int,
              scale: float, slots: int | None = None, splits: int | None = None,
              interpret: bool = False):
  """dQ, dK and the key gradients' shares of d log-decay and d beta.

  Args:
    q, k: [B, T, G, K] (T a multiple of `chunk`, K = 128), 16-bit.
    u, du, dy: [B, T, N, V] (V = 128): the forward's U, the reverse walk's dU
      and the output's cotangent, in q's dtype.
    tt: [B, N, T, L] in q's dtype, each chunk's T^T (T = (I + A)^-1).
    b, beta: [B, N, T] float32, the chunk-local cumulative log-decay and beta.
    pairs: [B, N, C, 2L, 2L] in q's dtype, each chunk's
      [[0, dS~], [dS~^T, dA~ + dA~^T]] (the value-gradient kernel's).
    states, dstates: [B, N, C, K, V] in q's dtype, the state entering each
      chunk and the adjoint of the state leaving it.
    chunk, scale: the chunk (16 to 32 tokens) and the output scale.
    slots: shared-memory units of the input ring (default: the tuned
      `configs.MosaicConfig.key_grads_slots`; 2 fill most of it).
    splits: blocks per (batch, head), each a run of chunks (default: as many
      as fill the GPU's SMs once).
    interpret: run in Mosaic GPU interpret mode (the CPU).

  Returns:
    dQ, dK [B, T, N, K] (in q's dtype when N = G, else float32, to be summed
    over each group's heads), and the d b and d beta shares [1, B, N, T]
    float32.
  """
  batch, time, groups, key = q.shape
  heads, value = dy.shape[2:]
  rep = heads // groups
  out_dtype = q.dtype if rep == 1 else _F32
  slots = slots or configs.MosaicConfig().key_grads_slots
  mosaic._check("key_grads", q.dtype, key, value, time, chunk, slots)
  mosaic.check_smem("key_grads", slots, _smem_bytes(q.dtype, out_dtype, chunk, slots))
  num_chunks = time // chunk
  splits = mosaic.runs_per_head("key_grads", batch, heads, num_chunks, splits)
  kernel = functools.partial(_kernel, chunk=chunk, groups_per_key=rep,
                             chunks_per_block=num_chunks // splits, slots=slots,
                             scale=scale)
  grads = jax.ShapeDtypeStruct((batch, time, heads, key), out_dtype)
  out_type = (grads, grads, jax.ShapeDtypeStruct((batch, heads, num_chunks, 3, _ROWS), _F32))
  dq, dk, rows = mosaic.launch(
      kernel, name="gated_delta_key_grads_mosaic", batch=batch, heads=heads,
      out_type=out_type, args=(q, k, u, du, tt, dy, b, beta, pairs, states, dstates),
      interpret=interpret, runs=splits, compute_wgs=1)
  # Token i's terms are in rows i (dQ's) and L + i (dK's) of each chunk.
  L = chunk
  db = rows[:, :, :, DB, :L] + rows[:, :, :, DB, L:2 * L]
  db = db.at[:, :, :, L - 1].add(rows[:, :, :, END].sum(-1))
  dbeta = rows[:, :, :, DBETA, L:2 * L]
  return dq, dk, db.reshape(1, batch, heads, time), dbeta.reshape(1, batch, heads, time)
