"""The specification of decode attention: a few new queries against a KV cache.

Glossary of shapes: B batch, T new tokens per sequence (queries, T <= S), S
cache slots (S_max), N query heads, K key/value heads (N = G * K: G query
heads share one key/value head, GQA without repeating K/V), H head size.

Semantics. Sequence b holds `lengths[b]` valid cache entries, the last T of
which are the new tokens (already written to the cache): query t sits at
position p = lengths[b] - T + t. It attends to key s when

  * s <= p (causal: the new tokens see the whole valid prefix and each other
    causally; s < lengths[b] follows), and
  * with `local_window_size`, s >= p - left (a sliding window of left + 1
    keys ending at the query).

Cache entries s >= lengths[b] are padding and never used: their values, even
inf or NaN, do not change the output. A query that sees no key (only possible
when lengths[b] < T, which the public op refuses for concrete lengths) returns
zeros. With lengths == S and T == S this is causal self-attention; in
general it equals `jax.nn.dot_product_attention` with the boolean mask above.
"""

import jax
import jax.numpy as jnp

from ops.flex_attention.reference import masked_softmax


def window_left(local_window_size) -> int | None:
  """The left extent of `local_window_size`: `w` or `(left, right)` -> left.

  The right side of a pair is bounded by causality (right >= 0 adds nothing),
  as with `jax.nn.dot_product_attention(is_causal=True, ...)`; None: unbounded.
  """
  if local_window_size is None:
    return None
  if isinstance(local_window_size, int):
    return local_window_size
  return local_window_size[0]


def allowed_mask(lengths: jax.Array, seq_q: int, seq_kv: int,
                 local_window_size=None) -> jax.Array:
  """[B, T, S] boolean: True where query t of sequence b may attend to key s."""
  lengths = lengths.astype(jnp.int32)
  pos = lengths[:, None] - seq_q + jnp.arange(seq_q, dtype=jnp.int32)[None]  # [B, T]
  s = jnp.arange(seq_kv, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
  mask = (s <= pos[:, :, None]) & (s < lengths[:, None, None])
  left = window_left(local_window_size)
  if left is not None:
    mask &= s >= pos[:, :, None] - left
  return mask


def valid_keys(lengths: jax.Array, seq_kv: int) -> jax.Array:
  """[B, S, 1, 1] boolean: the cache entries below each sequence's length."""
  s = jnp.arange(seq_kv, dtype=jnp.int32)[None, :]
  return (s < lengths.astype(jnp.int32)[:, None])[:, :, None, None]


def decode_attention_reference(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, *,
    scale: float | None = None, local_window_size=None) -> jax.Array:
  """`ops.decode_attention`'s specification, computed densely in float32.

  Query t of sequence b sits at position p = lengths[b] - T + t and attends to
  the keys s <= p (and s >= p - left with a window). Entries s >= lengths[b]
  never change the output, even inf or NaN; a query that sees no key returns
  zeros.

  Args:
    q: [B, T, N, H] the new tokens' queries.
    k_cache, v_cache: [B, S, K, H], N a multiple of K.
    lengths: [B] ints: valid cache entries per sequence, the new tokens included.
    scale: logit scale, default H ** -0.5.
    local_window_size: `left` or `(left, right)`: query p sees keys s >= p - left.

  Returns:
    [B, T, N, H] in q's dtype.
  """
  batch, seq_q, num_heads, head_dim = q.shape
  seq_kv, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
  groups = num_heads // num_kv_heads
  scale = head_dim ** -0.5 if scale is None else scale
  valid = valid_keys(lengths, seq_kv)  # padding zeroed: it must not leak NaN
  k = jnp.where(valid, k_cache.astype(jnp.float32), 0.0)
  v = jnp.where(valid, v_cache.astype(jnp.float32), 0.0)
  qf = q.astype(jnp.float32).reshape(batch, seq_q, num_kv_heads, groups, head_dim)
  logits = jnp.einsum("btkgh,bskh->bkgts", qf, k,
                      precision=jax.lax.Precision.HIGHEST) * scale
  mask = allowed_mask(lengths, seq_q, seq_kv, local_window_size)[:, None, None]
  probs = masked_softmax(logits, mask)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v, precision=jax.lax.Precision.HIGHEST)
  return out.reshape(batch, seq_q, num_heads, head_dim).astype(q.dtype)


def decode_attention_xla(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, *,
    scale: float, local_window_size=None) -> jax.Array:
  """The XLA path: the reference's mask, with the products in the input dtype.

  The cache is read in its own dtype (the reference's float32 copy of it
  would double a memory-bound op's traffic); products accumulate in float32,
  the softmax is float32 and its probabilities meet V in V's dtype, as the
  kernel does. Shapes as `decode_attention_reference`.
  """
  batch, seq_q, num_heads, head_dim = q.shape
  seq_kv, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
  groups = num_heads // num_kv_heads
  # float32 inputs multiply in float32 (not TF32), as the kernel does.
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  qg = q.reshape(batch, seq_q, num_kv_heads, groups, head_dim)
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k_cache, precision=precision,
                      preferred_element_type=jnp.float32) * scale
  mask = allowed_mask(lengths, seq_q, seq_kv, local_window_size)[:, None, None]
  # The mask also drops the padding keys' inf/NaN logits.
  probs = masked_softmax(logits, mask).astype(v_cache.dtype)
  # Padding values times a zero probability would still give NaN for a NaN.
  v = jnp.where(valid_keys(lengths, seq_kv), v_cache, jnp.zeros((), v_cache.dtype))
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v, precision=precision,
                   preferred_element_type=jnp.float32)
  return out.reshape(batch, seq_q, num_heads, head_dim).astype(q.dtype)
