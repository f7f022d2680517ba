"""Flash attention in Pallas (Triton lowering): forward, dK/dV and dQ kernels.

FlashAttention-2, https://arxiv.org/abs/2307.08691: the forward streams key
tiles through an online softmax and saves the log-sum-exp; the backward
recomputes the probabilities tile by tile from it, in two kernels: one per key
tile that loops over query tiles (dK, dV, and over the G query heads that share
the key/value head, so K/V are never repeated in memory) and one per query tile
that loops over key tiles (dQ). No atomics: every output tile has one writer.

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
    indices).
  * Query tiles run in reverse order so that, under a causal mask, the
    longest programs start first.
"""

import dataclasses
import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from ops import _shapes
from ops.flex_attention import configs

_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything the kernels specialise on (hashable: custom_vjp nondiff arg)."""
  scale: float  # logit scale (natural units)
  left: int | None  # keys s >= t - left are open (None: unbounded)
  right: int | None  # keys s <= t + right are open (causal: 0)
  kv_mask: bool  # key lengths vary or Sp > S: mask s >= kv_len
  segments: bool  # segment ids given
  groups: int  # G query heads per key/value head
  config: configs.FlexConfig
  interpret: bool

  @property
  def any_mask(self) -> bool:
    return (self.left is not None or self.right is not None or self.kv_mask
            or self.segments)


def _div(a, b: int):
  """Floor division of a non-negative traced (or static) int by a static int."""
  if isinstance(a, int):
    return a // b
  return lax.div(a, jnp.int32(b))


def _cdiv(a, b: int):
  return _div(a + (b - 1), b)


def _i32(x):
  return jnp.asarray(x, jnp.int32)


def _exp2(st: _Static, x):
  """2 ** x in f32: one MUFU.EX2 when compiled (flushing denormals to zero).

  `jnp.exp2` lowers to libdevice's `__nv_exp2f`, which adds denormal handling
  around the same instruction; at small head sizes the kernels are bound by
  this per-logit work, so the bare PTX instruction is worth having.
  """
  if st.interpret:
    return jnp.exp2(x)
  [y] = plgpu.elementwise_inline_asm(
      "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return y


def _clip(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def _open(st: _Static, q_idx, k_idx, kv_len, q_seg, k_seg):
  """Boolean tile (broadcast of q_idx and k_idx): may query q_idx see k_idx?"""
  ok = None
  conj = lambda a, b: b if a is None else jnp.logical_and(a, b)
  if st.right is not None:
    ok = conj(ok, k_idx <= q_idx + st.right)
  if st.left is not None:
    ok = conj(ok, k_idx >= q_idx - st.left)
  if st.kv_mask:
    ok = conj(ok, k_idx < kv_len)
  if st.segments:
    ok = conj(ok, q_seg == k_seg)
  return ok


def _key_tiles(st: _Static, q0, bq: int, bk: int, kv_len, seq_kv: int):
  """Key-tile ranges of the query tile at q0: lo <= full_lo <= full_hi <= hi.

  Tiles [lo, full_lo) and [full_hi, hi) are partly masked, [full_lo, full_hi)
  fully open, the rest fully masked (skipped).
  """
  kv_end = kv_len if st.kv_mask else seq_kv
  lo = 0 if st.left is None else _div(jnp.maximum(q0 - st.left, 0), bk)
  hi_key = kv_end
  if st.right is not None:
    hi_key = jnp.minimum(hi_key, q0 + bq + st.right)
  hi = _cdiv(hi_key, bk)
  if st.segments:
    return lo, lo, lo, hi
  full_lo = 0 if st.left is None else _cdiv(jnp.maximum(q0 + bq - 1 - st.left, 0), bk)
  full_key = kv_end
  if st.right is not None:
    full_key = jnp.minimum(full_key, q0 + st.right + 1)
  full_hi = _div(full_key, bk)
  full_lo = _clip(full_lo, lo, hi)
  full_hi = _clip(full_hi, full_lo, hi)
  return lo, full_lo, full_hi, hi


def _query_tiles(st: _Static, k0, bq: int, bk: int, kv_len, seq_q: int):
  """Query-tile ranges of the key tile at k0 (same layout as `_key_tiles`)."""
  lo = 0 if st.right is None else _div(jnp.maximum(k0 - st.right, 0), bq)
  hi_q = seq_q if st.left is None else jnp.minimum(seq_q, k0 + bk + st.left)
  hi = _cdiv(hi_q, bq)
  if st.kv_mask:
    # A key tile past the length: no work. (Scalar `where` operands must be
    # typed: the Triton lowering gives a weak literal the predicate's type.)
    hi = jnp.where(k0 < kv_len, _i32(hi), _i32(lo))
  if st.segments:
    return lo, lo, lo, hi
  full_lo = 0 if st.right is None else _cdiv(jnp.maximum(k0 + bk - 1 - st.right, 0), bq)
  full_hi = seq_q // bq if st.left is None else _div(k0 + st.left + 1, bq)
  if st.kv_mask:
    full_hi = jnp.where(k0 + bk <= kv_len, _i32(full_hi), _i32(0))
  full_lo = _clip(full_lo, lo, hi)
  full_hi = _clip(full_hi, full_lo, hi)
  return lo, full_lo, full_hi, hi


def _three_loops(st: _Static, ranges, body, carry):
  """Runs body(index, carry, masked) over the masked/open/masked ranges."""
  lo, full_lo, full_hi, hi = ranges
  if not st.any_mask:
    return lax.fori_loop(lo, hi, functools.partial(body, masked=False), carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
  carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), carry)
  return lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)


# ----------------------------------------------------------------------------
# Forward.


def _fwd_kernel(q_ref, k_ref, v_ref, kv_len_ref, q_seg_ref, k_seg_ref,
                o_ref, lse_ref, *, st: _Static, num_q_tiles: int):
  bq, hp = q_ref.shape
  bk = st.config.fwd.block_k
  seq_kv = k_ref.shape[0]
  q0 = (num_q_tiles - 1 - pl.program_id(0)) * bq
  c = st.scale * _LOG2E
  q = q_ref[...]  # [bq, Hp]
  kv_len = kv_len_ref[0]
  q_idx = q0 + jnp.arange(bq, dtype=jnp.int32)[:, None]  # [bq, 1]
  q_seg = q_seg_ref[...][:, None] if st.segments else None

  def body(j, carry, masked):
    acc, m, l = carry  # [bq, Hp], [bq], [bq]
    k0 = j * bk
    k = k_ref[pl.ds(k0, bk), :]  # [bk, Hp]
    v = v_ref[pl.ds(k0, bk), :]
    s = plgpu.dot(q, k, trans_b=True)  # [bq, bk] f32
    if masked:
      k_idx = k0 + jnp.arange(bk, dtype=jnp.int32)[None, :]
      k_seg = k_seg_ref[pl.ds(k0, bk)][None, :] if st.segments else None
      s = jnp.where(_open(st, q_idx, k_idx, kv_len, q_seg, k_seg), s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1) * c)  # base-2 running max
    if masked:  # A row with nothing open so far: keep exp2 away from inf - inf.
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    else:
      m_use = m_new
    alpha = _exp2(st, m - m_use)
    p = _exp2(st, s * c - m_use[:, None])  # [bq, bk]
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
    return acc, m_new, l

  carry = (jnp.zeros((bq, hp), jnp.float32),
           jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
  ranges = _key_tiles(st, q0, bq, bk, kv_len, seq_kv)
  acc, m, l = _three_loops(st, ranges, body, carry)
  empty = l == 0.0
  o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
  # Base-2 log-sum-exp of the scaled logits; +inf marks an empty row so that
  # the backward's exp2(s * c - lse) is exactly 0 there.
  lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def _seg_specs(st, q_block, k_block, q_index, k_index):
  if not st.segments:
    return [None, None]
  return [pl.BlockSpec(q_block, q_index), pl.BlockSpec(k_block, k_index)]


def _forward(st: _Static, q, k, v, kv_len, q_seg, k_seg):
  """q [B, Tp, N, Hp], k/v [B, Sp, K, Hp] -> out [B, Tp, N, Hp], lse [B, N, Tp]."""
  batch, seq_q, num_heads, hp = q.shape
  seq_kv = k.shape[1]
  cfg = st.config.fwd
  bq, g = cfg.block_q, st.groups
  nq = seq_q // bq
  rev = lambda i: nq - 1 - i
  in_specs = [
      pl.BlockSpec((None, bq, None, hp), lambda i, b, n: (b, rev(i), n, 0)),
      pl.BlockSpec((None, seq_kv, None, hp), lambda i, b, n: (b, 0, n // g, 0)),
      pl.BlockSpec((None, seq_kv, None, hp), lambda i, b, n: (b, 0, n // g, 0)),
      pl.BlockSpec((None, 1), lambda i, b, n: (b, 0)),
      *_seg_specs(st, (None, bq), (None, seq_kv),
                  lambda i, b, n: (b, rev(i)), lambda i, b, n: (b, 0)),
  ]
  out_specs = [
      pl.BlockSpec((None, bq, None, hp), lambda i, b, n: (b, rev(i), n, 0)),
      pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, rev(i))),
  ]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((batch, num_heads, seq_q), jnp.float32)]
  return pl.pallas_call(
      functools.partial(_fwd_kernel, st=st, num_q_tiles=nq),
      grid=(nq, batch, num_heads), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=st.interpret, name="flex_attention_fwd",
      compiler_params=_params(cfg),
  )(q, k, v, kv_len, q_seg, k_seg)


# ----------------------------------------------------------------------------
# Backward: dK/dV per key tile (all G query heads of its group), dQ per query
# tile. delta = rowsum(dO * O) comes from XLA (one fused elementwise pass).


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kv_len_ref,
                 q_seg_ref, k_seg_ref, dk_ref, dv_ref, *, st: _Static):
  bk, hp = k_ref.shape
  seq_q = q_ref.shape[0]
  bq = st.config.dkdv.block_q
  k0 = pl.program_id(0) * bk
  c = st.scale * _LOG2E
  k = k_ref[...]  # [bk, Hp]
  v = v_ref[...]
  kv_len = kv_len_ref[0]
  k_idx = k0 + jnp.arange(bk, dtype=jnp.int32)[:, None]  # [bk, 1]
  k_seg = k_seg_ref[...][:, None] if st.segments else None
  ranges = _query_tiles(st, k0, bq, bk, kv_len, seq_q)

  def body(i, carry, masked, g):
    dk, dv = carry
    q0 = i * bq
    q = q_ref[pl.ds(q0, bq), g, :]  # [bq, Hp]
    do = do_ref[pl.ds(q0, bq), g, :]
    lse = lse_ref[g, pl.ds(q0, bq)]  # [bq]
    delta = delta_ref[g, pl.ds(q0, bq)]
    s_t = plgpu.dot(k, q, trans_b=True)  # [bk, bq]: logits, transposed
    p_t = _exp2(st, s_t * c - lse[None, :])
    if masked:
      q_idx = q0 + jnp.arange(bq, dtype=jnp.int32)[None, :]
      q_seg = q_seg_ref[pl.ds(q0, bq)][None, :] if st.segments else None
      p_t = jnp.where(_open(st, q_idx, k_idx, kv_len, q_seg, k_seg), p_t, 0.0)
    dv = dv + plgpu.dot(p_t.astype(do.dtype), do)
    dp_t = plgpu.dot(v, do, trans_b=True)  # [bk, bq]
    ds_t = p_t * (dp_t - delta[None, :])
    dk = dk + plgpu.dot(ds_t.astype(q.dtype), q)
    return dk, dv

  carry = (jnp.zeros((bk, hp), jnp.float32), jnp.zeros((bk, hp), jnp.float32))
  for g in range(st.groups):  # The query heads sharing this key/value head.
    carry = _three_loops(st, ranges, functools.partial(body, g=g), carry)
  dk, dv = carry
  dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kv_len_ref,
               q_seg_ref, k_seg_ref, dq_ref, *, st: _Static, num_q_tiles: int):
  bq, hp = q_ref.shape
  seq_kv = k_ref.shape[0]
  bk = st.config.dq.block_k
  q0 = (num_q_tiles - 1 - pl.program_id(0)) * bq
  c = st.scale * _LOG2E
  q = q_ref[...]  # [bq, Hp]
  do = do_ref[...]
  lse = lse_ref[...][:, None]  # [bq, 1]
  delta = delta_ref[...][:, None]
  kv_len = kv_len_ref[0]
  q_idx = q0 + jnp.arange(bq, dtype=jnp.int32)[:, None]
  q_seg = q_seg_ref[...][:, None] if st.segments else None

  def body(j, dq, masked):
    k0 = j * bk
    k = k_ref[pl.ds(k0, bk), :]  # [bk, Hp]
    v = v_ref[pl.ds(k0, bk), :]
    s = plgpu.dot(q, k, trans_b=True)  # [bq, bk]
    p = _exp2(st, s * c - lse)
    if masked:
      k_idx = k0 + jnp.arange(bk, dtype=jnp.int32)[None, :]
      k_seg = k_seg_ref[pl.ds(k0, bk)][None, :] if st.segments else None
      p = jnp.where(_open(st, q_idx, k_idx, kv_len, q_seg, k_seg), p, 0.0)
    dp = plgpu.dot(do, v, trans_b=True)  # [bq, bk]
    ds = p * (dp - delta)
    return dq + plgpu.dot(ds.astype(k.dtype), k)

  ranges = _key_tiles(st, q0, bq, bk, kv_len, seq_kv)
  dq = _three_loops(st, ranges, body, jnp.zeros((bq, hp), jnp.float32))
  dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _params(cfg: configs.KernelConfig):
  return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _delta(out, dout):
  """rowsum(dO * O) in f32, [B, Tp, N, Hp] -> [B, N, Tp]."""
  delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
  return jnp.transpose(delta, (0, 2, 1))


def _dkdv_call(st: _Static, q, k, v, kv_len, q_seg, k_seg, lse, delta, dout):
  """dK, dV: grid over key tiles; q, dO, lse, delta of the whole head group."""
  batch, seq_q, _, hp = q.shape
  seq_kv, num_kv = k.shape[1], k.shape[2]
  g, cfg = st.groups, st.config.dkdv
  bk = cfg.block_k
  grouped = lambda x: x.reshape(batch, seq_q, num_kv, g, hp)  # free reshape
  per_group = lambda x: x.reshape(batch, num_kv, g, seq_q)
  kv_spec = pl.BlockSpec((None, bk, None, hp), lambda j, b, h: (b, j, h, 0))
  group_spec = pl.BlockSpec((None, seq_q, None, g, hp), lambda j, b, h: (b, 0, h, 0, 0))
  row_spec = pl.BlockSpec((None, None, g, seq_q), lambda j, b, h: (b, h, 0, 0))
  in_specs = [group_spec, kv_spec, kv_spec, group_spec, row_spec, row_spec,
              pl.BlockSpec((None, 1), lambda j, b, h: (b, 0)),
              *_seg_specs(st, (None, seq_q), (None, bk),
                          lambda j, b, h: (b, 0), lambda j, b, h: (b, j))]
  return pl.pallas_call(
      functools.partial(_dkdv_kernel, st=st),
      grid=(seq_kv // bk, batch, num_kv), in_specs=in_specs,
      out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      interpret=st.interpret, name="flex_attention_dkdv",
      compiler_params=_params(cfg),
  )(grouped(q), k, v, grouped(dout), per_group(lse), per_group(delta), kv_len,
    q_seg, k_seg)


def _dq_call(st: _Static, q, k, v, kv_len, q_seg, k_seg, lse, delta, dout):
  """dQ: grid over query tiles, loop over key tiles (the forward's ranges)."""
  batch, seq_q, num_heads, hp = q.shape
  seq_kv = k.shape[1]
  g, cfg = st.groups, st.config.dq
  bq = cfg.block_q
  nq = seq_q // bq
  rev = lambda i: nq - 1 - i
  q_spec = pl.BlockSpec((None, bq, None, hp), lambda i, b, n: (b, rev(i), n, 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, rev(i)))
  kv_full = pl.BlockSpec((None, seq_kv, None, hp), lambda i, b, n: (b, 0, n // g, 0))
  in_specs = [q_spec, kv_full, kv_full, q_spec, row_spec, row_spec,
              pl.BlockSpec((None, 1), lambda i, b, n: (b, 0)),
              *_seg_specs(st, (None, bq), (None, seq_kv),
                          lambda i, b, n: (b, rev(i)), lambda i, b, n: (b, 0))]
  return pl.pallas_call(
      functools.partial(_dq_kernel, st=st, num_q_tiles=nq),
      grid=(nq, batch, num_heads), in_specs=in_specs, out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      interpret=st.interpret, name="flex_attention_dq",
      compiler_params=_params(cfg),
  )(q, k, v, dout, lse, delta, kv_len, q_seg, k_seg)


def _backward(st: _Static, q, k, v, kv_len, q_seg, k_seg, out, lse, dout):
  delta = _delta(out, dout)
  args = (st, q, k, v, kv_len, q_seg, k_seg, lse, delta, dout)
  dk, dv = _dkdv_call(*args)
  return _dq_call(*args), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flex(st, q, k, v, kv_len, q_seg, k_seg):
  return _forward(st, q, k, v, kv_len, q_seg, k_seg)[0]


def _flex_fwd(st, q, k, v, kv_len, q_seg, k_seg):
  out, lse = _forward(st, q, k, v, kv_len, q_seg, k_seg)
  return out, (q, k, v, kv_len, q_seg, k_seg, out, lse)


def _flex_bwd(st, residuals, dout):
  q, k, v, kv_len, q_seg, k_seg, out, lse = residuals
  dq, dk, dv = _backward(st, q, k, v, kv_len, q_seg, k_seg, out, lse, dout)
  return dq, dk, dv, None, None, None


_flex.defvjp(_flex_fwd, _flex_bwd)


def _fit(cfg: configs.KernelConfig, seq_q: int, seq_kv: int) -> configs.KernelConfig:
  """Shrinks tiles that are longer than the (power-of-two rounded) sequence."""
  fit = lambda block, n: min(block, max(16, pl.next_power_of_2(n)))
  return dataclasses.replace(cfg, block_q=fit(cfg.block_q, seq_q),
                             block_k=fit(cfg.block_k, seq_kv))


def prepare(q, k, v, *, scale: float, is_causal: bool, window,
            q_segment_ids, kv_segment_ids, kv_seq_lengths, interpret: bool,
            config: configs.FlexConfig | None = None):
  """Pads to tile multiples and fixes the static description of the call.

  Returns:
    (static, (q [B, Tp, N, Hp], k, v [B, Sp, K, Hp], kv_len [B, 1],
    q_seg [B, Tp] | None, k_seg [B, Sp] | None)).
  """
  batch, seq_q, num_heads, head_dim = q.shape
  seq_kv, num_kv = k.shape[1], k.shape[2]
  hp = max(16, pl.next_power_of_2(head_dim))
  if config is None:
    config = configs.get_config(hp, q.dtype, interpret=interpret)
  config = configs.FlexConfig(*(_fit(c, seq_q, seq_kv)
                                for c in (config.fwd, config.dkdv, config.dq)))
  q_multiple = max(c.block_q for c in (config.fwd, config.dkdv, config.dq))
  k_multiple = max(c.block_k for c in (config.fwd, config.dkdv, config.dq))
  tp, sp = _shapes.round_up(seq_q, q_multiple), _shapes.round_up(seq_kv, k_multiple)

  left, right = (None, None) if window is None else window
  if is_causal:
    right = 0 if right is None else min(right, 0)
  st = _Static(scale=float(scale), left=left, right=right,
               kv_mask=kv_seq_lengths is not None or sp != seq_kv,
               segments=q_segment_ids is not None, groups=num_heads // num_kv,
               config=config, interpret=interpret)

  pad = lambda x, n: _shapes.pad_axis(_shapes.pad_axis(x, 1, n), 3, hp)
  q, k, v = pad(q, tp), pad(k, sp), pad(v, sp)
  if kv_seq_lengths is None:
    kv_len = jnp.full((batch, 1), seq_kv, jnp.int32)
  else:
    kv_len = jnp.minimum(kv_seq_lengths.astype(jnp.int32), seq_kv)[:, None]
  q_seg = k_seg = None
  if st.segments:  # Padded queries see nothing (-1 matches no key).
    q_seg = _shapes.pad_axis(q_segment_ids.astype(jnp.int32), 1, tp, value=-1)
    k_seg = _shapes.pad_axis(kv_segment_ids.astype(jnp.int32), 1, sp, value=-2)
  return st, (q, k, v, kv_len, q_seg, k_seg)


def flex_attention_pallas(
    q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
    is_causal: bool, window: tuple[int | None, int | None] | None,
    q_segment_ids: jax.Array | None, kv_segment_ids: jax.Array | None,
    kv_seq_lengths: jax.Array | None, interpret: bool,
    config: configs.FlexConfig | None = None) -> jax.Array:
  """The kernel path of `ops.flex_attention` (inputs already validated).

  Args:
    q: [B, T, N, H]; k, v: [B, S, K, H].
    scale: logit scale.
    is_causal, window: the static part of the mask.
    q_segment_ids: [B, T] int or None; kv_segment_ids: [B, S] int or None.
    kv_seq_lengths: [B] int or None.
    interpret: run the kernels in Pallas interpret mode.
    config: tiling; default from `configs.get_config`.

  Returns:
    [B, T, N, H] in q's dtype.
  """
  seq_q, head_dim = q.shape[1], q.shape[3]
  st, args = prepare(q, k, v, scale=scale, is_causal=is_causal, window=window,
                     q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                     kv_seq_lengths=kv_seq_lengths, interpret=interpret,
                     config=config)
  out = _flex(st, *args)
  return out[:, :seq_q, :, :head_dim]
