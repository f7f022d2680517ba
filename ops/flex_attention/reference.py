"""The specification of flex attention: dense masked softmax attention in f32.

FlashAttention (https://arxiv.org/abs/2205.14135) computes exactly this without
materialising the [T, S] logits; this file does materialise them.

Glossary of shapes: B batch, T query tokens, S key/value tokens, N query heads,
K key/value heads (N = G * K, G query heads share one key/value head), H head
size.

Mask conventions (those of `jax.nn.dot_product_attention`): query t may attend
to key s when
  * `is_causal`: s <= t (top-left aligned when T != S),
  * `local_window_size=(left, right)`: t - left <= s <= t + right,
  * `segment_ids`: the query's and the key's segment ids are equal,
  * `key_value_seq_lengths`: s < key_value_seq_lengths[b],
  * `mask_mod(b, n, t, s)` is True.
A query row that may attend to no key returns zeros (never NaN).
"""

from typing import Callable

import jax
import jax.numpy as jnp

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
ScoreMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def normalize_window(local_window_size) -> tuple[int | None, int | None] | None:
  """`w` -> (w, w); `(left, right)` stays; None entries mean unbounded."""
  if local_window_size is None:
    return None
  if isinstance(local_window_size, int):
    return (local_window_size, local_window_size)
  left, right = local_window_size
  return (left, right)


def split_segment_ids(segment_ids):
  """`[B, T]` (self-attention) or a pair `([B, T], [B, S])` -> (q_ids, kv_ids)."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    return segment_ids[0], segment_ids[1]
  return segment_ids, segment_ids


def _index_grids(batch: int, num_heads: int, seq_q: int, seq_kv: int, indices=None):
  """(b [B, 1, 1, 1], n [1, N, 1, 1], t [1, 1, T, 1], s [1, 1, 1, S]) int32.

  `indices` is None (aranges) or the (b [B], n [N], t [T], s [S]) indices of
  the batch rows, heads, queries and keys in the whole call, for a block of a
  larger one (ring attention computes blocks of it)."""
  if indices is None:
    indices = tuple(jnp.arange(x) for x in (batch, num_heads, seq_q, seq_kv))
  b, n, t, s = indices
  return b[:, None, None, None], n[None, :, None, None], t[None, None, :, None], \
      s[None, None, None, :]


def allowed_mask(batch: int, num_heads: int, seq_q: int, seq_kv: int, *,
                 is_causal: bool = False, segment_ids=None,
                 local_window_size=None, key_value_seq_lengths=None,
                 mask_mod: MaskMod | None = None, indices=None) -> jax.Array:
  """[B, N or 1, T, S] boolean: True where query t may attend to key s.

  `indices`: as `flex_attention_reference`'s (the positions compared)."""
  b, n, t, s = _index_grids(batch, num_heads, seq_q, seq_kv, indices)
  mask = jnp.ones((1, 1, seq_q, seq_kv), bool)
  if is_causal:
    mask &= s <= t
  window = normalize_window(local_window_size)
  if window is not None:
    left, right = window
    if left is not None:
      mask &= s >= t - left
    if right is not None:
      mask &= s <= t + right
  q_ids, kv_ids = split_segment_ids(segment_ids)
  if q_ids is not None:
    mask &= (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]  # [B, 1, T, S]
  if key_value_seq_lengths is not None:
    mask &= s < key_value_seq_lengths[:, None, None, None]
  if mask_mod is not None:
    mask &= mask_mod(b, n, t, s)
  return mask


def _shifted_exp(logits: jax.Array, mask: jax.Array):
  """exp(logits - row max) where `mask`, else 0; its row sums; the row max
  (0 for a row with nothing allowed)."""
  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  # The shift cancels: no gradient through it (as in jax.nn.softmax). Its
  # gradient would route through `logits == row_max`, which a compiler that
  # rounds the two evaluations of `logits` differently leaves empty (0 / 0).
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  weights = jnp.exp(logits - row_max)
  return weights, jnp.sum(weights, axis=-1, keepdims=True), row_max


def masked_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis of f32 `logits` where `mask` (broadcastable)
  is True: masked entries get exactly 0, and a row with nothing allowed is all
  zeros (its query sees no key), never NaN."""
  weights, total, _ = _shifted_exp(logits, mask)
  return weights / jnp.where(total == 0, 1.0, total)


def masked_logsumexp(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """The natural log-sum-exp over the last axis of f32 `logits` where `mask`
  is True; -inf for a row with nothing allowed, whose gradient is 0 (not NaN)."""
  _, total, row_max = _shifted_exp(logits, mask)
  empty = total == 0
  return jnp.where(empty, -jnp.inf, row_max + jnp.log(jnp.where(empty, 1.0, total)))[..., 0]


def flex_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, *, is_causal: bool = False,
    scale: float | None = None, segment_ids=None, local_window_size=None,
    key_value_seq_lengths: jax.Array | None = None, mask_mod: MaskMod | None = None,
    score_mod: ScoreMod | None = None, return_lse: bool = False, indices=None):
  """Masked softmax attention, computed densely in float32.

  Args:
    q: [B, T, N, H].
    k, v: [B, S, K, H], N a multiple of K.
    is_causal, segment_ids, local_window_size, key_value_seq_lengths, mask_mod: the
      mask, as in `flex_attention`: query t attends to key s where every one
      given allows it (s <= t, top-left aligned when T != S; t - left <= s <=
      t + right; equal segment ids; s < key_value_seq_lengths[b];
      `mask_mod(b, n, t, s)` True). A query that sees no key returns zeros.
    scale: logit scale, default H ** -0.5.
    score_mod: `score_mod(score, b, n, t, s)` applied to the scaled logits.
    return_lse: also return the natural log-sum-exp [B, N, T] (-inf for an
      empty row).
    indices: None, or the (b [B], n [N], t [T], s [S]) int indices of this
      block's batch rows, heads, queries and keys in a larger call: the masks,
      `mask_mod` and `score_mod` see those.

  Returns:
    [B, T, N, H] in q's dtype (and the lse when asked).
  """
  batch, seq_q, num_heads, head_dim = q.shape
  seq_kv, num_kv_heads = k.shape[1], k.shape[2]
  groups = num_heads // num_kv_heads
  scale = head_dim ** -0.5 if scale is None else scale
  qf = q.astype(jnp.float32).reshape(batch, seq_q, num_kv_heads, groups, head_dim)
  logits = jnp.einsum("btkgh,bskh->bkgts", qf, k.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
  logits = logits.reshape(batch, num_heads, seq_q, seq_kv) * scale  # [B, N, T, S]
  if score_mod is not None:
    b, n, t, s = _index_grids(batch, num_heads, seq_q, seq_kv, indices)
    logits = score_mod(logits, b, n, t, s).astype(jnp.float32)
  mask = allowed_mask(batch, num_heads, seq_q, seq_kv, is_causal=is_causal,
                      segment_ids=segment_ids, local_window_size=local_window_size,
                      key_value_seq_lengths=key_value_seq_lengths, mask_mod=mask_mod,
                      indices=indices)
  probs = masked_softmax(logits, mask)
  probs = probs.reshape(batch, num_kv_heads, groups, seq_q, seq_kv)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  out = out.reshape(batch, seq_q, num_heads, head_dim).astype(q.dtype)
  if return_lse:
    return out, masked_logsumexp(logits, mask)
  return out
