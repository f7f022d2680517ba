"""Triton kernels for the gated delta rule, forward and backward.

The chunked WY / UT form of xla.py, split so that the [L, L] matrices (the
decays, `A`, its inverse `T`, the scores) are formed on chip and only the
per-token `W`, `U~`, the chunk-boundary states and, for the backward, `T^T`
and the scores go through memory. With `b` the chunk-local cumulative log-decay,
`D_ij = exp(b_i - b_j)` (i >= j):

Forward, three launches:
1. `prepare` (parallel over chunks): `A = strict_lower(beta_i D_ij k_i.k_j)`,
   `T = (I + A)^-1` by forward substitution in registers inside 16-row
   diagonal blocks, merged by tile products, `W = T (beta e^b K)`,
   `U~ = T (beta V)`, written in the input dtype (and `T^T` too, when a
   gradient will be taken: every product that reads it rounds it to that).
2. `states` (one program per batch, head and V tile; V columns of the state
   evolve independently): per chunk `U = U~ - W M0`,
   `M <- e^{b_L} M0 + (K e^{b_L - b})^T U`; writes the state entering each
   chunk and `U` (the backward keeps `U`, not `U~`).
3. `output` (parallel over chunks; a loop over V tiles):
   `Y = scale (e^b (Q M0) + S U)` with the scores `S = (Q K^T) * D`. When a
   gradient will be taken it stores `S` (transposed).

Backward, three launches:
1. `states_bwd`, reversed (per batch, head, V tile): with `dU = scale S^T dY +
   K~ dM1`, `dM0 = scale (Q e^b)^T dY + e^{b_L} dM1 - W^T dU`; writes the
   adjoint of the state leaving each chunk (its end is d initial_state) and
   each chunk's `dU`.
2. `value_grads` (parallel over chunks; a loop over V tiles): dV, `T^T dU`,
   and the [L, L] adjoints of the scores and of `A` (the gradient through the
   inverse, `dA = -T^T dT T^T`, is `-(T^T dU) U^T`: see the kernel), from the
   stored `T^T`, `U` and `dU`; no state. With `pairs` it writes its two
   [L, L] adjoints as one [2L, 2L] block, the Mosaic key-gradient kernel's
   operand.
3. `key_grads` (parallel over chunks and K tiles; a loop over V tiles
   accumulates the products with the states M0 and dM1 that reduce over V):
   dQ and dK. Both gradient kernels add shares of d b and d beta.
`pallas.py` puts them, and the Mosaic GPU kernels that replace some of them,
under one custom VJP.

Glossary of shapes: B batch, T time, N heads, G query/key groups, K key size,
V value size, C chunks, L tokens per chunk.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import _backend
from ops import _pallas
from ops._rows import pick_row
from ops._triton import causal_decay
from ops._triton import dot
from ops.ssd import varlen

_F32 = jnp.float32


def _mm(a, b, dtype, *, trans_a=False, trans_b=False):
  """Tile product with both operands rounded to `dtype`, float32 accumulation."""
  a, b = a.astype(dtype), b.astype(dtype)
  if _backend.pallas_interpret():
    # XLA:CPU has no 16-bit x 16-bit -> float32 dot; the rounding stays the same.
    a, b = a.astype(_F32), b.astype(_F32)
  return dot(a, b, trans_a=trans_a, trans_b=trans_b)


def _masks(chunk):
  row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
  return row, col


def _unit_lower_inverse(a, chunk, block=None):
  """`(I + a)^-1` for a strictly lower-triangular [L, L] float32 `a`.

  Forward substitution inside the diagonal blocks of `block` rows (all L rows
  when None), one row of every block per step: `T_i = e_i - sum_{j<i} a_ij T_j`
  (rows j >= i of T are still identity rows then, and a_ij = 0 there). The
  blocks' rows share each step: with `a` and `T` block diagonal, one masked
  reduction picks row j of every block and one product forms all their new
  rows. Then pairs of blocks merge, doubling in size, by
  `T <- T - T C T` with C the lower off-diagonal block of each pair (exact:
  `C T C = 0` inside a pair), two [L, L] tile products per merge on the tensor
  cores in three-pass TF32 (about float32's precision): fewer serial steps
  than the substitution over all L rows, with the same errors (BUILD_NOTES.md,
  "SSD and the gated delta rule").
  """
  block = chunk if block is None else block
  row, col = _masks(chunk)
  eye = (row == col).astype(_F32)
  same = (row // block) == (col // block)
  a_blocks = jnp.where(same, a, 0.0)

  def body(j, t):
    pick = (row % block) == j
    a_j = jnp.sum(jnp.where(pick, a_blocks, 0.0), axis=0)       # [L]: row j of each block
    new = jnp.sum(a_j[:, None] * t, axis=0)                      # [L]: those rows of A T
    return jnp.where(pick & same, eye - new[None, :], t)

  t = jax.lax.fori_loop(1, block, body, eye)
  size = block
  while size < chunk:
    pair = (row // (2 * size)) == (col // (2 * size))
    c = jnp.where(pair & ((row // size) != (col // size)), a, 0.0)
    t = t - _f32_mm(_f32_mm(t, c), t)
    size *= 2
  return t


def _f32_mm(a, b):
  """A float32 tile product at about float32's precision on the tensor cores."""
  if _backend.pallas_interpret():
    return dot(a, b)
  return plgpu.dot(a, b, precision=jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)


def _wy_matrix(kk, decay, beta, chunk):
  """A = strict_lower(beta_i D_ij k_i.k_j) [L, L] float32, from k.k^T and D."""
  row, col = _masks(chunk)
  return jnp.where(row > col, beta[:, None] * decay * kk, 0.0)


def _wy_inverse(k, b, beta, chunk, inverse_block):
  """T = (I + A)^-1 [L, L] float32."""
  kk = _mm(k, k, k.dtype, trans_b=True)
  a = _wy_matrix(kk, causal_decay(b, chunk), beta, chunk)
  return _unit_lower_inverse(a, chunk, inverse_block)


def _prepare_kernel(k_ref, v_ref, b_ref, beta_ref, w_ref, u_ref, *t_ref, chunk,
                    inverse_block):
  """W and U~ of one chunk (and T^T, T = (I + A)^-1, for the backward, if asked:
  transposed, the operand both gradient kernels multiply by)."""
  k, v = k_ref[...], v_ref[...]
  b, beta = b_ref[...], beta_ref[...]
  dtype = v.dtype
  t = _wy_inverse(k, b, beta, chunk, inverse_block)
  rw = (beta * jnp.exp(b))[:, None] * k.astype(_F32)             # [L, K]
  ru = beta[:, None] * v.astype(_F32)                            # [L, V]
  w_ref[...] = _mm(t, rw, dtype).astype(w_ref.dtype)
  u_ref[...] = _mm(t, ru, dtype).astype(u_ref.dtype)
  if t_ref:
    t_ref[0][...] = t.T.astype(t_ref[0].dtype)


def _states_kernel(k_ref, w_ref, u_tilde_ref, b_ref, h0_ref, *refs, chunk, num_chunks,
                   packed):
  """Forward state walk, one [K, bv] tile of M per program. Stores the state
  entering each chunk and the corrected values U that its chain forms anyway
  (so the output kernel reads U, not W and U~, and skips the `W M0` product).
  `packed` (`ops/ssd/varlen.py`): h0 and the final state hold one tile per
  sequence, inputs (starts, ends) [C] follow h0, and each sequence's chunks
  start from its tile."""
  starts_ref, ends_ref, out_ref, u_ref, final_ref = (refs if packed else
                                                     (None, None) + refs)
  dtype = u_tilde_ref.dtype

  def body(c, h):
    if packed:
      h = varlen.enter(starts_ref, h0_ref, c, h)
    out_ref[c] = h.astype(out_ref.dtype)
    rows = pl.ds(c * chunk, chunk)
    k, w, u_t = k_ref[rows, :], w_ref[rows, :], u_tilde_ref[rows, :]
    b = b_ref[rows]
    b_last = pick_row(b, chunk - 1)
    u = (u_t.astype(_F32) - _mm(w, h, dtype)).astype(dtype)      # [L, bv]
    u_ref[rows, :] = u  # every product that reads U rounds it to `dtype` first
    k_end = jnp.exp(b_last - b)[:, None] * k.astype(_F32)       # [L, K]
    h = jnp.exp(b_last) * h + _mm(k_end, u, dtype, trans_a=True)
    if packed:
      varlen.leave(ends_ref, final_ref, c, h)
    return h

  if packed:  # the first chunk restarts the walk
    jax.lax.fori_loop(0, num_chunks, body, jnp.zeros(h0_ref.shape[1:], _F32))
  else:
    final_ref[...] = jax.lax.fori_loop(0, num_chunks, body, h0_ref[...].astype(_F32))


def _output_kernel(q_ref, k_ref, u_ref, b_ref, h_ref, y_ref, *scores_t_ref, chunk, scale,
                   block_v):
  """One chunk: the [L, L] scores once, then the V columns a tile at a time.
  If asked, stores the scores (for the backward's state walk)."""
  q, k = q_ref[...], k_ref[...]
  dtype = u_ref.dtype
  b = b_ref[...]
  scores = _mm(q, k, dtype, trans_b=True) * causal_decay(b, chunk)
  if scores_t_ref:  # transposed: the backward's walk multiplies by S^T
    scores_t_ref[0][...] = scores.T.astype(scores_t_ref[0].dtype)
  eb = jnp.exp(b)[:, None]

  def tile(e, carry):
    cols = pl.ds(e * block_v, block_v)
    h, u = h_ref[:, cols], u_ref[:, cols]                        # [K, bv], [L, bv]
    y = eb * _mm(q, h, dtype) + _mm(scores, u, dtype)
    y_ref[:, cols] = (scale * y).astype(y_ref.dtype)
    return carry

  jax.lax.fori_loop(0, y_ref.shape[-1] // block_v, tile, 0)


def _states_bwd_kernel(q_ref, k_ref, w_ref, dy_ref, b_ref, scores_ref, dfinal_ref, *refs,
                       chunk, num_chunks, scale, packed):
  """Backward state walk: the adjoint of M, one [K, bv] tile per program. The
  chunks' [L, L] scores come from the forward's output kernel, which keeps
  their product and exponentials off this serial chain. The walk forms each
  chunk's dU on the way and stores it for the chunk gradients (in `dtype`:
  every product there rounds it to that). `packed`: as the forward walk's,
  the final states' adjoints entering at the sequences' last chunks and the
  initial states' leaving at their first."""
  starts_ref, ends_ref, out_ref, du_ref, dh0_ref = (refs if packed else
                                                    (None, None) + refs)
  dtype = dy_ref.dtype

  def body(step, g):
    c = num_chunks - 1 - step
    if packed:
      g = varlen.enter(ends_ref, dfinal_ref, c, g)
    out_ref[c] = g.astype(out_ref.dtype)
    rows = pl.ds(c * chunk, chunk)
    q, k, w, dy = q_ref[rows, :], k_ref[rows, :], w_ref[rows, :], dy_ref[rows, :]
    b = b_ref[rows]
    b_last = pick_row(b, chunk - 1)
    scores_t = scores_ref[rows, :]                               # [L, L]: S^T
    k_end = jnp.exp(b_last - b)[:, None] * k.astype(_F32)
    du = scale * _mm(scores_t, dy, dtype) + _mm(k_end, g, dtype)
    du_ref[rows, :] = du.astype(du_ref.dtype)
    q_in = jnp.exp(b)[:, None] * q.astype(_F32)
    g = (scale * _mm(q_in, dy, dtype, trans_a=True) + jnp.exp(b_last) * g
         - _mm(w, du, dtype, trans_a=True))
    if packed:
      varlen.leave(starts_ref, dh0_ref, c, g)
    return g

  if packed:  # the last chunk restarts the walk
    jax.lax.fori_loop(0, num_chunks, body, jnp.zeros(dfinal_ref.shape[1:], _F32))
  else:
    dh0_ref[...] = jax.lax.fori_loop(0, num_chunks, body, dfinal_ref[...].astype(_F32))


def _value_grad_kernel(q_ref, k_ref, v_ref, u_ref, du_ref, dy_ref, b_ref, beta_ref, tt_ref,
                       dv_ref, *outs, chunk, scale, block_v, pairs):
  """One chunk's gradients that need no state: dV, and the [L, L] adjoints of
  the scores and of `A` that the key-gradient kernel multiplies into dQ and
  dK. The V columns are visited a tile at a time; `dY U^T` and
  `(T^T dU) U^T` accumulate across the tiles. `outs`: `T^T dU` (the adjoint of `R_u`,
  rounded to `dtype` like every product that reads it) and the two adjoints
  (dS~, dA~) each [L, L], for the Triton key-gradient kernel; or with `pairs`
  one [2L, 2L] block `[[0, dS~], [dS~^T, dA~ + dA~^T]]` for the Mosaic one
  (which forms `T^T dU` itself); then this kernel's shares of d b and d beta."""
  *squares, db_ref, dbeta_ref = outs
  dru_ref = None if pairs else squares.pop(0)
  q, k = q_ref[...], k_ref[...]
  dtype = v_ref.dtype
  b, beta = b_ref[...], beta_ref[...]
  row, col = _masks(chunk)
  t_t_in = tt_ref[...]  # T^T = ((I + A)^-1)^T, rounded to dtype (as _mm would)

  def tile(e, acc):
    # Through Y = scale (e^b Q M0 + S U) and U~ = T R_u.
    dy_dot_u, dru_dot_u, dbeta_v = acc
    cols = pl.ds(e * block_v, block_v)
    dy, vf = dy_ref[:, cols], v_ref[:, cols].astype(_F32)        # [L, bv]
    u, du = u_ref[:, cols], du_ref[:, cols]                      # [L, bv]
    dru = _mm(t_t_in, du, dtype)                                 # T^T dU
    dv_ref[:, cols] = (beta[:, None] * dru).astype(dv_ref.dtype)
    if dru_ref is not None:
      dru_ref[:, cols] = dru.astype(dru_ref.dtype)
    return (dy_dot_u + _mm(dy, u, dtype, trans_b=True),
            dru_dot_u + _mm(dru, u, dtype, trans_b=True),
            dbeta_v + jnp.sum(dru * vf, axis=1))

  square = jnp.zeros((chunk, chunk), _F32)
  dy_dot_u, dru_dot_u, dbeta_v = jax.lax.fori_loop(
      0, v_ref.shape[-1] // block_v, tile, (square, square, jnp.zeros((chunk,), _F32)))
  decay = causal_decay(b, chunk)
  kk = _mm(k, k, dtype, trans_b=True)
  qk = _mm(q, k, dtype, trans_b=True)
  ds = jnp.where(row >= col, scale * dy_dot_u, 0.0)              # [L, L]
  # Through T = (I + A)^-1. With dW = -dU M0^T, dT = dW R_w^T + dU R_u^T =
  # dU (R_u - R_w M0)^T = dU ((I + A) U)^T (R_w = (I + A) W, R_u = (I + A) U~,
  # U = U~ - W M0), so dA = -T^T dT T^T = -(T^T dU) U^T: no product with the
  # inverse's own chain, and no [L, K] products here.
  da = jnp.where(row > col, -dru_dot_u, 0.0)
  # Both are read only as operands rounded to `dtype`, so they are stored so.
  dsd, dkk = ds * decay, da * beta[:, None] * decay
  if pairs:
    top, below = pl.ds(0, chunk), pl.ds(chunk, chunk)
    block = squares[0]
    block[top, top] = jnp.zeros((chunk, chunk), block.dtype)
    block[top, below] = dsd.astype(block.dtype)
    block[below, top] = dsd.T.astype(block.dtype)
    block[below, below] = (dkk + dkk.T).astype(block.dtype)
  else:
    squares[0][...] = dsd.astype(squares[0].dtype)
    squares[1][...] = dkk.astype(squares[1].dtype)
  # d b through D (in A and S); d beta through A and R_u.
  p = (da * beta[:, None] * kk + ds * qk) * decay
  db_ref[...] = jnp.sum(p, axis=1) - jnp.sum(p, axis=0)
  dbeta_ref[...] = dbeta_v + jnp.sum(da * decay * kk, axis=1)


def _key_grad_kernel(q_ref, k_ref, u_ref, dru_ref, dy_ref, b_ref, beta_ref, dsd_ref,
                     dkk_ref, h_ref, dh_ref, dq_ref, dk_ref, db_ref, dbeta_ref, *, chunk,
                     scale, block_v):
  """One chunk's dQ and dK on `bk` key columns, and their shares of d b and
  d beta. The V columns are visited a tile at a time, so at most a [bk, bv]
  tile of the state M0 and of its adjoint dM1 is in registers; the three
  [L, bk] products that reduce over V accumulate across the tiles."""
  q, k = q_ref[...], k_ref[...]                                  # [L, bk]
  dtype = u_ref.dtype
  b, beta = b_ref[...], beta_ref[...]
  b_last = pick_row(b, chunk - 1)
  eb = jnp.exp(b)
  e_end = jnp.exp(b_last - b)

  def tile(e, acc):
    # Through Y (e^b Q M0), M1 = e^{b_L} M0 + K~^T U and W = T R_w (dW = -dU M0^T).
    drw, dk_end, dy_dot_m0, m_dot_dm = acc
    cols = pl.ds(e * block_v, block_v)
    m0, dm1 = h_ref[:, cols], dh_ref[:, cols]                    # [bk, bv]
    dy, u, dru = dy_ref[:, cols], u_ref[:, cols], dru_ref[:, cols]  # [L, bv]
    return (drw - _mm(dru, m0, dtype, trans_b=True),
            dk_end + _mm(u, dm1, dtype, trans_b=True),
            dy_dot_m0 + _mm(dy, m0, dtype, trans_b=True),
            m_dot_dm + jnp.sum(dm1.astype(_F32) * m0.astype(_F32), axis=1))

  keys = jnp.zeros(k.shape, _F32)
  drw, dk_end, dy_dot_m0, m_dot_dm = jax.lax.fori_loop(
      0, u_ref.shape[-1] // block_v, tile,
      (keys, keys, keys, jnp.zeros((k.shape[1],), _F32)))
  qf, kf = q.astype(_F32), k.astype(_F32)
  dsd, dkk = dsd_ref[...], dkk_ref[...]
  dq_inter = scale * eb[:, None] * dy_dot_m0
  dq = dq_inter + _mm(dsd, k, dtype)
  dk = _mm(dsd, q, dtype, trans_a=True) + e_end[:, None] * dk_end
  beta_eb = (beta * eb)[:, None]
  rw = beta_eb * kf
  dk += beta_eb * drw
  dk += _mm(dkk, k, dtype) + _mm(dkk, k, dtype, trans_a=True)
  # d b through e^b (in Y and R_w), e^{b_L - b} and e^{b_L}.
  db = jnp.sum(dq_inter * qf, axis=1) + jnp.sum(drw * rw, axis=1)
  end_terms = jnp.sum(dk_end * (e_end[:, None] * kf), axis=1)     # [L]
  db -= end_terms
  end = jnp.sum(end_terms) + jnp.exp(b_last) * jnp.sum(m_dot_dm)
  idx = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  db_ref[...] = db + jnp.where(idx == chunk - 1, end, 0.0)
  dbeta_ref[...] = jnp.sum(drw * eb[:, None] * kf, axis=1)
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)


def _params(num_warps, num_stages):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _specs(chunk, key, rep):
  """BlockSpecs of one chunk on grid (batch, head, chunk, ...): `qk` (q/k rows
  of the head's group), `vec` (b, beta), `head(size)` (a head's [L, size] rows)
  and `square` (a chunk's [L, L] matrix in a [B, N, T, L] array). All but `qk`
  ignore grid axes after the chunk's (the key-gradient kernel's key tiles)."""
  return dict(
      qk=pl.BlockSpec((None, chunk, None, key), lambda i, n, c: (i, c, n // rep, 0)),
      vec=pl.BlockSpec((None, None, chunk), lambda i, n, c, *_: (i, n, c)),
      head=lambda size: pl.BlockSpec((None, chunk, None, size),
                                     lambda i, n, c, *_: (i, c, n, 0)),
      square=pl.BlockSpec((None, None, chunk, chunk), lambda i, n, c, *_: (i, n, c, 0)))


def prepare(k, v, b, beta, blocks, *, save_inverse):
  """(W, U~) and, with `save_inverse`, T^T [B, N, T, L], all in the input dtype."""
  batch, time, groups, key = k.shape
  heads, value = v.shape[2:]
  chunk = blocks.chunk
  sp = _specs(chunk, key, heads // groups)
  head = sp["head"]
  out_specs = [head(key), head(value)]
  out_shape = [jax.ShapeDtypeStruct((batch, time, heads, key), v.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype)]
  if save_inverse:
    out_specs.append(sp["square"])
    out_shape.append(jax.ShapeDtypeStruct((batch, heads, time, chunk), v.dtype))
  return _pallas.pallas_call(
      functools.partial(_prepare_kernel, chunk=chunk, inverse_block=blocks.inverse_block),
      grid=(batch, heads, time // chunk),
      in_specs=[sp["qk"], head(value), sp["vec"], sp["vec"]],
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=_params(blocks.prepare_num_warps, blocks.prepare_num_stages),
      interpret=_backend.pallas_interpret(), name="gated_delta_prepare")(k, v, b, beta)


def _seq_specs(time, key, rep, bv, chunk):
  """Whole-sequence BlockSpecs on grid (batch, head, V tile)."""
  return dict(
      qk=pl.BlockSpec((None, time, None, key), lambda i, n, e: (i, 0, n // rep, 0)),
      w=pl.BlockSpec((None, time, None, key), lambda i, n, e: (i, 0, n, 0)),
      v=pl.BlockSpec((None, time, None, bv), lambda i, n, e: (i, 0, n, e)),
      vec=pl.BlockSpec((None, None, time), lambda i, n, e: (i, n, 0)),
      square=pl.BlockSpec((None, None, time, chunk), lambda i, n, e: (i, n, 0, 0)),
      state=pl.BlockSpec((None, None, key, bv), lambda i, n, e: (i, n, 0, e)))


def _walk_states(sp, h0, packed, num_chunks):
  """The walks' state BlockSpec and their extra inputs: per (batch, head)
  tile, or with `packed` one tile per sequence of h0 [S, N, K, V] and the
  (starts, ends) [C] after it."""
  if packed is None:
    return sp["state"], [], ()
  key, bv = sp["state"].block_shape[2:]
  state = pl.BlockSpec((h0.shape[0], None, key, bv), lambda i, n, e: (0, n, 0, e))
  return state, [varlen.per_chunk_spec(num_chunks)] * 2, tuple(packed)


def states(k, w, u_tilde, b, h0, blocks, packed=None):
  """The Triton forward walk (the Mosaic one, `mosaic.walk_forward`, forms Y
  too): the state entering each chunk [B, N, C, K, V] and U [B, T, N, V], both
  in the input dtype, and the final state (float32; one per sequence with
  `packed`, as h0)."""
  batch, time, groups, key = k.shape
  heads, value = u_tilde.shape[2:]
  chunk, bv = blocks.chunk, blocks.state_block_v
  num_chunks = time // chunk
  sp = _seq_specs(time, key, heads // groups, bv, chunk)
  state, seq_specs, seq_inputs = _walk_states(sp, h0, packed, num_chunks)
  return _pallas.pallas_call(
      functools.partial(_states_kernel, chunk=chunk, num_chunks=num_chunks,
                        packed=packed is not None),
      grid=(batch, heads, value // bv),
      in_specs=[sp["qk"], sp["w"], sp["v"], sp["vec"], state] + seq_specs,
      out_specs=[pl.BlockSpec((None, None, num_chunks, key, bv),
                              lambda i, n, e: (i, n, 0, 0, e)), sp["v"], state],
      out_shape=[jax.ShapeDtypeStruct((batch, heads, num_chunks, key, value),
                                      u_tilde.dtype),
                 jax.ShapeDtypeStruct(u_tilde.shape, u_tilde.dtype),
                 jax.ShapeDtypeStruct(h0.shape, _F32)],
      compiler_params=_params(blocks.state_num_warps, blocks.state_num_stages),
      interpret=_backend.pallas_interpret(),
      name="gated_delta_states")(k, w, u_tilde, b, h0, *seq_inputs)


def output(q, k, u, b, states, scale, blocks, *, save_scores):
  """y [B, T, N, V] from the corrected values U, and with `save_scores` the
  chunks' transposed scores [B, N, T, L], in the input dtype."""
  batch, time, groups, key = q.shape
  heads, value = u.shape[2:]
  chunk = blocks.chunk
  sp = _specs(chunk, key, heads // groups)
  head = sp["head"]
  out_specs, out_shape = [head(value)], [jax.ShapeDtypeStruct(u.shape, u.dtype)]
  if save_scores:
    out_specs.append(sp["square"])
    out_shape.append(jax.ShapeDtypeStruct((batch, heads, time, chunk), u.dtype))
  return _pallas.pallas_call(
      functools.partial(_output_kernel, chunk=chunk, scale=scale, block_v=blocks.block_v),
      grid=(batch, heads, time // chunk),
      in_specs=[sp["qk"], sp["qk"], head(value), sp["vec"],
                pl.BlockSpec((None, None, None, key, value),
                             lambda i, n, c: (i, n, c, 0, 0))],
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=_params(blocks.num_warps, blocks.num_stages),
      interpret=_backend.pallas_interpret(),
      name="gated_delta_output")(q, k, u, b, states)


def states_bwd(q, k, w, dy, b, scores, dfinal, scale, blocks, packed=None):
  """The Triton reversed walk (the Mosaic one, `mosaic.walk_reverse`, forms the
  scores itself): the adjoint of the state leaving each chunk [B, N, C, K, V]
  and dU [B, T, N, V] in the input dtype, d initial_state (float32, shaped as
  dfinal), from the scores the output kernel stored."""
  batch, time, groups, key = q.shape
  heads, value = dy.shape[2:]
  chunk, bv = blocks.chunk, blocks.state_block_v
  num_chunks = time // chunk
  sp = _seq_specs(time, key, heads // groups, bv, chunk)
  state, seq_specs, seq_inputs = _walk_states(sp, dfinal, packed, num_chunks)
  return _pallas.pallas_call(
      functools.partial(_states_bwd_kernel, chunk=chunk, num_chunks=num_chunks,
                        scale=scale, packed=packed is not None),
      grid=(batch, heads, value // bv),
      in_specs=[sp["qk"], sp["qk"], sp["w"], sp["v"], sp["vec"], sp["square"],
                state] + seq_specs,
      out_specs=[pl.BlockSpec((None, None, num_chunks, key, bv),
                              lambda i, n, e: (i, n, 0, 0, e)), sp["v"], state],
      out_shape=[jax.ShapeDtypeStruct((batch, heads, num_chunks, key, value), dy.dtype),
                 jax.ShapeDtypeStruct(dy.shape, dy.dtype),
                 jax.ShapeDtypeStruct(dfinal.shape, _F32)],
      compiler_params=_params(blocks.state_num_warps, blocks.state_num_stages),
      interpret=_backend.pallas_interpret(),
      name="gated_delta_states_reverse")(q, k, w, dy, b, scores, dfinal, *seq_inputs)


def value_grads(q, k, v, u, du, dy, b, beta, tt, scale, blocks, *, pairs=False):
  """dV [B, T, N, V]; then `T^T dU` [B, T, N, V] and the chunks' adjoint
  scores and `A` terms [B, N, T, L] each, or with `pairs` (for
  `mosaic_key_grads`) one [B, N, C, 2L, 2L] array of their blocks; all in the
  input dtype; then the d b and d beta shares [B, N, T] float32."""
  batch, time, groups, key = q.shape
  heads, value = v.shape[2:]
  chunk = blocks.chunk
  sp = _specs(chunk, key, heads // groups)
  head, square = sp["head"], sp["square"]
  rows = jax.ShapeDtypeStruct(v.shape, v.dtype)
  if pairs:
    out_specs = [pl.BlockSpec((None, None, None, 2 * chunk, 2 * chunk),
                              lambda i, n, c: (i, n, c, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((batch, heads, time // chunk, 2 * chunk, 2 * chunk),
                                      v.dtype)]
  else:
    out_specs = [head(value), square, square]
    out_shape = [rows] + [jax.ShapeDtypeStruct((batch, heads, time, chunk), v.dtype)] * 2
  return _pallas.pallas_call(
      functools.partial(_value_grad_kernel, chunk=chunk, scale=scale,
                        block_v=blocks.block_v, pairs=pairs),
      grid=(batch, heads, time // chunk),
      in_specs=[sp["qk"], sp["qk"], head(value), head(value), head(value), head(value),
                sp["vec"], sp["vec"], square],
      out_specs=[head(value), *out_specs, sp["vec"], sp["vec"]],
      out_shape=[rows, *out_shape, jax.ShapeDtypeStruct(b.shape, _F32),
                 jax.ShapeDtypeStruct(b.shape, _F32)],
      compiler_params=_params(blocks.value_grad_num_warps, blocks.grad_num_stages),
      interpret=_backend.pallas_interpret(),
      name="gated_delta_value_grads")(q, k, v, u, du, dy, b, beta, tt)


def key_grads(q, k, u, dru, dy, b, beta, dsd, dkk, states, dstates, scale, blocks):
  """dQ, dK [B, T, N, K] (float32 when heads share q/k, to be summed) and the
  d b and d beta shares [nK, B, N, T] float32 of the nK key tiles."""
  batch, time, groups, key = q.shape
  heads, value = u.shape[2:]
  rep = heads // groups
  chunk, bk = blocks.chunk, blocks.grad_block_k
  num_k = key // bk
  sp = _specs(chunk, key, rep)
  rows, vec, square = sp["head"](value), sp["vec"], sp["square"]
  qk = pl.BlockSpec((None, chunk, None, bk), lambda i, n, c, j: (i, c, n // rep, j))
  state = pl.BlockSpec((None, None, None, bk, value), lambda i, n, c, j: (i, n, c, j, 0))
  share = pl.BlockSpec((None, None, None, chunk), lambda i, n, c, j: (j, i, n, c))
  dqk_dtype = q.dtype if rep == 1 else _F32
  return _pallas.pallas_call(
      functools.partial(_key_grad_kernel, chunk=chunk, scale=scale,
                        block_v=blocks.block_v),
      grid=(batch, heads, time // chunk, num_k),
      in_specs=[qk, qk, rows, rows, rows, vec, vec, square, square, state, state],
      out_specs=[pl.BlockSpec((None, chunk, None, bk), lambda i, n, c, j: (i, c, n, j))] * 2
      + [share, share],
      out_shape=[jax.ShapeDtypeStruct((batch, time, heads, key), dqk_dtype)] * 2
      + [jax.ShapeDtypeStruct((num_k,) + b.shape, _F32)] * 2,
      # Two stages or more: Triton prefetches the next V tile's state tiles
      # during the loop (BUILD_NOTES.md).
      compiler_params=_params(blocks.key_grad_num_warps, blocks.grad_num_stages),
      interpret=_backend.pallas_interpret(),
      name="gated_delta_key_grads")(q, k, u, dru, dy, b, beta, dsd, dkk, states, dstates)
