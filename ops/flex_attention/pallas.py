"""Flash attention in Pallas (Triton lowering): the forward, the custom VJP, `prepare`.

FlashAttention-2, https://arxiv.org/abs/2307.08691: the forward streams key
tiles through an online softmax and saves the log-sum-exp; the backward
recomputes the probabilities tile by tile from it (the Triton dK/dV and dQ
kernels of `triton_backward.py`, or the Mosaic GPU one of
`mosaic_backward.py`). `prepare` pads a call to the tiles and fixes its static
description (`triton_common.Static`, which all the kernels take); the block
specs and the `exp2` both Triton directions use live in `triton_common.py` too.

Glossary of shapes: B batch, T query tokens (padded: Tp), S key/value tokens
(padded: Sp), N query heads, K key/value heads, G = N // K, H head size
(padded to a power of two >= 16: Hp), bq / bk the query / key tile sizes.

Speed notes:
  * Logits are kept in base 2: the scale and log2(e) fold into one multiply,
    so each logit costs one FMA and one `exp2`.
  * The key-tile loop of every program is split in three: tiles the mask
    (causal, window, key length, segments) leaves partly open run a masked
    body; tiles it leaves fully open run a body without any mask arithmetic;
    tiles it closes are never visited (the loop bounds come from the block
    indices; `masks.py`).
  * Query tiles run in reverse order so that, under a causal mask, the
    longest programs start first.
  * `exp2` is the bare `ex2.approx.ftz.f32` instruction when compiled.
  * With `fwd_softmax='first_tile_max'` (the table's default on Hopper for
    16-bit inputs) the forward keeps the row maxima of its first fully open
    key tile for the other open tiles: no maxima, no rescaling and (16-bit)
    row sums on the tensor cores there; rows whose logits pass those maxima
    by far get a second, online pass ("The first-tile maxima" below).

`mask_mod(b, n, t, s)` and `score_mod(score, b, n, t, s)` run inside the
kernels on tile indices. With a `mask_mod`, the loops follow per-program lists
of fully open and of partly masked tiles, computed once per call in XLA from
the dense mask (`masks.tile_lists`); tiles on neither list are never visited.
`score_mod` rewrites the scaled f32 logits in all three kernels (the backward
ones trace its pullback: `triton_backward.py`).
"""

import dataclasses
import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from ops import _pallas
from ops import _shapes
from ops.flex_attention import configs
from ops.flex_attention import masks
from ops.flex_attention import mosaic
from ops.flex_attention import mosaic_backward
from ops.flex_attention import reference
from ops.flex_attention import triton_backward
from ops.flex_attention.triton_common import compiler_params
from ops.flex_attention.triton_common import exp2
from ops.flex_attention.triton_common import key_length_spec
from ops.flex_attention.triton_common import LOG2E
from ops.flex_attention.triton_common import query_tile_specs
from ops.flex_attention.triton_common import seg_specs
from ops.flex_attention.triton_common import Static
from ops.flex_attention.triton_common import whole_kv_spec


def _rows(kv_len):
  """[B, 1] key lengths -> [B] (None stays None), for the Mosaic GPU kernels."""
  return None if kv_len is None else kv_len[:, 0]


def _score(st: Static, s, b, n, q_idx, k_idx):
  """Logits in base-2 units and their multiplier: (s, c) with p = 2^(s * c - m)."""
  if st.score_mod is None:
    return s, st.scale * LOG2E
  s = st.score_mod(s * st.scale, b, n, q_idx, k_idx).astype(jnp.float32)
  return s, LOG2E


# ----------------------------------------------------------------------------
# Forward.


