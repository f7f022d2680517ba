"""Pallas (Triton) kernels for SSD, forward and backward.

Same algorithm as the chunked XLA tier (xla.py), split so that every launch
keeps its per-chunk intermediates (the [L, L] score and decay matrices, the
state tile) in registers and only chunk-boundary states touch memory:

Forward, two launches (three with chunk groups):
1. states: one program per (batch, head, K tile, V tile, group of chunks)
   walks its chunks in order with the state tile in registers, `H_{c+1} =
   exp(b_L) H_c + (K * exp(b_L - b))^T V`, writing the state *entering*
   every chunk ([B, N, C, K, V], input dtype) and the final state (float32).
   The walk is serial, so the chunks are split into groups until there are
   about a thousand programs: a summary launch gives each group's end state
   from zero, and each group then starts from the fold of the groups before
   it (as the scan kernels' chunks do).
2. output: one program per (batch, head, chunk, V tile), all in parallel:
   `Y = ((Q K^T) * exp(b_i - b_j) [i >= j]) V + exp(b) * (Q H_c)`.

Backward, three launches (four with chunk groups):
1. states, reversed: the adjoint `dH_c = exp(b_L) dH_{c+1} + (Q * exp(b))^T dY`
   with the same kernel walking the chunks backwards from `dfinal`, writing
   the adjoint of the state *leaving* every chunk; its end is d initial_state.
2. chunk gradients of the keys' side, one program per (batch, head, chunk,
   K tile): dQ and dK of the tile's columns, from `dS = (dY V^T) * decay`,
   and the tile's share of the gradient of the chunk-local cumulative
   log-decay `b`: `db_i = q_i . dq_i - k_i . dk_i` plus, at the chunk's last
   position, `exp(b_L) <dH_{c+1}, H_c> + sum_j k_j . dk_j^{state}` (the
   shares are summed by XLA).
3. chunk gradients of the values' side, one program per (batch, head, chunk,
   V tile): `dV = S^T dY + exp(b_L - b) * (K dH_{c+1})` with `S = (Q K^T) *
   decay`.
   One program for all of a chunk's gradients held five [L, 128] float32
   accumulators and two [128, 128] state tiles at K = V = 128, and was half
   of the backward's time; split by tiles, each program holds two.

The chunk-local cumulative sum `b` of `log_decay` is formed (and differentiated)
by XLA around the kernels; its cost is one pass over [B, T, N].

Glossary of shapes: B batch, T time, N heads, G query/key groups, K key size,
V value size, C chunks, L tokens per chunk (`chunk`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import _backend
from ops import _pallas
from ops import _shapes
from ops._rows import pick_row
from ops._triton import causal_decay
from ops._triton import dot
from ops._triton import is_pow2
from ops._triton import next_pow2
from ops.ssd import configs
from ops.ssd import varlen
from ops.ssd.xla import chunk_cumsum

_F32 = jnp.float32
MAX_HEAD_SIZE = 256


def _states_kernel(x_ref, y_ref, b_ref, h0_ref, *refs, chunk, num_chunks,
                   group_size, reverse, mode, fold=False, packed=False):
  """Walks one group of `group_size` chunks with a [bk, bv] state tile in
  registers.

  Forward (`reverse=False`): x = K, y = V, h <- exp(b_L) h + (x exp(b_L - b))^T y.
  Backward (`reverse=True`): x = Q, y = dY, h <- exp(b_L) h + (x exp(b))^T y.
  Groups are counted in processing order (descending chunks when `reverse`).
  mode 'summary': the group from a zero state; writes its end tile.
  mode 'apply': folds the summaries of the groups before it into `h0` (when
  `fold`: inputs (ends, decays) after h0), walks the group and writes
  `out_ref[c]`, the tile *before* chunk c is folded in, and the group's end
  tile.
  `packed` (sequences packed on the chunks, `ops/ssd/varlen.py`): h0 holds
  one tile per sequence, inputs (resets, exits) [C] follow it, and the walk
  restarts from `h0[s]` where sequence s enters and (mode 'apply') writes the
  tile leaving its last chunk to a last output, one tile per sequence.
  """
  refs = list(refs)
  resets_ref, exits_ref = (refs.pop(0), refs.pop(0)) if packed else (None, None)
  ends_ref, decays_ref = (refs.pop(0), refs.pop(0)) if fold else (None, None)
  out_ref = refs.pop(0) if mode == "apply" else None
  end_ref = refs.pop(0)
  seq_out_ref = refs.pop(0) if packed and mode == "apply" else None
  group = pl.program_id(4)
  start = group * group_size
  stop = jnp.minimum(start + group_size, num_chunks)

  def body(step, h):
    c = num_chunks - 1 - step if reverse else step
    if packed:
      h = varlen.enter(resets_ref, h0_ref, c, h)
    if out_ref is not None:
      out_ref[c] = h.astype(out_ref.dtype)
    rows = pl.ds(c * chunk, chunk)
    x = x_ref[rows, :]                                          # [L, bk]
    y = y_ref[rows, :]                                          # [L, bv]
    b = b_ref[rows]                                             # [L]
    b_last = pick_row(b, chunk - 1)    # the chunk's total log-decay
    w = jnp.exp(b) if reverse else jnp.exp(b_last - b)          # [L]
    xw = (x.astype(_F32) * w[:, None]).astype(y.dtype)
    h = jnp.exp(b_last) * h + dot(xw, y, trans_a=True)         # [bk, bv]
    if seq_out_ref is not None:
      varlen.leave(exits_ref, seq_out_ref, c, h)
    return h

  if mode == "apply":
    def fold_group(k, h):  # the summary of group k < this one
      return jnp.exp(decays_ref[pl.ds(k, 1)]) * h + ends_ref[k]
    # Packed, the first chunk restarts the walk from its sequence's tile.
    h = jnp.zeros(end_ref.shape, _F32) if packed else h0_ref[...].astype(_F32)
    if fold:
      h = jax.lax.fori_loop(0, group, fold_group, h)
  else:
    h = jnp.zeros(end_ref.shape, _F32)
  end_ref[...] = jax.lax.fori_loop(start, stop, body, h)


def _output_kernel(q_ref, k_ref, v_ref, b_ref, h_ref, y_ref, *, chunk):
  """One chunk, one V tile: intra-chunk part plus the entering state's part."""
  q, k, v = q_ref[...], k_ref[...], v_ref[...]                  # [L, K], [L, K], [L, bv]
  b = b_ref[...]                                                # [L]
  scores = dot(q, k, trans_b=True) * causal_decay(b, chunk)   # [L, L]
  y = dot(scores.astype(v.dtype), v)                           # [L, bv]
  y += jnp.exp(b)[:, None] * dot(q, h_ref[...].astype(q.dtype))
  y_ref[...] = y.astype(y_ref.dtype)


