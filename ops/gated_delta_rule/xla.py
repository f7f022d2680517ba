"""The chunked XLA tier of the gated delta rule: the WY / UT-transform form.

Yang, Kautz & Hatamizadeh 2024, https://arxiv.org/abs/2412.06464 (section 3),
after Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule
over Sequence Length", https://arxiv.org/abs/2406.06484. Inside a chunk of L
tokens, with `b` the cumulative log-decay and `M0` the entering state, the
per-token corrections `u_t` solve a unit lower-triangular system:

1. UT transform (parallel over chunks):
   `A_ij = beta_i exp(b_i - b_j) (k_i . k_j)` for j < i,
   `W = (I + A)^-1 (beta exp(b) K)`,  `U~ = (I + A)^-1 (beta V)`;
2. state passing (one `lax.scan` step per chunk, [K, K] x [K, V] products):
   `U = U~ - W M0`, `M_next = exp(b_L) M0 + (K exp(b_L - b))^T U`;
3. output: `Y = scale (exp(b) (Q M0) + ((Q K^T) * exp(b_i - b_j) [i >= j]) U)`.

Glossary of shapes: B batch, T time, N heads, K key size, V value size,
C chunks, L tokens per chunk.
"""

import jax
import jax.numpy as jnp

from ops import _shapes
from ops.gated_delta_rule.reference import no_gate
from ops.ssd import varlen
from ops.ssd.groups import expand_groups
from ops.ssd.xla import chunk_cumsum
from ops.ssd.xla import einsum

_F32 = jnp.float32
DEFAULT_CHUNK = 64


def gated_delta_rule_xla(q, k, v, log_decay, beta, *, scale=None, initial_state=None,
                         chunk_size=None, cu_seqlens=None):
  """`gated_delta_rule_reference`'s contract without its input options (the
  public op applies them), chunked (default 64). With `cu_seqlens` the
  sequences sit on chunks of their own (`ops/ssd/varlen.py`) and the scan over
  chunks restarts at each."""
  log_decay = no_gate(log_decay, beta)
  batch, time, heads, value = v.shape
  key = q.shape[-1]
  dtype = v.dtype
  scale = key ** -0.5 if scale is None else scale
  chunk = min(chunk_size or DEFAULT_CHUNK, time)
  q, k = expand_groups(q, heads), expand_groups(k, heads)
  lay, (q, k, v, log_decay, beta) = varlen.on_chunks(cu_seqlens, chunk, q, k, v, log_decay,
                                                     beta)
  q, k, v, log_decay, beta = (_shapes.pad_axis(x, 1, chunk)
                              for x in (q, k, v, log_decay, beta))
  padded = v.shape[1]
  num_chunks = padded // chunk

  def split(x):  # [B, Tp, N, *] -> [B, N, C, L, *]
    x = x.reshape(batch, num_chunks, chunk, heads, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1)
  qc, kc, vc = split(q.astype(dtype)), split(k.astype(dtype)), split(v)
  betac = split(beta.astype(_F32))                                  # [B, N, C, L]
  b = jnp.moveaxis(chunk_cumsum(log_decay, chunk), 3, 1)            # [B, N, C, L]
  b_last = b[..., -1]                                               # [B, N, C]
  row = jnp.arange(chunk)[:, None]
  col = jnp.arange(chunk)[None, :]
  diff = b[..., :, None] - b[..., None, :]                          # [B, N, C, L, L]
  decay = jnp.where(row >= col, jnp.exp(jnp.where(row >= col, diff, 0.0)), 0.0)

  # 1. UT transform.
  kk = einsum("bncik,bncjk->bncij", kc, kc)                         # [B, N, C, L, L]
  a = jnp.where(row > col, betac[..., None] * decay * kk, 0.0)
  eye = jnp.eye(chunk, dtype=_F32)
  rhs = jnp.concatenate([(betac * jnp.exp(b))[..., None] * kc.astype(_F32),
                         betac[..., None] * vc.astype(_F32)], axis=-1)
  sol = jax.scipy.linalg.solve_triangular(eye + a, rhs, lower=True,
                                          unit_diagonal=True)      # [B, N, C, L, K + V]
  w, u_tilde = sol[..., :key], sol[..., key:]
  k_end = kc.astype(_F32) * jnp.exp(b_last[..., None] - b)[..., None]   # [B, N, C, L, K]
  scores = einsum("bncik,bncjk->bncij", qc, kc) * decay * scale    # [B, N, C, L, L]
  q_in = qc.astype(_F32) * (scale * jnp.exp(b))[..., None]          # [B, N, C, L, K]

  # 2-3. State passing and output, one chunk per scan step.
  def step(m0, xs):
    w, u_tilde, k_end, scores, q_in, b_last = xs
    u = u_tilde - einsum("bnlk,bnkv->bnlv", w.astype(dtype), m0.astype(dtype))
    y = (einsum("bnlk,bnkv->bnlv", q_in.astype(dtype), m0.astype(dtype))
         + einsum("bnij,bnjv->bniv", scores.astype(dtype), u.astype(dtype)))
    m = (jnp.exp(b_last)[..., None, None] * m0
         + einsum("bnlk,bnlv->bnkv", k_end.astype(dtype), u.astype(dtype)))
    return m, y

  h0 = (jnp.zeros((varlen.num_states(batch, cu_seqlens), heads, key, value), _F32) if initial_state is None
        else initial_state.astype(_F32))
  xs = tuple(jnp.moveaxis(x, 2, 0) for x in (w, u_tilde, k_end, scores, q_in, b_last))
  if lay is None:
    final, y = jax.lax.scan(step, h0, xs)                           # y [C, B, N, L, V]
  else:
    y, final = varlen.scan_with_resets(step, xs, lay.starts, lay.ends, h0)
  y = jnp.swapaxes(jnp.moveaxis(y, 0, 2).reshape(batch, heads, padded, value), 1, 2)
  return varlen.off_chunks(y, lay, time).astype(dtype), final
