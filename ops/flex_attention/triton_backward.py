"""Flash attention's Triton backward (Pallas, Triton lowering): dK/dV and dQ.

FlashAttention-2, https://arxiv.org/abs/2307.08691: the forward (`triton.py`)
saves the base-2 log-sum-exp of every query row; the backward recomputes the
probabilities tile by tile from it, in two kernels: one per key tile that loops
over query tiles (dK, dV, and over the G query heads that share the key/value
head, so K/V are never repeated in memory) and one per query tile that loops
over key tiles (dQ). No atomics: every output tile has one writer. delta =
rowsum(dO * O) comes from XLA (`compute_delta`, one fused elementwise pass).
`pallas._backward` runs these two launches unless the Mosaic GPU backward
(`mosaic_backward.py`) takes the call.

Glossary of shapes (as in `triton.py`): B batch, T query tokens (padded: Tp), S
key/value tokens (padded: Sp), N query heads, K key/value heads, G = N // K, H
head size (padded to a power of two >= 16: Hp), bq / bk the query / key tile
sizes.

The loops skip the tiles the mask closes and run the fully open ones without
mask arithmetic, as the forward's do (`masks.tile_loop`; with a `mask_mod`, the
per-program lists of `masks.tile_lists`). With a `score_mod`, both kernels
trace its pullback (`jax.vjp`) in place to turn dP into dS.
"""

import functools

import jax
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


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kv_len_ref,
                 q_seg_ref, k_seg_ref, lists, dk_ref, dv_ref, *, st: Static):
  bk, hp = k_ref.shape
  seq_q = q_ref.shape[0]
  bq = st.config.dkdv.block_q
  k0 = pl.program_id(0) * bk
  c = st.scale * LOG2E
  k = k_ref[...]  # [bk, Hp]
  v = v_ref[...]
  kv_len = masks.key_length(st, kv_len_ref, 0)
  k_idx = k0 + jnp.arange(bk, dtype=jnp.int32)[:, None]  # [bk, 1]
  k_seg = k_seg_ref[...][:, None] if st.segments else None
  ranges = None if lists else masks.query_tiles(st, k0, bq, bk, kv_len, seq_q)
  b, kv_head = pl.program_id(1), pl.program_id(2)  # (Read outside loops.)

  def body(i, carry, masked, g):
    dk, dv = carry
    n = kv_head * st.groups + g
    q0 = i * bq
    q = q_ref[pl.ds(q0, bq), g, :]  # [bq, Hp]
    do = do_ref[pl.ds(q0, bq), g, :]
    lse = lse_ref[g, pl.ds(q0, bq)]  # [bq]
    delta = delta_ref[g, pl.ds(q0, bq)]
    s_t = plgpu.dot(k, q, trans_b=True)  # [bk, bq]: logits, transposed
    q_idx = q0 + jnp.arange(bq, dtype=jnp.int32)[None, :]
    if st.score_mod is None:
      p_t = exp2(st, s_t * c - lse[None, :])
    else:  # Keep the pullback of score_mod for dS.
      mod = lambda x: st.score_mod(x, b, n, q_idx, k_idx).astype(jnp.float32)
      z_t, mod_vjp = jax.vjp(mod, s_t * st.scale)
      p_t = exp2(st, z_t * LOG2E - lse[None, :])
    if masked:
      q_seg = q_seg_ref[pl.ds(q0, bq)][None, :] if st.segments else None
      p_t = jnp.where(masks.is_open(st, q_idx, k_idx, kv_len, q_seg, k_seg, b, n), p_t, 0.0)
    dv = dv + plgpu.dot(p_t.astype(do.dtype), do)
    dp_t = plgpu.dot(v, do, trans_b=True)  # [bk, bq]
    ds_t = p_t * (dp_t - delta[None, :])
    if st.score_mod is not None:
      ds_t = mod_vjp(ds_t)[0]
    dk = dk + plgpu.dot(ds_t.astype(q.dtype), q)
    return dk, dv

  carry = (jnp.zeros((bk, hp), jnp.float32), jnp.zeros((bk, hp), jnp.float32))
  for g in range(st.groups):  # The query heads sharing this key/value head.
    carry = masks.tile_loop(st, ranges, lists, functools.partial(body, g=g), carry, group=g)
  dk, dv = carry
  dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kv_len_ref,
               q_seg_ref, k_seg_ref, lists, dq_ref, *, st: Static, num_q_tiles: int):
  bq, hp = q_ref.shape
  seq_kv = k_ref.shape[0]
  bk = st.config.dq.block_k
  q0 = (num_q_tiles - 1 - pl.program_id(0)) * bq
  c = st.scale * LOG2E
  q = q_ref[...]  # [bq, Hp]
  do = do_ref[...]
  lse = lse_ref[...][:, None]  # [bq, 1]
  delta = delta_ref[...][:, None]
  kv_len = masks.key_length(st, kv_len_ref, 0)
  q_idx = q0 + jnp.arange(bq, dtype=jnp.int32)[:, None]
  q_seg = q_seg_ref[...][:, None] if st.segments else None
  b, n = pl.program_id(1), pl.program_id(2)

  def body(j, dq, masked):
    k0 = j * bk
    k = k_ref[pl.ds(k0, bk), :]  # [bk, Hp]
    v = v_ref[pl.ds(k0, bk), :]
    s = plgpu.dot(q, k, trans_b=True)  # [bq, bk]
    k_idx = k0 + jnp.arange(bk, dtype=jnp.int32)[None, :]
    if st.score_mod is None:
      p = exp2(st, s * c - lse)
    else:  # Keep the pullback of score_mod for dS.
      mod = lambda x: st.score_mod(x, b, n, q_idx, k_idx).astype(jnp.float32)
      z, mod_vjp = jax.vjp(mod, s * st.scale)
      p = exp2(st, z * LOG2E - lse)
    if masked:
      k_seg = k_seg_ref[pl.ds(k0, bk)][None, :] if st.segments else None
      p = jnp.where(masks.is_open(st, q_idx, k_idx, kv_len, q_seg, k_seg, b, n), p, 0.0)
    dp = plgpu.dot(do, v, trans_b=True)  # [bq, bk]
    ds = p * (dp - delta)
    if st.score_mod is not None:
      ds = mod_vjp(ds)[0]
    return dq + plgpu.dot(ds.astype(k.dtype), k)

  ranges = None if lists else masks.key_tiles(st, q0, bq, bk, kv_len, seq_kv)
  dq = masks.tile_loop(st, ranges, lists, body, jnp.zeros((bq, hp), jnp.float32))
  dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def compute_delta(out, dout):
  """rowsum(dO * O) in f32, [B, Tp, N, Hp] -> [B, N, Tp]."""
  delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
  return jnp.transpose(delta, (0, 2, 1))