def _chunk_grad_keys_kernel(q_ref, k_ref, v_ref, b_ref, h_ref, dh_ref, dy_ref,
                            dq_ref, dk_ref, db_ref, *, chunk):
  """One chunk, one K tile: dQ, dK of its columns and its share of d(b)."""
  q, k, v, dy = q_ref[...], k_ref[...], v_ref[...], dy_ref[...]  # [L, bk] x2, [L, V] x2
  dtype = v.dtype
  h, dh = h_ref[...].astype(dtype), dh_ref[...].astype(dtype)    # [bk, V]
  b = b_ref[...]                                                 # [L]
  b_last = pick_row(b, chunk - 1)    # the chunk's total log-decay
  dscores = (dot(dy, v, trans_b=True) * causal_decay(b, chunk)).astype(dtype)
  w_state = jnp.exp(b_last - b)[:, None]                         # [L, 1]
  dq = dot(dscores, k) + jnp.exp(b)[:, None] * dot(dy, h, trans_b=True)
  dk_state = w_state * dot(v, dh, trans_b=True)                 # [L, bk]
  dk = dot(dscores, q, trans_a=True) + dk_state
  qf, kf = q.astype(_F32), k.astype(_F32)
  db = jnp.sum(qf * dq, axis=1) - jnp.sum(kf * dk, axis=1)       # [L]
  total = lambda x: jnp.sum(jnp.sum(x, axis=1), axis=0)          # one axis at a time
  end = (jnp.exp(b_last) * total(h.astype(_F32) * dh.astype(_F32))
         + total(kf * dk_state))
  idx = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  db_ref[...] = db + jnp.where(idx == chunk - 1, end, 0.0)
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)


def _chunk_grad_values_kernel(q_ref, k_ref, b_ref, dh_ref, dy_ref, dv_ref, *, chunk):
  """One chunk, one V tile: dV of its columns."""
  q, k, dy = q_ref[...], k_ref[...], dy_ref[...]                 # [L, K] x2, [L, bv]
  dtype = dy.dtype
  b = b_ref[...]                                                 # [L]
  b_last = pick_row(b, chunk - 1)
  scores = (dot(q, k, trans_b=True) * causal_decay(b, chunk)).astype(dtype)
  w_state = jnp.exp(b_last - b)[:, None]                         # [L, 1]
  dv = dot(scores, dy, trans_a=True) + w_state * dot(k, dh_ref[...].astype(dtype))
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _state_groups(programs: int, num_chunks: int, target: int) -> tuple[int, int]:
  """(groups, chunks per group): enough groups of chunks for about `target`
  programs in all, since each program's walk over its chunks is serial."""
  groups = min(num_chunks, max(1, _shapes.cdiv(target, programs)))
  group_size = _shapes.cdiv(num_chunks, groups)
  return _shapes.cdiv(num_chunks, group_size), group_size


