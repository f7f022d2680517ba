"""Flash decoding in Pallas (Triton lowering): split-K attention over a KV cache.

Flash-Decoding (Tri Dao, Daniel Haziza, Francisco Massa and Grigory Sizov,
2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html): with a few
queries per sequence, one program per (sequence, head) leaves most of a GPU
idle while it streams a long cache. So the cache is cut along S into chunks,
one program per (sequence, key/value head, chunk) runs the online softmax of
FlashAttention over its chunk for all the G query heads of its GQA group and
all T new tokens at once (M = G * T rows: the chunk of K and V is read once
per group), and a small XLA step merges the chunks' partial results with
their log-sum-exp weights. Chunks past a sequence's length (or before its
window) run no iteration: a program reads its length first and loops over
the key tiles it can see only.

Glossary of shapes: B batch, T new tokens, S cache slots, N query heads, K
key/value heads, G = N // K, H head size (padded to a power of two >= 16:
Hp), M = G * T rows per program (padded likewise: Mp), P chunks (splits) of
C keys, bk keys per tile of a program's loop.

Speed notes:
  * Tiles that every row of the program sees whole run without any mask:
    plain loads, no comparisons; the tiles at the window's start and the
    last T keys (the new tokens' causal triangle and the end of the valid
    cache) run the masked body, whose loads are masked by the length, so
    the cache is never read past it (nor past S: no padding copy of S,
    except for a cache shorter than one tile, padded to it).
  * Logits are kept in base 2 (scale and log2(e) folded into one multiply).
  * The number of chunks comes from S and B * K: enough programs for several
    per multiprocessor, but chunks of at least a few tiles (`configs.py`).
  * A head size that is not a power of two pads the cache (a copy per call).
"""