# The first-tile maxima ('first_tile_max', FlexConfig.fwd_softmax). The
# online softmax makes every tile wait for its row maxima (a reduction across
# threads) before its exponentials, and rescales the accumulator whenever one
# grows. Any per-row reference works in place of the running maximum, as
# long as 2^(s c - m) stays in range: the forwards take the row maxima of
# their first fully open key tile (every row has a finite one there) and
# keep them for the other open tiles, where p = 2^(s c - m) may pass 1 but
# the largest p is >= 1, so nothing underflows that matters. Partly masked
# tiles keep the online body (from the frozen m: still exact), except on the
# Mosaic forward with `MosaicConfig.frozen_masked_tiles`, where those
# after the first open tile run on the kept maxima too. A row whose
# sum reaches masks.FROZEN_SUM_LIMIT (a later logit 44 or more base-2 units
# above its first tile's maximum, for up to 2^20 keys; inf or NaN on
# overflow) gets a NaN lse, and `_refresh_frozen` recomputes its query tile
# with the online softmax in a second launch; with `FlexConfig.refresh =
# 'in_kernel'` the Triton forward instead reruns such a tile online at its end
# (a branch almost never taken; no second launch). Calls with a `score_mod`
# keep the online softmax (`_fwd_softmax`): a positional bias makes that
# branch the rule.


def _fwd_kernel(q_ref, k_ref, v_ref, kv_len_ref, q_seg_ref, k_seg_ref, lists,
                o_ref, lse_ref, *, st: Static, num_q_tiles: int, ids=None,
                list_row=None):
  # `ids`: the (query tile, batch, head) ids of the tile, given by a caller
  # that runs this under a condition (interpret mode reads them at the top
  # only); `list_row`: the tile's row of [nq, .] `lists` (None: this program's
  # lists are the tile's).
  i, b, n = ids or (pl.program_id(0), pl.program_id(1), pl.program_id(2))
  bq, hp = q_ref.shape
  bk = st.config.fwd.block_k
  seq_kv = k_ref.shape[0]
  q0 = (num_q_tiles - 1 - i) * bq
  q = q_ref[...]  # [bq, Hp]
  kv_len = masks.key_length(st, kv_len_ref, 0)
  q_idx = q0 + jnp.arange(bq, dtype=jnp.int32)[:, None]  # [bq, 1]
  q_seg = q_seg_ref[...][:, None] if st.segments else None

  def logits(j, masked):
    """Tile j's base-2 logits s (masked: -inf where closed), its values, and
    the multiplier c: p = 2^(s * c - m)."""
    k0 = j * bk
    k = k_ref[pl.ds(k0, bk), :]  # [bk, Hp]
    v = v_ref[pl.ds(k0, bk), :]
    s = plgpu.dot(q, k, trans_b=True)  # [bq, bk] f32
    k_idx = k0 + jnp.arange(bk, dtype=jnp.int32)[None, :]
    s, c = _score(st, s, b, n, q_idx, k_idx)
    if masked:
      k_seg = k_seg_ref[pl.ds(k0, bk)][None, :] if st.segments else None
      s = jnp.where(masks.is_open(st, q_idx, k_idx, kv_len, q_seg, k_seg, b, n), s, -jnp.inf)
    return s, v, c

  def body(j, carry, masked):
    acc, m, l = carry  # [bq, Hp], [bq], [bq]
    s, v, c = logits(j, masked)
    m_new = jnp.maximum(m, jnp.max(s, axis=1) * c)  # base-2 running max
    if masked or st.score_mod is not None:
      # A row with nothing open so far (or a score_mod's -inf everywhere so
      # far): keep exp2 away from inf - inf.
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    else:
      m_use = m_new
    alpha = exp2(st, m - m_use)
    p = exp2(st, s * c - m_use[:, None])  # [bq, bk]
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
    return acc, m_new, l

  # Row sums of the frozen tiles on the tensor cores: P @ ones gives every
  # column the sum, so a tile needs no reduction across threads (16 columns:
  # the smallest dot). f32 inputs keep the f32 sum.
  sum_by_mma = q.dtype.itemsize == 2
  ones = jnp.ones((bk, 16), q.dtype) if sum_by_mma else None

  def frozen_body(j, carry, m):
    """An open tile against the frozen row maxima m: no max, no rescale."""
    acc, l = carry
    s, v, c = logits(j, masked=False)
    p = exp2(st, s * c - m[:, None])  # [bq, bk]; > 1 where a logit passes m
    pv = p.astype(v.dtype)
    l = l + (plgpu.dot(pv, ones) if sum_by_mma else jnp.sum(p, axis=1))
    return acc + plgpu.dot(pv, v), l

  carry = (jnp.zeros((bq, hp), jnp.float32),
           jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
  ranges = None if lists else masks.key_tiles(st, q0, bq, bk, kv_len, seq_kv)
  frozen = st.config.keeps_first_tile_max
  if not frozen:
    acc, m, l = masks.tile_loop(st, ranges, lists, body, carry, list_row)
  else:
    count, tile = masks.open_tiles(st, ranges, lists, list_row)
    first = jnp.minimum(count, 1)
    acc, m, l = lax.fori_loop(0, first, lambda t, c: body(tile(t), c, masked=False), carry)
    l_rest = jnp.zeros((bq, 16) if sum_by_mma else (bq,), jnp.float32)
    acc, l_rest = lax.fori_loop(first, count, lambda t, c: frozen_body(tile(t), c, m),
                                (acc, l_rest))
    l = l + (jnp.max(l_rest, axis=1) if sum_by_mma else l_rest)  # (16 equal columns)
    acc, m, l = masks.masked_tile_loop(st, ranges, lists, body, (acc, m, l), list_row)
    if _refreshes_in_kernel(st):  # a row past the limit: the tile again, online
      past = jnp.max(jnp.where(l < masks.FROZEN_SUM_LIMIT, 0.0, 1.0)) > 0.0
      acc, m, l = lax.cond(past, lambda: masks.tile_loop(st, ranges, lists, body, carry,
                                                         list_row),
                           lambda: (acc, m, l))
  empty = l == 0.0
  o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
  # Base-2 log-sum-exp of the scaled logits; +inf marks an empty row so that
  # the backward's exp2(s * c - lse) is exactly 0 there.
  lse = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))
  if frozen and not _refreshes_in_kernel(st):  # NaN: rows `_refresh_frozen` recomputes.
    lse = jnp.where(l < masks.FROZEN_SUM_LIMIT, lse, jnp.nan)
  lse_ref[...] = lse

