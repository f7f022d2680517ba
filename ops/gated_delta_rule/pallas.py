"""The Pallas implementation of the gated delta rule: the custom VJP over the
Triton kernels (`triton.py`, whose docstring lists the launches) and the
Mosaic GPU kernels that replace some of them, chosen per call.

On Hopper at padded K = V = 128 (16-bit, chunks of 16 to 32) both state walks
run on Mosaic GPU kernels instead (mosaic.py, `configs.TritonConfig.mosaic_walk`):
the forward walk forms Y itself (the Triton states and output launches in one;
the states and U go to memory only for a gradient), and the reverse walk forms
`S^T` itself. In the backward at padded K = V = 128 (16-bit) the key gradients
run on a Mosaic GPU kernel instead (mosaic_key_grads.py,
`TritonConfig.mosaic_key_grads`; it forms `T^T dU` itself), reading the value
gradients' [L, L] adjoints as one [2L, 2L] block; with chunks of 32 (the
default) and a key per head, both gradient launches run as one Mosaic GPU
kernel instead (mosaic_grads.py, `TritonConfig.mosaic_grads`), which reads
each chunk once.

Glossary of shapes: B batch, T time, N heads, G query/key groups, K key size,
V value size, C chunks, L tokens per chunk.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ops import _backend
from ops import _pallas
from ops import _shapes
from ops._triton import next_pow2
from ops.gated_delta_rule import configs
from ops.gated_delta_rule import mosaic
from ops.gated_delta_rule import mosaic_grads
from ops.gated_delta_rule import mosaic_key_grads
from ops.gated_delta_rule import triton
from ops.gated_delta_rule.reference import no_gate
from ops.ssd import varlen
from ops.ssd.xla import chunk_cumsum

_F32 = jnp.float32
MAX_HEAD_SIZE = 256
MAX_MEASURED_HEAD_SIZE = 128  # `implementation=None` takes the kernels up to this K, V


def _core_forward(q, k, v, b, beta, h0, packed, scale, blocks, *, residuals):
  """(y, final state, the backward's residuals when `residuals`, else None)."""
  w, u_tilde, *t = triton.prepare(k, v, b, beta, blocks, save_inverse=residuals)
  if blocks.mosaic_walk:
    # The Mosaic walk forms Y on its way (no output kernel, and no states in
    # memory unless the backward reads them); the reverse walk forms S^T itself.
    y, final, saved = mosaic.walk_forward(q, k, w, u_tilde, b, h0, chunk=blocks.chunk,
                                          scale=scale, residuals=residuals,
                                          interpret=_backend.pallas_interpret())
    if not residuals:
      return y, final, None
    states, u = saved
    return y, final, (w, u, t[0], states, None)
  states, u, final = triton.states(k, w, u_tilde, b, h0, blocks, packed)
  y, *scores_t = triton.output(q, k, u, b, states, scale, blocks, save_scores=residuals)
  if not residuals:
    return y, final, None
  return y, final, (w, u, t[0], states, scores_t[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _gdr_core(q, k, v, b, beta, h0, packed, scale, blocks):
  """Padded: q, k [B, T, G, K], v [B, T, N, V], b/beta [B, N, T] f32, h0 f32
  ([S, N, K, V] with `packed`, the sequences' (starts, ends) [C] int32, or None)."""
  y, final, _ = _core_forward(q, k, v, b, beta, h0, packed, scale, blocks,
                              residuals=False)
  return y, final


def _core_fwd(q, k, v, b, beta, h0, packed, scale, blocks):
  y, final, saved = _core_forward(q, k, v, b, beta, h0, packed, scale, blocks,
                                  residuals=True)
  return (y, final), (q, k, v, b, beta, packed,
                      _pallas.type_tokens(q, k, v, b, beta, h0)) + saved


def _core_bwd(scale, blocks, residuals, cotangents):
  q, k, v, b, beta, packed, tokens, w, u, tt, states, scores = residuals
  dy, dfinal = cotangents
  dy = dy.astype(v.dtype)
  dfinal = dfinal.astype(_F32)
  if blocks.mosaic_walk:  # forms the scores itself (`scores` is None)
    dstates, du, dh0 = mosaic.walk_reverse(q, k, w, dy, b, dfinal, chunk=blocks.chunk,
                                           scale=scale, interpret=_backend.pallas_interpret())
  else:
    dstates, du, dh0 = triton.states_bwd(q, k, w, dy, b, scores, dfinal, scale, blocks,
                                         packed)
  if blocks.mosaic_grads:
    dq, dk, dv, db, dbeta = mosaic_grads.chunk_grads(
        q, k, v, u, du, dy, tt, b, beta, states, dstates, scale=scale,
        interpret=_backend.pallas_interpret())
  elif blocks.mosaic_key_grads:
    dv, pairs, db, dbeta = triton.value_grads(q, k, v, u, du, dy, b, beta, tt, scale,
                                              blocks, pairs=True)
    dq, dk, db_keys, dbeta_keys = mosaic_key_grads.key_grads(
        q, k, u, du, tt, dy, b, beta, pairs, states, dstates, chunk=blocks.chunk, scale=scale,
        interpret=_backend.pallas_interpret())
  else:
    dv, dru, dsd, dkk, db, dbeta = triton.value_grads(q, k, v, u, du, dy, b, beta, tt,
                                                      scale, blocks)
    dq, dk, db_keys, dbeta_keys = triton.key_grads(q, k, u, dru, dy, b, beta, dsd, dkk,
                                                   states, dstates, scale, blocks)
  if not blocks.mosaic_grads:  # the value and key kernels' shares
    db, dbeta = db + db_keys.sum(0), dbeta + dbeta_keys.sum(0)
  groups, heads = q.shape[2], v.shape[2]
  if groups != heads:
    batch, time, _, key = q.shape
    fold = lambda d: d.reshape(batch, time, groups, heads // groups, key).sum(3)
    dq, dk = fold(dq), fold(dk)
  return _pallas.typed_like((dq.astype(q.dtype), dk.astype(k.dtype), dv, db, dbeta, dh0),
                            tokens) + (None,)


_gdr_core.defvjp(_core_fwd, _core_bwd)
_gdr_core_shared = _pallas.shared_lowering(_gdr_core, static_argnums=(7, 8))


def gated_delta_rule_pallas(q, k, v, log_decay, beta, *, scale=None, initial_state=None,
                            chunk_size=None, cu_seqlens=None,
                            blocks: configs.TritonConfig | None = None):
  """`gated_delta_rule_reference`'s contract without its input options (the
  public op applies them), on the Pallas kernels.

  Pads T to a multiple of the chunk (log-decay 0, beta 0, zero k and v: the
  padded steps leave the state unchanged) and K, V to powers of two >= 16.
  With `cu_seqlens` each sequence sits on chunks of its own and the Triton
  walks restart at each (`ops/ssd/varlen.py`; not the Mosaic walks).
  """
  log_decay = no_gate(log_decay, beta)
  batch, time, heads, value = v.shape
  key = q.shape[-1]
  scale = float(key ** -0.5 if scale is None else scale)
  if blocks is None:
    blocks = configs.TritonConfig.get_default(time, key, value, chunk_size)
  elif chunk_size is not None and chunk_size != blocks.chunk:
    raise ValueError(f"`chunk_size` {chunk_size} disagrees with {blocks.chunk=}")
  chunk = blocks.chunk
  key_p, value_p = max(16, next_pow2(key)), max(16, next_pow2(value))
  # From here on state_block_v is set (the kernels read it as it is).
  blocks = dataclasses.replace(
      blocks, block_v=min(blocks.block_v, value_p),
      state_block_v=min(blocks.state_block_v or blocks.block_v, value_p),
      grad_block_k=min(blocks.grad_block_k, key_p))
  dtype = v.dtype
  if blocks.mosaic_walk is None:
    blocks = dataclasses.replace(blocks, mosaic_walk=cu_seqlens is None and mosaic.takes(
        dtype, key_p, value_p, chunk))
  elif blocks.mosaic_walk and (why := "not with `cu_seqlens`" if cu_seqlens is not None
                               else mosaic.limit(dtype, key_p, value_p, chunk)):
    raise ValueError(f"`blocks.mosaic_walk`: {why}")
  if blocks.mosaic_grads is None:
    # Heads sharing keys make its dQ, dK float32 and its row ring half as
    # deep: slower than the two kernels there (BUILD_NOTES.md).
    blocks = dataclasses.replace(blocks, mosaic_grads=(
        blocks.mosaic_walk and not blocks.mosaic_key_grads and q.shape[2] == heads
        and mosaic_grads.limit(dtype, key_p, value_p, chunk) is None))
  elif blocks.mosaic_grads and (why := mosaic_grads.limit(dtype, key_p, value_p, chunk)):
    raise ValueError(f"`blocks.mosaic_grads`: {why}")
  if blocks.mosaic_key_grads is None:
    blocks = dataclasses.replace(blocks,
                                 mosaic_key_grads=blocks.mosaic_walk and not blocks.mosaic_grads)
  elif blocks.mosaic_key_grads and (why := mosaic.limit(dtype, key_p, value_p, chunk)):
    raise ValueError(f"`blocks.mosaic_key_grads`: {why}")
  lay, (q, k, v, log_decay, beta) = varlen.on_chunks(cu_seqlens, chunk, q, k, v, log_decay,
                                                     beta)
  pad = lambda x, size: _shapes.pad_axis(_shapes.pad_axis(x, 1, chunk), 3, size)
  q_p, k_p = pad(q.astype(dtype), key_p), pad(k.astype(dtype), key_p)
  v_p = pad(v, value_p)
  g = _shapes.pad_axis(log_decay, 1, chunk)                       # [B, Tp, N]
  b = jnp.swapaxes(chunk_cumsum(g, chunk).reshape(g.shape), 1, 2)  # [B, N, Tp] f32
  beta_p = jnp.swapaxes(_shapes.pad_axis(beta.astype(_F32), 1, chunk), 1, 2)
  h0 = (jnp.zeros((varlen.num_states(batch, cu_seqlens), heads, key_p, value_p), _F32) if initial_state is None
        else _shapes.pad_axis(_shapes.pad_axis(initial_state.astype(_F32), 2, key_p),
                              3, value_p))
  packed = None if lay is None else (lay.starts, lay.ends)
  y, final = _gdr_core_shared(q_p, k_p, v_p, b, beta_p, h0, packed, scale, blocks)
  return varlen.off_chunks(y[..., :value], lay, time), final[:, :, :key, :value]
