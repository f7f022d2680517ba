"""Flash attention's Pallas implementation: `prepare`, which picks each call's
kernels and tiles, and the custom VJP over them.

The forward runs the Triton kernel (`triton.py`) or the Mosaic GPU one
(`mosaic.py`); the backward the Triton dK/dV and dQ kernels
(`triton_backward.py`) or the Mosaic GPU one (`mosaic_backward.py`). `prepare`
pads a call to the tiles and fixes its static description (`static.Static`,
which all the kernels take).

Glossary of shapes: B batch, T query tokens (padded: Tp), S key/value tokens
(padded: Sp), N query heads, K key/value heads, G = N // K, H head size
(padded to a power of two >= 16: Hp).
"""

import dataclasses
import functools
import math

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from ops import _pallas
from ops import _shapes
from ops.flex_attention import configs
from ops.flex_attention import masks
from ops.flex_attention import mosaic
from ops.flex_attention import mosaic_backward
from ops.flex_attention import reference
from ops.flex_attention import triton
from ops.flex_attention import triton_backward
from ops.flex_attention.static import Static


def _rows(kv_len):
  """[B, 1] key lengths -> [B] (None stays None), for the Mosaic GPU kernels."""
  return None if kv_len is None else kv_len[:, 0]


# ----------------------------------------------------------------------------
# Forward: the Mosaic GPU kernel where `prepare` gave it the call
# (`mosaic.py`), else the Triton one (`triton.py`); rows past the first-tile
# maxima's limit recomputed by `triton.refresh_frozen` after either.


def _forward(st: Static, q, k, v, kv_len, q_seg, k_seg, lists=None):
  """q [B, Tp, N, Hp], k/v [B, Sp, K, Hp] -> out [B, Tp, N, Hp], lse [B, N, Tp]."""
  if st.config.mosaic_fwd is not None:
    out, lse = mosaic.forward(st, q, k, v, _rows(kv_len), config=st.config.mosaic_fwd,
                              key_tiles=functools.partial(masks.key_tiles, st),
                              is_open=lambda q_idx, k_idx, kv_len: masks.is_open(
                                  st, q_idx, k_idx, kv_len, None, None),
                              interpret=st.interpret)
  else:
    out, lse = triton.forward(st, q, k, v, kv_len, q_seg, k_seg, lists)
  if st.config.keeps_first_tile_max and not triton.refreshes_in_kernel(st):
    out, lse = triton.refresh_frozen(st, q, k, v, kv_len, q_seg, k_seg, lists, out, lse)
  return out, lse


# ----------------------------------------------------------------------------
# The custom VJP. The backward runs the Mosaic GPU kernel where `prepare` gave
# it the call (`mosaic_backward.py`), else the Triton dK/dV and dQ launches
# (`triton_backward.py`).


def _backward(st: Static, q, k, v, kv_len, q_seg, k_seg, lists, out, lse, dout):
  """dQ [B, Tp, N, Hp], dK, dV [B, Sp, K, Hp] from the forward's out and lse."""
  delta = triton_backward.compute_delta(out, dout)
  if st.config.mosaic_bwd is not None:
    return mosaic_backward.backward(
        st, q, k, v, _rows(kv_len), lse, delta, dout, config=st.config.mosaic_bwd,
        query_tiles=functools.partial(masks.query_tiles, st),
        is_open=lambda q_idx, k_idx, kv_len: masks.is_open(st, q_idx, k_idx, kv_len, None, None),
        interpret=st.interpret)
  args = (st, q, k, v, kv_len, q_seg, k_seg, lse, delta, dout)
  dk, dv = triton_backward.dkdv_call(*args, lists=None if lists is None else lists["dkdv"])
  return triton_backward.dq_call(*args, lists=None if lists is None else lists["dq"]), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flex(st, q, k, v, kv_len, q_seg, k_seg, lists):
  return _forward(st, q, k, v, kv_len, q_seg, k_seg,
                  None if lists is None else lists["fwd"])[0]


def _flex_fwd(st, q, k, v, kv_len, q_seg, k_seg, lists):
  out, lse = _forward(st, q, k, v, kv_len, q_seg, k_seg,
                      None if lists is None else lists["fwd"])
  return out, (q, k, v, kv_len, q_seg, k_seg, lists, out, lse)