def _forward(st: Static, q, k, v, kv_len, q_seg, k_seg, lists=None):
  """q [B, Tp, N, Hp], k/v [B, Sp, K, Hp] -> out [B, Tp, N, Hp], lse [B, N, Tp]."""
  if st.config.mosaic_fwd is not None:
    out, lse = mosaic.forward(st, q, k, v, _rows(kv_len), config=st.config.mosaic_fwd,
                              key_tiles=functools.partial(masks.key_tiles, st),
                              is_open=lambda q_idx, k_idx, kv_len: masks.is_open(
                                  st, q_idx, k_idx, kv_len, None, None),
                              interpret=st.interpret)
  else:
    out, lse = _triton_forward(st, q, k, v, kv_len, q_seg, k_seg, lists)
  if st.config.keeps_first_tile_max and not _refreshes_in_kernel(st):
    out, lse = _refresh_frozen(st, q, k, v, kv_len, q_seg, k_seg, lists, out, lse)
  return out, lse


def _refreshes_in_kernel(st: Static) -> bool:
  """Whether the forward recomputes rows past the first-tile maxima's limit
  inside its kernel (the Triton one, `refresh='in_kernel'`) rather than in
  `_refresh_frozen`'s second launch."""
  return st.config.refresh == "in_kernel" and st.config.mosaic_fwd is None