import dataclasses
import functools
import math

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from ops import _pallas
from ops import _shapes
from ops.decode_attention import configs
from ops.decode_attention import reference

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything the kernel specialises on (hashable: custom_vjp nondiff arg)."""
  scale: float  # logit scale (natural units)
  left: int | None  # query p sees keys s >= p - left (None: unbounded)
  config: configs.TritonConfig | None  # None: TritonConfig.get_default for the shapes
  interpret: bool


def padded(n: int) -> int:
  """A block dimension of n: the next power of two, at least 16 (Triton's dot)."""
  return max(16, pl.next_power_of_2(n))


def chunking(seq_kv: int, config: configs.TritonConfig) -> tuple[int, int]:
  """(C keys per chunk, a multiple of block_k; P chunks) covering S keys."""
  chunk = _shapes.round_up(_shapes.cdiv(seq_kv, config.num_splits), config.block_k)
  return chunk, _shapes.cdiv(seq_kv, chunk)


def _kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, st: Static,
            config: configs.TritonConfig, seq_q: int, seq_kv: int, chunk: int):
  bk = config.block_k
  mp = q_ref.shape[0]
  length = len_ref[0]
  limit = jnp.clip(length, 0, seq_kv)  # keys below it are read, never above
  start = pl.program_id(2) * chunk
  stop = jnp.minimum(start + chunk, limit)
  first = start  # the first key any query of the program sees
  if st.left is not None:
    first = jnp.maximum(start, length - seq_q - st.left)
  floor_tile = lambda key: (key - start) // bk
  ceil_tile = lambda key: -((start - key) // bk)
  lo, hi = floor_tile(first), ceil_tile(stop)  # the tiles to visit: [lo, hi)
  # Tiles every query sees whole: keys up to the first query's position
  # (length - T) and, with a window, from the last query's reach on.
  open_lo = lo if st.left is None else jnp.maximum(lo, ceil_tile(length - 1 - st.left))
  open_hi = floor_tile(jnp.minimum(length - seq_q + 1, limit))
  mid_lo = jnp.clip(open_lo, lo, hi)
  mid_hi = jnp.clip(open_hi, mid_lo, hi)

  q = q_ref[...]  # [Mp, Hp]; row g * T + t
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  pos = length - seq_q + jax.lax.broadcasted_iota(jnp.int32, (mp, 1), 0) % seq_q
  c = st.scale * LOG2E

  def body(j, carry, masked):
    acc, m, l = carry  # [Mp, Hp], [Mp], [Mp]
    k0 = pl.multiple_of(start + j * bk, bk)
    keys = pl.ds(k0, bk)
    if masked:
      k_idx = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)  # [1, bk]
      live = k0 + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0) < limit  # [bk, 1]
      k = plgpu.load(k_ref.at[keys, :], mask=live, other=0.0)  # [bk, Hp]
      v = plgpu.load(v_ref.at[keys, :], mask=live, other=0.0)
    else:
      k, v = k_ref[keys, :], v_ref[keys, :]
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * c  # [Mp, bk] f32
    if masked:
      ok = (k_idx <= pos) & (k_idx < limit)
      if st.left is not None:
        ok &= k_idx >= pos - st.left
      s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # A row with nothing open yet: keep exp2 away from inf - inf.
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m - m_use)
    p = jnp.exp2(s - m_use[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return acc, m_new, l

  carry = (jnp.zeros(o_ref.shape, jnp.float32), jnp.full((mp,), -jnp.inf, jnp.float32),
           jnp.zeros((mp,), jnp.float32))
  masked = functools.partial(body, masked=True)
  carry = jax.lax.fori_loop(lo, mid_lo, masked, carry)
  carry = jax.lax.fori_loop(mid_lo, mid_hi, functools.partial(body, masked=False), carry)
  acc, m, l = jax.lax.fori_loop(mid_hi, hi, masked, carry)
  empty = l == 0.0
  o_ref[...] = acc / jnp.where(empty, 1.0, l)[:, None]
  # Base-2 log-sum-exp of the chunk's logits; -inf: a chunk that saw nothing.
  lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def default_config(q_shape, k_shape, *, interpret: bool) -> configs.TritonConfig:
  """The tiling a call with q [B, T, N, H] and a cache [B, S, K, H] runs."""
  batch, seq_q, num_heads, head_dim = q_shape
  seq_kv, num_kv = k_shape[1], k_shape[2]
  return configs.TritonConfig.get_default(
      batch=batch, kv_heads=num_kv, seq_kv=seq_kv, rows=padded(num_heads // num_kv * seq_q),
      head_dim=padded(head_dim), interpret=interpret)


def _partials(st: Static, config: configs.TritonConfig, q, k, v, lengths, seq_q: int):
  """The kernel's launch: q [B, K, Mp, Hp] (T new tokens per row group), k/v
  [B, S, K, Hp], lengths [B] -> (normalised partial outputs [B, K, P, Mp, Hp]
  f32, their base-2 lse [B, K, P, Mp])."""
  batch, num_kv, mp, hp = q.shape
  seq_kv = k.shape[1]
  chunk, splits = chunking(seq_kv, config)
  q_spec = pl.BlockSpec((None, None, mp, hp), lambda b, h, c: (b, h, 0, 0))
  kv_spec = pl.BlockSpec((None, seq_kv, None, hp), lambda b, h, c: (b, 0, h, 0))
  len_spec = pl.BlockSpec((None, 1), lambda b, h, c: (b, 0))
  out_shape = [jax.ShapeDtypeStruct((batch, num_kv, splits, mp, hp), jnp.float32),
               jax.ShapeDtypeStruct((batch, num_kv, splits, mp), jnp.float32)]
  out_specs = [pl.BlockSpec((None, None, None, mp, hp), lambda b, h, c: (b, h, c, 0, 0)),
               pl.BlockSpec((None, None, None, mp), lambda b, h, c: (b, h, c, 0))]
  kernel = functools.partial(_kernel, st=st, config=config, seq_q=seq_q, seq_kv=seq_kv,
                             chunk=chunk)
  return _pallas.pallas_call(
      kernel, grid=(batch, num_kv, splits), in_specs=[len_spec, q_spec, kv_spec, kv_spec],
      out_specs=out_specs, out_shape=out_shape, interpret=st.interpret,
      name="decode_attention",
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
  )(lengths.astype(jnp.int32)[:, None], q, k, v)


def _combine(o, lse):
  """Merges the chunks: o [B, K, P, Mp, Hp], lse [B, K, P, Mp] -> [B, K, Mp, Hp].

  Each chunk's output is weighted by its share 2^lse of the softmax's total;
  a row no chunk saw (all -inf) gets zeros.
  """
  if o.shape[2] == 1:
    return o[:, :, 0]  # one chunk: already normalised (zeros where empty)
  top = jnp.max(lse, axis=2, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  weights = jnp.exp2(lse - top)  # [B, K, P, Mp]; empty chunks: 0
  total = jnp.sum(weights, axis=2)
  out = jnp.sum(weights[..., None] * o, axis=2)
  return out / jnp.where(total == 0.0, 1.0, total)[..., None]


def _forward(st: Static, q, k_cache, v_cache, lengths):
  """q [B, T, N, H], k/v [B, S, K, H], lengths [B] -> [B, T, N, H] in q's dtype."""
  batch, seq_q, num_heads, head_dim = q.shape
  num_kv = k_cache.shape[2]
  groups = num_heads // num_kv
  rows = groups * seq_q
  mp, hp = padded(rows), padded(head_dim)
  # [B, T, K * G, H] -> [B, K, G * T, H]: a program's rows are its group's
  # heads' queries, row g * T + t (a small copy: T is small).
  qr = q.reshape(batch, seq_q, num_kv, groups, head_dim).transpose(0, 2, 3, 1, 4)
  qr = _shapes.pad_axis(_shapes.pad_axis(qr.reshape(batch, num_kv, rows, head_dim), 2, mp), 3, hp)
  k, v = (_shapes.pad_axis(x, 3, hp) for x in (k_cache, v_cache))  # copies only when H < Hp
  if st.config is None:
    config = default_config(q.shape, k_cache.shape, interpret=st.interpret)
  else:
    config = st.config.split_for(batch=batch, kv_heads=num_kv, seq_kv=k_cache.shape[1])
  if k.shape[1] < config.block_k:  # a tile's slice must fit the cache; the length masks the rest
    k, v = (_shapes.pad_axis(x, 1, config.block_k) for x in (k, v))
  o, lse = _partials(st, config, qr, k, v, lengths, seq_q)
  out = _combine(o, lse)[:, :, :rows, :head_dim]  # [B, K, G * T, H]
  out = out.reshape(batch, num_kv, groups, seq_q, head_dim).transpose(0, 3, 1, 2, 4)
  return out.reshape(batch, seq_q, num_heads, head_dim).astype(q.dtype)


# Decoding needs no gradient, so there is no backward kernel: the op stays
# differentiable (a model evaluated through it, e.g. a score of the last
# tokens, can be trained) by differentiating the reference, recomputed in the
# backward from the inputs.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _decode(st: Static, q, k_cache, v_cache, lengths):
  return _forward(st, q, k_cache, v_cache, lengths)


def _decode_fwd(st: Static, q, k_cache, v_cache, lengths):
  return _forward(st, q, k_cache, v_cache, lengths), (q, k_cache, v_cache, lengths)


def _decode_bwd(st: Static, residuals, dout):
  q, k_cache, v_cache, lengths = residuals
  reference_fn = lambda q, k, v: reference.decode_attention_reference(
      q, k, v, lengths, scale=st.scale, local_window_size=st.left)
  _, pullback = jax.vjp(reference_fn, q, k_cache, v_cache)
  return (*pullback(dout), None)


_decode.defvjp(_decode_fwd, _decode_bwd)
_decode_shared = _pallas.shared_lowering(_decode, static_argnums=(0,))


def decode_attention_pallas(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, *,
    scale: float, local_window_size=None, interpret: bool,
    config: configs.TritonConfig | None = None) -> jax.Array:
  """The kernel path of `ops.decode_attention` (inputs already validated).

  Args:
    q: [B, T, N, H]; k_cache, v_cache: [B, S, K, H]; lengths: [B] ints.
    scale: logit scale.
    local_window_size: `left`, `(left, right)` or None (reference.py).
    interpret: run the kernel in Pallas interpret mode.
    config: tiling and split count (its `num_splits` None: chosen for the
      call); default `configs.TritonConfig.get_default`.

  Returns:
    [B, T, N, H] in q's dtype. Differentiable through the reference (the
    kernel is forward-only).
  """
  st = Static(scale=float(scale), left=reference.window_left(local_window_size),
              config=config, interpret=interpret)
  return _decode_shared(st, q, k_cache, v_cache, lengths)