def _flex_bwd(st, residuals, dout):
  q, k, v, kv_len, q_seg, k_seg, lists, out, lse = residuals
  dq, dk, dv = _backward(st, q, k, v, kv_len, q_seg, k_seg, lists, out, lse, dout)
  return (*_pallas.typed_like((dq, dk, dv), (q, k, v)), None, None, None, None)


_flex.defvjp(_flex_fwd, _flex_bwd)
_flex_shared = _pallas.shared_lowering(_flex, static_argnums=(0,))


def _fit(cfg: configs.TritonConfig, seq_q: int, seq_kv: int) -> configs.TritonConfig:
  """Shrinks tiles that are longer than the (power-of-two rounded) sequence."""
  fit = lambda block, n: min(block, max(16, pl.next_power_of_2(n)))
  return dataclasses.replace(cfg, block_q=fit(cfg.block_q, seq_q),
                             block_k=fit(cfg.block_k, seq_kv))


def _fwd_softmax(config: configs.FlexConfig, dtype, score_mod) -> str:
  """The config's forward softmax, or 'online' where the first tile's maxima
  do not suit: float16's P overflows at 65504 (logits 16 base-2 units above
  the frozen maximum), and a `score_mod` may move logits with the key's
  position (ALiBi: a query's first key tile sits hundreds of units below its
  nearest keys), which sent nearly every query tile to the second pass,
  slower than the online forward."""
  if jnp.dtype(dtype) == jnp.float16 or score_mod is not None:
    return "online"
  return config.fwd_softmax


def _refresh(config: configs.FlexConfig, scores: int) -> str:
  """Where a forward of `scores` scores recomputes rows past the limit."""
  if config.refresh != "auto":
    return config.refresh
  return "in_kernel" if scores <= config.in_kernel_refresh_max_scores else "launch"