def _refresh_frozen(st: Static, q, k, v, kv_len, q_seg, k_seg, lists, out, lse):
  """Recomputes, with the online softmax, the query tiles of `_forward`'s
  first-tile-maxima pass that hold a NaN lse; the others keep their rows.

  One launch over (tile groups, B, N): each program reads the lse of its
  group of consecutive query tiles (`FlexConfig.refresh_tiles_per_program`,
  or the largest power of two below it that divides their number) in one
  load, so a call with nothing to recompute runs few short programs, and
  reruns the Triton forward's walk on those with a NaN one after another
  (out and lse aliased to the outputs).
  """
  st = dataclasses.replace(
      st, config=dataclasses.replace(st.config, fwd_softmax="online", mosaic_fwd=None))
  batch, seq_q, num_heads, hp = q.shape
  seq_kv = k.shape[1]
  nq = seq_q // st.config.fwd.block_q
  per = math.gcd(nq, st.config.refresh_tiles_per_program)  # groups of equal size
  rows = pl.BlockSpec((None, seq_q, None, hp), lambda c, b, n: (b, 0, n, 0))
  lse_rows = pl.BlockSpec((None, None, seq_q), lambda c, b, n: (b, n, 0))
  kv = whole_kv_spec(st, seq_kv, hp)
  list_specs = None
  if lists is not None:  # every tile's lists of the (batch, head): [nq, .]
    list_specs = tuple(pl.BlockSpec((None, None, nq, x.shape[-1]), lambda c, b, n: (b, n, 0, 0))
                       for x in lists)
  in_specs = [rows, lse_rows, rows, kv, kv, key_length_spec(kv_len, lambda c, b, n: (b, 0)),
              *seg_specs(st, (None, seq_q), (None, seq_kv),
                          lambda c, b, n: (b, 0), lambda c, b, n: (b, 0)),
              list_specs]
  return _pallas.pallas_call(
      functools.partial(_refresh_kernel, st=st, num_q_tiles=nq, per=per),
      grid=(nq // per, batch, num_heads), in_specs=in_specs,
      out_specs=[rows, lse_rows],
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (out, lse)],
      input_output_aliases={0: 0, 1: 1}, interpret=st.interpret,
      name="flex_attention_fwd_refresh", compiler_params=compiler_params(st.config.fwd),
  )(out, lse, q, k, v, kv_len, q_seg, k_seg, lists)


def _refresh_kernel(out_in_ref, lse_in_ref, q_ref, k_ref, v_ref, kv_len_ref, q_seg_ref,
                    k_seg_ref, lists, o_ref, lse_ref, *, st: Static, num_q_tiles: int,
                    per: int):
  del out_in_ref  # the output's buffer: rows not recomputed keep their values
  c, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bq = st.config.fwd.block_q

  # One load for the group's flags (a load per tile in the loop would wait
  # for each in turn), as bits of one integer.
  lse = lse_in_ref[pl.ds(pl.multiple_of(c * per * bq, per * bq), per * bq)]
  flags = jnp.max(jnp.where(jnp.isnan(lse.reshape(per, bq)), 1, 0), axis=1)  # [per]
  bits = jnp.sum(flags * (1 << jnp.arange(per, dtype=jnp.int32)))

  def visit(t, carry):
    row = c * per + t  # the tile's row; the forward's program index is reversed
    rows = pl.ds(pl.multiple_of(row * bq, bq), bq)
    pl.when(((bits >> t) & 1) == 1)(lambda: _fwd_kernel(
        q_ref.at[rows], k_ref, v_ref, kv_len_ref,
        None if q_seg_ref is None else q_seg_ref.at[rows], k_seg_ref, lists,
        o_ref.at[rows], lse_ref.at[rows], st=st, num_q_tiles=num_q_tiles,
        ids=(num_q_tiles - 1 - row, b, n), list_row=row))
    return carry

  lax.fori_loop(0, per, visit, 0)


def _triton_forward(st: Static, q, k, v, kv_len, q_seg, k_seg, lists):
  """The Triton forward: out [B, Tp, N, Hp], lse [B, N, Tp]."""
  batch, seq_q, num_heads, hp = q.shape
  seq_kv = k.shape[1]
  cfg = st.config.fwd
  specs = query_tile_specs(st, kv_len, lists, seq_q=seq_q, seq_kv=seq_kv,
                           block_q=cfg.block_q, hp=hp)
  nq = specs.num_q_tiles
  kv_full = whole_kv_spec(st, seq_kv, hp)
  out_specs = [specs.q, specs.rows]
  in_specs = [specs.q, kv_full, kv_full, *specs.masks]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((batch, num_heads, seq_q), jnp.float32)]
  return _pallas.pallas_call(
      functools.partial(_fwd_kernel, st=st, num_q_tiles=nq),
      grid=(nq, batch, num_heads), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=st.interpret, name="flex_attention_fwd",
      compiler_params=compiler_params(cfg),
  )(q, k, v, kv_len, q_seg, k_seg, lists)


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