def _states(x, y, b, h0, *, heads, blocks, reverse, packed=None):
  """x [B, T, G, K], y [B, T, N, V], b [B, N, T], h0 [B, N, K, V] f32 ->
  (per-chunk tiles [B, N, C, K, V] in y's dtype, end [B, N, K, V] f32).

  The chunks are walked in groups (one program per group and state tile),
  two launches as for the scans: each group's end state from zero, then
  each group again from the fold of the groups before it. `packed`: the
  sequences' (starts, ends) [C] (`ops/ssd/varlen.py`); then B = 1, h0 and the
  end are [S, N, K, V], one state per sequence (reversed: the final states'
  adjoints in, the initial states' out).
  """
  batch, time, groups, key = x.shape
  value = y.shape[-1]
  rep = heads // groups
  bk, bv, chunk = blocks.state_block_k, blocks.state_block_v, blocks.chunk
  num_chunks = time // chunk
  num_groups, group_size = _state_groups(
      batch * heads * (key // bk) * (value // bv), num_chunks, blocks.state_programs)
  grid = (batch, heads, key // bk, value // bv, num_groups)
  state_spec = pl.BlockSpec((None, None, bk, bv), lambda i, n, a, c, g: (i, n, a, c))
  in_specs = [
      pl.BlockSpec((None, time, None, bk), lambda i, n, a, c, g: (i, 0, n // rep, a)),
      pl.BlockSpec((None, time, None, bv), lambda i, n, a, c, g: (i, 0, n, c)),
      pl.BlockSpec((None, None, time), lambda i, n, a, c, g: (i, n, 0)),
      state_spec,
  ]
  walk_inputs = (x, y, b, h0)
  if packed is not None:
    # Forward a sequence enters at its first chunk; reversed, at its last.
    seq_starts, seq_ends = packed
    resets, exits = (seq_ends, seq_starts) if reverse else (seq_starts, seq_ends)
    num_seqs = h0.shape[0]
    state_spec = pl.BlockSpec((num_seqs, None, bk, bv), lambda i, n, a, c, g: (0, n, a, c))
    in_specs[3] = state_spec
    in_specs += [varlen.per_chunk_spec(num_chunks)] * 2
    walk_inputs += (resets, exits)
  group_tile = pl.BlockSpec((None, None, None, bk, bv),
                            lambda i, n, a, c, g: (i, n, g, a, c))
  group_tiles = jax.ShapeDtypeStruct((batch, heads, num_groups, key, value), _F32)
  call = functools.partial(
      _pallas.pallas_call, grid=grid,
      compiler_params=plgpu.CompilerParams(num_warps=blocks.state_num_warps,
                                           num_stages=2),
      interpret=_backend.pallas_interpret())
  kernel = functools.partial(_states_kernel, chunk=chunk, num_chunks=num_chunks,
                             group_size=group_size, reverse=reverse,
                             packed=packed is not None)
  name = "ssd_states_reverse" if reverse else "ssd_states"
  extra, extra_specs = (), []
  if num_groups > 1:
    ends = call(functools.partial(kernel, mode="summary"), in_specs=in_specs,
                out_specs=group_tile, out_shape=group_tiles,
                name=name + "_summary")(*walk_inputs)
    # Each group's decay, exp(sum of its chunks' log-decays), in processing
    # order; a chunk where a sequence enters passes nothing from before it.
    chunk_decay = b.reshape(batch, heads, num_chunks, chunk)[..., -1]
    if packed is not None:
      chunk_decay = jnp.where(resets >= 0, -jnp.inf, chunk_decay)
    if reverse:
      chunk_decay = chunk_decay[..., ::-1]
    decays = _shapes.pad_axis(chunk_decay, 2, group_size).reshape(
        batch, heads, num_groups, group_size).sum(-1)
    extra = (ends, decays)
    extra_specs = [
        pl.BlockSpec((None, None, num_groups, bk, bv), lambda i, n, a, c, g: (i, n, 0, a, c)),
        pl.BlockSpec((None, None, num_groups), lambda i, n, a, c, g: (i, n, 0)),
    ]
  out_specs = [pl.BlockSpec((None, None, num_chunks, bk, bv),
                            lambda i, n, a, c, g: (i, n, 0, a, c)), group_tile]
  out_shape = [jax.ShapeDtypeStruct((batch, heads, num_chunks, key, value), y.dtype),
               group_tiles]
  if packed is not None:
    out_specs.append(state_spec)
    out_shape.append(jax.ShapeDtypeStruct(h0.shape, _F32))
  tiles, ends, *seq_states = call(
      functools.partial(kernel, mode="apply", fold=bool(extra)),
      in_specs=in_specs + extra_specs, out_specs=out_specs, out_shape=out_shape,
      name=name)(*walk_inputs, *extra)
  return tiles, (seq_states[0] if seq_states else ends[:, :, -1])


def _output(q, k, v, b, states, *, blocks):
  batch, time, groups, key = q.shape
  heads, value = v.shape[2], v.shape[3]
  rep = heads // groups
  chunk, bv = blocks.chunk, blocks.output_block_v
  grid = (batch, heads, time // chunk, value // bv)
  qk_spec = pl.BlockSpec((None, chunk, None, key), lambda i, n, c, e: (i, c, n // rep, 0))
  v_spec = pl.BlockSpec((None, chunk, None, bv), lambda i, n, c, e: (i, c, n, e))
  return _pallas.pallas_call(
      functools.partial(_output_kernel, chunk=chunk),
      grid=grid,
      in_specs=[qk_spec, qk_spec, v_spec,
                pl.BlockSpec((None, None, chunk), lambda i, n, c, e: (i, n, c)),
                pl.BlockSpec((None, None, None, key, bv),
                             lambda i, n, c, e: (i, n, c, 0, e))],
      out_specs=v_spec,
      out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=2),
      interpret=_backend.pallas_interpret(),
      name="ssd_output")(q, k, v, b, states)


def _chunk_grads(q, k, v, b, states, dstates, dy, *, blocks):
  batch, time, groups, key = q.shape
  heads, value = v.shape[2], v.shape[3]
  rep = heads // groups
  chunk, bk, bv = blocks.chunk, blocks.grad_block_k, blocks.grad_block_v
  k_tiles, v_tiles = key // bk, value // bv
  params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=1)
  b_spec = pl.BlockSpec((None, None, chunk), lambda i, n, c, t: (i, n, c))
  full_v = pl.BlockSpec((None, chunk, None, value), lambda i, n, c, t: (i, c, n, 0))
  # Shared q/k: per-head partial gradients in float32, summed over the group outside.
  dqk_dtype = q.dtype if rep == 1 else _F32
  key_tile = pl.BlockSpec((None, chunk, None, bk), lambda i, n, c, t: (i, c, n // rep, t))
  state_rows = pl.BlockSpec((None, None, None, bk, value), lambda i, n, c, t: (i, n, c, t, 0))
  head_key_tile = pl.BlockSpec((None, chunk, None, bk), lambda i, n, c, t: (i, c, n, t))
  dq, dk, db_shares = _pallas.pallas_call(
      functools.partial(_chunk_grad_keys_kernel, chunk=chunk),
      grid=(batch, heads, time // chunk, k_tiles),
      in_specs=[key_tile, key_tile, full_v, b_spec, state_rows, state_rows, full_v],
      out_specs=[head_key_tile, head_key_tile,
                 pl.BlockSpec((None, None, None, chunk), lambda i, n, c, t: (i, n, t, c))],
      out_shape=[jax.ShapeDtypeStruct((batch, time, heads, key), dqk_dtype),
                 jax.ShapeDtypeStruct((batch, time, heads, key), dqk_dtype),
                 jax.ShapeDtypeStruct((batch, heads, k_tiles, time), _F32)],
      compiler_params=params,
      interpret=_backend.pallas_interpret(),
      name="ssd_chunk_grads_keys")(q, k, v, b, states, dstates, dy)
  full_qk = pl.BlockSpec((None, chunk, None, key), lambda i, n, c, t: (i, c, n // rep, 0))
  v_tile = pl.BlockSpec((None, chunk, None, bv), lambda i, n, c, t: (i, c, n, t))
  dv = _pallas.pallas_call(
      functools.partial(_chunk_grad_values_kernel, chunk=chunk),
      grid=(batch, heads, time // chunk, v_tiles),
      in_specs=[full_qk, full_qk, b_spec,
                pl.BlockSpec((None, None, None, key, bv), lambda i, n, c, t: (i, n, c, 0, t)),
                v_tile],
      out_specs=v_tile,
      out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
      compiler_params=params,
      interpret=_backend.pallas_interpret(),
      name="ssd_chunk_grads_values")(q, k, b, dstates, dy)
  return dq, dk, dv, db_shares.sum(axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ssd_core(q, k, v, b, h0, packed, blocks):
  """Padded inputs: q, k [B, T, G, K], v [B, T, N, V], b [B, N, T] f32, h0 f32
  ([S, N, K, V] with `packed`, the sequences' (starts, ends) [C] int32, or None)."""
  y, final, _ = _core_forward(q, k, v, b, h0, packed, blocks)
  return y, final


def _core_forward(q, k, v, b, h0, packed, blocks):
  heads = v.shape[2]
  states, final = _states(k, v, b, h0, heads=heads, blocks=blocks, reverse=False,
                          packed=packed)
  y = _output(q, k, v, b, states, blocks=blocks)
  return y, final, states


def _core_fwd(q, k, v, b, h0, packed, blocks):
  y, final, states = _core_forward(q, k, v, b, h0, packed, blocks)
  return (y, final), (q, k, v, b, states, packed, _pallas.type_tokens(q, k, v, b, h0))


def _core_bwd(blocks, residuals, cotangents):
  q, k, v, b, states, packed, tokens = residuals
  dy, dfinal = cotangents
  heads = v.shape[2]
  groups = q.shape[2]
  dy = dy.astype(v.dtype)
  dstates, dh0 = _states(q, dy, b, dfinal.astype(_F32), heads=heads, blocks=blocks,
                         reverse=True, packed=packed)
  dq, dk, dv, db = _chunk_grads(q, k, v, b, states, dstates, dy, blocks=blocks)
  if groups != heads:
    batch, time, _, key = q.shape
    fold = lambda d: d.reshape(batch, time, groups, heads // groups, key).sum(3)
    dq, dk = fold(dq), fold(dk)
  return _pallas.typed_like((dq.astype(q.dtype), dk.astype(k.dtype), dv, db, dh0),
                            tokens) + (None,)


_ssd_core.defvjp(_core_fwd, _core_bwd)
_ssd_core_shared = _pallas.shared_lowering(_ssd_core, static_argnums=(6,))


def ssd_pallas(q, k, v, log_decay, *, initial_state=None, chunk_size=None,
               cu_seqlens=None, blocks: configs.TritonConfig | None = None):
  """Same contract as `ssd_reference`, on the Pallas kernels.

  Pads T to a multiple of the chunk (log-decay 0, zero keys and values: the
  padded steps leave the state unchanged) and K, V to powers of two >= 16.
  With `cu_seqlens` each sequence sits on chunks of its own and the walks
  restart at each (`ops/ssd/varlen.py`).
  """
  batch, time, heads, value = v.shape
  key = q.shape[-1]
  if blocks is None:
    blocks = configs.TritonConfig.get_default(time, key, value, chunk_size)
  elif chunk_size is not None and chunk_size != blocks.chunk:
    raise ValueError(f"`chunk_size` {chunk_size} disagrees with {blocks.chunk=}")
  chunk = blocks.chunk
  key_p, value_p = max(16, next_pow2(key)), max(16, next_pow2(value))
  blocks = dataclasses.replace(
      blocks, state_block_k=min(blocks.state_block_k, key_p),
      state_block_v=min(blocks.state_block_v, value_p),
      output_block_v=min(blocks.output_block_v, value_p),
      grad_block_k=min(blocks.grad_block_k, key_p),
      grad_block_v=min(blocks.grad_block_v, value_p))
  dtype = v.dtype
  lay, (q, k, v, log_decay) = varlen.on_chunks(cu_seqlens, chunk, q, k, v, log_decay)
  pad = lambda x, size: _shapes.pad_axis(_shapes.pad_axis(x, 1, chunk), 3, size)
  q_p = pad(q.astype(dtype), key_p)
  k_p = pad(k.astype(dtype), key_p)
  v_p = pad(v, value_p)
  g = _shapes.pad_axis(log_decay, 1, chunk)                       # [B, Tp, N]
  b = chunk_cumsum(g, chunk).reshape(g.shape)                     # [B, Tp, N] f32
  b = jnp.swapaxes(b, 1, 2)                                       # [B, N, Tp]
  h0 = (jnp.zeros((varlen.num_states(batch, cu_seqlens), heads, key_p, value_p), _F32) if initial_state is None
        else _shapes.pad_axis(_shapes.pad_axis(initial_state.astype(_F32), 2, key_p),
                              3, value_p))
  packed = None if lay is None else (lay.starts, lay.ends)
  y, final = _ssd_core_shared(q_p, k_p, v_p, b, h0, packed, blocks)
  return varlen.off_chunks(y[..., :value], lay, time), final[:, :, :key, :value]