def prepare(q, k, v, *, scale: float, is_causal: bool, window,
            q_segment_ids, kv_segment_ids, key_value_seq_lengths, interpret: bool,
            config: configs.FlexConfig | None = None, mask_mod=None,
            score_mod=None):
  """Pads to tile multiples and fixes the static description of the call.

  Returns:
    (static, (q [B, Tp, N, Hp], k, v [B, Sp, K, Hp], kv_len [B, 1] | None,
    q_seg [B, Tp] | None, k_seg [B, Sp] | None, lists)); `lists` is None
    unless `mask_mod` is given (then the per-kernel tile lists).
  """
  batch, seq_q, num_heads, head_dim = q.shape
  seq_kv, num_kv = k.shape[1], k.shape[2]
  hp = max(16, pl.next_power_of_2(head_dim))
  if config is None:
    config = configs.get_config(hp, q.dtype, interpret=interpret)
  left, right = (None, None) if window is None else window
  if is_causal:
    right = 0 if right is None else min(right, 0)
  unsupported = dict(segments=q_segment_ids is not None,
                     mods=mask_mod is not None or score_mod is not None)
  scores = batch * num_heads * seq_q * seq_kv
  mosaic_fwd = config.mosaic_fwd
  if right is not None and config.mosaic_fwd_bounded is not None:
    mosaic_fwd = config.mosaic_fwd_bounded
    if (config.mosaic_fwd_short_bounded is not None
        and scores < config.mosaic_fwd_bounded_min_scores):
      mosaic_fwd = config.mosaic_fwd_short_bounded
  # The score limit holds for full attention; right-bounded calls keep their
  # tiles whatever their length (short causal calls measured faster there).
  too_short = right is None and scores < config.mosaic_fwd_min_scores
  if mosaic_fwd is not None and (too_short or not mosaic.takes(
      q.dtype, hp, seq_q, seq_kv, mosaic_fwd, **unsupported)):
    mosaic_fwd = None  # The Triton forward takes this call.
  # Shorter calls run without the sums (measured slower there).
  if (mosaic_fwd is not None and mosaic_fwd.tensor_core_sums
      and scores < config.tensor_core_sums_min_scores):
    mosaic_fwd = dataclasses.replace(mosaic_fwd, tensor_core_sums=False)
  if (mosaic_fwd is not None and mosaic_fwd.persistent and right is not None
      and not mosaic_fwd.persistent_right_bounded):
    # A right bound gives the items unequal work: the hardware's block
    # scheduler balances them, a fixed walk per SM does not (measured slower).
    mosaic_fwd = dataclasses.replace(mosaic_fwd, persistent=False)
  mosaic_bwd = config.mosaic_bwd
  if mosaic_bwd is not None and not mosaic_backward.takes(
      q.dtype, hp, seq_q, seq_kv, mosaic_bwd, **unsupported):
    mosaic_bwd = None  # The Triton backward takes this call.
  config = dataclasses.replace(
      config, **{name: _fit(getattr(config, name), seq_q, seq_kv)
                 for name in ("fwd", "dkdv", "dq")},
      mosaic_fwd=mosaic_fwd, mosaic_fwd_bounded=None, mosaic_bwd=mosaic_bwd,
      mosaic_fwd_min_scores=0, tensor_core_sums_min_scores=0,
      mosaic_fwd_short_bounded=None, mosaic_fwd_bounded_min_scores=0,
      fwd_softmax=_fwd_softmax(config, q.dtype, score_mod),
      refresh=_refresh(config, scores))
  q_multiple = max(c.block_q for c in (config.fwd, config.dkdv, config.dq))
  k_multiple = max(c.block_k for c in (config.fwd, config.dkdv, config.dq))
  # Least common multiples: the Mosaic tiles are multiples of 64, not always
  # powers of two.
  if mosaic_fwd is not None:
    q_multiple = math.lcm(q_multiple, mosaic_fwd.rows_per_block)
    k_multiple = math.lcm(k_multiple, mosaic_fwd.block_k)
  if mosaic_bwd is not None:
    q_multiple = math.lcm(q_multiple, mosaic_bwd.block_q)
    k_multiple = math.lcm(k_multiple, mosaic_bwd.keys_per_block)
  tp, sp = _shapes.round_up(seq_q, q_multiple), _shapes.round_up(seq_kv, k_multiple)

  st = Static(scale=float(scale), left=left, right=right,
               kv_mask=key_value_seq_lengths is not None or sp != seq_kv, key_length=seq_kv,
               segments=q_segment_ids is not None, groups=num_heads // num_kv,
               config=config, interpret=interpret, mask_mod=mask_mod,
               score_mod=score_mod)

  pad = lambda x, n: _shapes.pad_axis(_shapes.pad_axis(x, 1, n), 3, hp)
  q, k, v = pad(q, tp), pad(k, sp), pad(v, sp)
  kv_len = None  # Every row has S keys: the kernels take the static length.
  if key_value_seq_lengths is not None:
    kv_len = jnp.minimum(key_value_seq_lengths.astype(jnp.int32), seq_kv)[:, None]
  q_seg = k_seg = None
  if st.segments:  # Padded queries see nothing (-1 matches no key).
    q_seg = _shapes.pad_axis(q_segment_ids.astype(jnp.int32), 1, tp, value=-1)
    k_seg = _shapes.pad_axis(kv_segment_ids.astype(jnp.int32), 1, sp, value=-2)
  lists = None
  if mask_mod is not None:  # The block mask: built once per call, in XLA.
    dense_lengths = None
    if st.kv_mask:  # key lengths, or S for every row (padded keys closed)
      dense_lengths = jnp.full((batch,), seq_kv, jnp.int32) if kv_len is None else kv_len[:, 0]
    dense = reference.allowed_mask(
        batch, num_heads, tp, sp, is_causal=is_causal,
        segment_ids=None if q_seg is None else (q_seg, k_seg),
        local_window_size=window, mask_mod=mask_mod,
        key_value_seq_lengths=dense_lengths)
    lists = {
        "fwd": masks.tile_lists(dense, config.fwd.block_q, config.fwd.block_k, batch, num_heads),
        "dq": masks.tile_lists(dense, config.dq.block_q, config.dq.block_k, batch, num_heads),
        "dkdv": masks.tile_lists(dense, config.dkdv.block_q, config.dkdv.block_k, batch,
                            num_heads, groups=st.groups),
    }
  return st, (q, k, v, kv_len, q_seg, k_seg, lists)


