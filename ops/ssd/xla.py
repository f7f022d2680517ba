"""The chunked XLA tier of SSD: Mamba-2's four-step algorithm in `jnp.einsum`.

Dao & Gu 2024, https://arxiv.org/abs/2405.21060 (section 6, "ssd_minimal").
The sequence is cut into chunks of `L` tokens; with `b` the cumulative
log-decay inside a chunk:

1. intra-chunk: `Y_diag = ((Q K^T) * exp(b_i - b_j) [i >= j]) V`   (quadratic in L)
2. chunk states: `S_c = (K * exp(b_L - b))^T V`                    ([K, V] per chunk)
3. state passing: `H_{c+1} = exp(b_L) H_c + S_c`, all chunks at once through
   the [C + 1, C + 1] matrix of segment sums of the chunk decays
4. output: `Y = Y_diag + exp(b) * (Q H_c)`

Products take the input dtype with float32 accumulation; states are float32.

Glossary of shapes: B batch, T time, N heads, K key size, V value size,
C chunks, L tokens per chunk.
"""

import jax
import jax.numpy as jnp

from ops import _shapes
from ops.ssd import varlen
from ops.ssd.groups import expand_groups

_F32 = jnp.float32
DEFAULT_CHUNK = 128


def einsum(spec: str, *operands: jax.Array) -> jax.Array:
  """`jnp.einsum` accumulating in float32: input-dtype operands on accelerators,
  float32 operands on CPU (whose dot has no bf16 x bf16 -> f32 kernel)."""
  if jax.default_backend() == "cpu":
    return jnp.einsum(spec, *(x.astype(_F32) for x in operands))
  return jnp.einsum(spec, *operands, preferred_element_type=_F32)


def segsum(x: jax.Array) -> jax.Array:
  """[..., C] -> [..., C, C]: out[i, j] = sum_{j < m <= i} x_m, -inf above the diagonal.

  Computed as a masked cumulative sum (not as a difference of cumulative sums),
  so strong decays do not lose precision.
  """
  size = x.shape[-1]
  x = jnp.broadcast_to(x[..., None], x.shape + (size,))              # [..., C(i), C(j)]
  row = jnp.arange(size)[:, None]
  col = jnp.arange(size)[None, :]
  x = jnp.where(row > col, x, 0.0)
  out = jnp.cumsum(x, axis=-2)
  return jnp.where(row >= col, out, -jnp.inf)


def chunk_cumsum(log_decay: jax.Array, chunk: int) -> jax.Array:
  """[B, T, N] (T a multiple of `chunk`) -> [B, C, L, N] f32 cumulative sums per chunk."""
  batch, time, heads = log_decay.shape
  g = log_decay.astype(_F32).reshape(batch, time // chunk, chunk, heads)
  return jnp.cumsum(g, axis=2)


def ssd_xla(q, k, v, log_decay, *, initial_state=None, chunk_size=None, cu_seqlens=None):
  """Same contract as `ssd_reference`, chunked (`chunk_size` default 128).

  With `cu_seqlens` the sequences sit on chunks of their own
  (`ops/ssd/varlen.py`) and the state passing is one `lax.scan` step per
  chunk, restarting at each sequence.
  """
  batch, time, heads, value = v.shape
  key = q.shape[-1]
  dtype = v.dtype
  chunk = min(chunk_size or DEFAULT_CHUNK, time)
  q, k = expand_groups(q, heads), expand_groups(k, heads)
  lay, (q, k, v, log_decay) = varlen.on_chunks(cu_seqlens, chunk, q, k, v, log_decay)
  q, k, v, log_decay = (_shapes.pad_axis(x, 1, chunk) for x in (q, k, v, log_decay))
  padded = v.shape[1]
  num_chunks = padded // chunk
  split = lambda x: x.reshape(batch, num_chunks, chunk, *x.shape[2:]).astype(dtype)
  qc, kc, vc = split(q), split(k), split(v)                        # [B, C, L, N, *]
  b = chunk_cumsum(log_decay, chunk)                               # [B, C, L, N]
  b_last = b[:, :, -1]                                             # [B, C, N]

  # 1. Intra-chunk (diagonal blocks).
  scores = einsum("bclnk,bcsnk->bcnls", qc, kc)
  bt = jnp.moveaxis(b, 3, 2)                                       # [B, C, N, L]
  diff = bt[..., :, None] - bt[..., None, :]                       # [B, C, N, L, L]
  causal = jnp.tril(jnp.ones((chunk, chunk), bool))
  mask = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
  y_diag = einsum("bcnls,bcsnv->bclnv", (scores * mask).astype(dtype), vc)

  # 2. Chunk states from a zero start.
  weights = jnp.exp(b_last[:, :, None, :] - b)                     # [B, C, L, N]
  states = einsum("bclnk,bclnv->bcnkv", (kc * weights[..., None]).astype(dtype), vc)             # [B, C, N, K, V]

  # 3. State passing across chunks.
  if cu_seqlens is None:  # placed like the chunk states (a batch split over Explicit axes)
    h0 = jnp.zeros_like(states[:, 0], _F32)
    h0 = h0 if initial_state is None else h0 + initial_state.astype(_F32)
  else:
    h0 = (jnp.zeros((varlen.num_states(batch, cu_seqlens), heads, key, value), _F32)
          if initial_state is None else initial_state.astype(_F32))
  if lay is None:
    states = jnp.concatenate([h0[:, None], states], axis=1)        # [B, C + 1, N, K, V]
    padded_last = jnp.pad(b_last, ((0, 0), (1, 0), (0, 0)))        # [B, C + 1, N]
    decay_chunk = jnp.exp(segsum(jnp.moveaxis(padded_last, 1, 2)))  # [B, N, C + 1, C + 1]
    passed = jnp.einsum("bnzc,bcnkv->bznkv", decay_chunk, states)  # [B, C + 1, N, K, V]
    entering, final = passed[:, :-1], passed[:, -1]
  else:
    def passing(h, xs):  # h: the state entering the chunk [1, N, K, V]
      chunk_state, chunk_decay = xs
      return jnp.exp(chunk_decay)[..., None, None] * h + chunk_state, h
    entering, final = varlen.scan_with_resets(
        passing, (jnp.moveaxis(states, 1, 0), jnp.moveaxis(b_last, 1, 0)),
        lay.starts, lay.ends, h0)
    entering = jnp.moveaxis(entering, 0, 1)                        # [1, C, N, K, V]

  # 4. Output: the entering state's contribution.
  y_off = einsum("bclnk,bcnkv->bclnv", qc, entering.astype(dtype)) * jnp.exp(b)[..., None]
  y = (y_diag + y_off).reshape(batch, padded, heads, value)
  return varlen.off_chunks(y, lay, time).astype(dtype), final
