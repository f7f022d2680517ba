"""Flash attention's Triton forward (Pallas, Triton lowering).

FlashAttention-2, https://arxiv.org/abs/2307.08691: the forward streams key
tiles through an online softmax and saves the log-sum-exp; the backward
recomputes the probabilities tile by tile from it (`triton_backward.py`).
`pallas.py` picks, per call, this forward or the Mosaic GPU one (`mosaic.py`)
and puts them under the custom VJP. The block specs and the `exp2` both
Triton directions use live in `triton_common.py`; `Static` (`static.py`) is
the call's static description.

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
from ops.flex_attention import masks
from ops.flex_attention.static import Static
from ops.flex_attention.triton_common import compiler_params
from ops.flex_attention.triton_common import exp2
from ops.flex_attention.triton_common import key_length_spec
from ops.flex_attention.triton_common import LOG2E
from ops.flex_attention.triton_common import query_tile_specs
from ops.flex_attention.triton_common import seg_specs
from ops.flex_attention.triton_common import whole_kv_spec


def _score(st: Static, s, b, n, q_idx, k_idx):
  """Logits in base-2 units and their multiplier: (s, c) with p = 2^(s * c - m)."""
  if st.score_mod is None:
    return s, st.scale * LOG2E
  s = st.score_mod(s * st.scale, b, n, q_idx, k_idx).astype(jnp.float32)
  return s, LOG2E


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
# overflow) gets a NaN lse, and `refresh_frozen` recomputes its query tile
# with the online softmax in a second launch; with `FlexConfig.refresh =
# 'in_kernel'` the Triton forward instead reruns such a tile online at its end
# (a branch almost never taken; no second launch). Calls with a `score_mod`
# keep the online softmax (`pallas._fwd_softmax`): a positional bias makes that
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
    if refreshes_in_kernel(st):  # a row past the limit: the tile again, online
      past = jnp.max(jnp.where(l < masks.FROZEN_SUM_LIMIT, 0.0, 1.0)) > 0.0
      acc, m, l = lax.cond(past, lambda: masks.tile_loop(st, ranges, lists, body, carry,
                                                         list_row),
                           lambda: (acc, m, l))
  empty = l == 0.0
  o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
  # Base-2 log-sum-exp of the scaled logits; +inf marks an empty row so that
  # the backward's exp2(s * c - lse) is exactly 0 there.
  lse = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))
  if frozen and not refreshes_in_kernel(st):  # NaN: rows `refresh_frozen` recomputes.
    lse = jnp.where(l < masks.FROZEN_SUM_LIMIT, lse, jnp.nan)
  lse_ref[...] = lse


def forward(st: Static, q, k, v, kv_len, q_seg, k_seg, lists):
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


def refreshes_in_kernel(st: Static) -> bool:
  """Whether the forward recomputes rows past the first-tile maxima's limit
  inside its kernel (the Triton one, `refresh='in_kernel'`) rather than in
  `refresh_frozen`'s second launch."""
  return st.config.refresh == "in_kernel" and st.config.mosaic_fwd is None


def refresh_frozen(st: Static, q, k, v, kv_len, q_seg, k_seg, lists, out, lse):
  """Recomputes, with the online softmax, the query tiles of a forward's
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