def forward_with_lse(q, k, v, **options) -> tuple[jax.Array, jax.Array]:
  """The kernels' forward with each row's log-sum-exp, for a caller that
  merges attentions over parts of the keys (ring attention).

  Args:
    q: [B, T, N, H]; k, v: [B, S, K, H].
    **options: `scale`, `is_causal`, `window`, `q_segment_ids`,
      `kv_segment_ids`, `key_value_seq_lengths`, `interpret` and `config`, as
      `flex_attention_pallas` takes them (no mods).

  Returns:
    out [B, T, N, H] f32 and lse [B, N, T] f32: the natural log of the sum of
    exp(scaled logit) over the keys a query sees; -inf (and zeros in out)
    for a query that sees none.
  """
  seq_q, head_dim = q.shape[1], q.shape[3]
  st, (q, k, v, kv_len, q_seg, k_seg, _) = prepare(q, k, v, **options)
  out, lse = _forward(st, q, k, v, kv_len, q_seg, k_seg)
  lse = lse[:, :, :seq_q]  # base 2, +inf for a query that sees no key
  return (out[:, :seq_q, :, :head_dim].astype(jnp.float32),
          jnp.where(lse == jnp.inf, -jnp.inf, lse * math.log(2)))


def backward_with_lse(q, k, v, out, lse, dout, **options) -> tuple[jax.Array, ...]:
  """dq, dk, dv (f32) of the part of an attention that keys `k`, `v` take,
  given the whole attention's rows.

  Args:
    q: [B, T, N, H]; k, v: [B, S, K, H]: the queries and a part of their keys.
    out: [B, T, N, H] and lse: [B, N, T] (natural log, -inf where a query
      sees no key): the attention over every key, of which this part's
      contributions to the gradients are computed, so the parts' gradients
      sum to the whole's.
    dout: [B, T, N, H], the cotangent of `out`.
    **options: as `forward_with_lse`.
  """
  seq_q, seq_kv, head_dim = q.shape[1], k.shape[1], q.shape[3]
  st, (qp, kp, vp, kv_len, q_seg, k_seg, _) = prepare(q, k, v, **options)
  tp, hp = qp.shape[1], qp.shape[3]
  pad = lambda x: _shapes.pad_axis(_shapes.pad_axis(x, 1, tp), 3, hp)
  # The kernels' base-2 statistics; a padded query (zero dout) sees nothing.
  lse = _shapes.pad_axis(jnp.where(lse == -jnp.inf, jnp.inf, lse / math.log(2)), 2, tp,
                         value=jnp.inf)
  grads = _backward(st, qp, kp, vp, kv_len, q_seg, k_seg, None, pad(out.astype(jnp.float32)),
                    lse, pad(dout.astype(q.dtype)))
  return tuple(g[:, :n, :, :head_dim].astype(jnp.float32)
               for g, n in zip(grads, (seq_q, seq_kv, seq_kv)))


def flex_attention_pallas(
    q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
    is_causal: bool, window: tuple[int | None, int | None] | None,
    q_segment_ids: jax.Array | None, kv_segment_ids: jax.Array | None,
    key_value_seq_lengths: jax.Array | None, interpret: bool,
    config: configs.FlexConfig | None = None, mask_mod=None,
    score_mod=None) -> jax.Array:
  """The kernel path of `ops.flex_attention` (inputs already validated).

  Args:
    q: [B, T, N, H]; k, v: [B, S, K, H].
    scale: logit scale.
    is_causal, window: the static part of the mask.
    q_segment_ids: [B, T] int or None; kv_segment_ids: [B, S] int or None.
    key_value_seq_lengths: [B] int or None.
    interpret: run the kernels in Pallas interpret mode.
    config: tiling; default from `configs.get_config`.
    mask_mod: `(b, n, t, s) -> bool` on broadcastable int32 index arrays.
    score_mod: `(score, b, n, t, s) -> score`, elementwise in `score`.

  Returns:
    [B, T, N, H] in q's dtype.
  """
  seq_q, head_dim = q.shape[1], q.shape[3]
  st, args = prepare(q, k, v, scale=scale, is_causal=is_causal, window=window,
                     q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                     key_value_seq_lengths=key_value_seq_lengths, interpret=interpret,
                     config=config, mask_mod=mask_mod, score_mod=score_mod)
  out = _flex_shared(st, *args)
  return out[:, :seq_q, :, :head_dim]