def dkdv_call(st: Static, q, k, v, kv_len, q_seg, k_seg, lse, delta, dout,
               lists=None):
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
              key_length_spec(kv_len, lambda j, b, h: (b, 0)),
              *seg_specs(st, (None, seq_q), (None, bk),
                          lambda j, b, h: (b, 0), lambda j, b, h: (b, j))]
  if lists is None:
    in_specs.append(None)
  else:  # [B, K, G, nk, 1] counts, [B, K, G, nk, nq] indices.
    count = pl.BlockSpec((None, None, g, None, 1), lambda j, b, h: (b, h, 0, j, 0))
    index = pl.BlockSpec((None, None, g, None, lists[1].shape[-1]),
                         lambda j, b, h: (b, h, 0, j, 0))
    in_specs.append((count, index, count, index))
  return _pallas.pallas_call(
      functools.partial(_dkdv_kernel, st=st),
      grid=(seq_kv // bk, batch, num_kv), in_specs=in_specs,
      out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      interpret=st.interpret, name="flex_attention_dkdv",
      compiler_params=compiler_params(cfg),
  )(grouped(q), k, v, grouped(dout), per_group(lse), per_group(delta), kv_len,
    q_seg, k_seg, lists)


def dq_call(st: Static, q, k, v, kv_len, q_seg, k_seg, lse, delta, dout,
             lists=None):
  """dQ: grid over query tiles, loop over key tiles (the forward's ranges)."""
  batch, seq_q, num_heads, hp = q.shape
  seq_kv = k.shape[1]
  cfg = st.config.dq
  specs = query_tile_specs(st, kv_len, lists, seq_q=seq_q, seq_kv=seq_kv,
                           block_q=cfg.block_q, hp=hp)
  nq, q_spec = specs.num_q_tiles, specs.q
  kv_full = whole_kv_spec(st, seq_kv, hp)
  in_specs = [q_spec, kv_full, kv_full, q_spec, specs.rows, specs.rows, *specs.masks]
  return _pallas.pallas_call(
      functools.partial(_dq_kernel, st=st, num_q_tiles=nq),
      grid=(nq, batch, num_heads), in_specs=in_specs, out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      interpret=st.interpret, name="flex_attention_dq",
      compiler_params=compiler_params(cfg),
  )(q, k, v, dout, lse, delta, kv_len, q_seg, k_seg, lists)
