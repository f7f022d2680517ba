"""Pallas kernels for the selective scan, forward and backward.

The state `h` ([block_d, S] per program) lives in registers and never goes to
memory as a sequence; each program owns `block_d` channels of one batch row
and one chunk of `chunk` time steps, and walks through its chunk one step at
a time, `unroll` steps per loop iteration (a *tile*): the tile's rows are
loaded first, then `h <- exp(delta A) h + delta u B` runs row by row,
elementwise on the [block_d, S] state, so the serial chain is one
multiply-add per step and only the reductions over S or over channels cross
threads. (A tile-wide associative scan moves its operands through shared
memory several times per step and was bound by that traffic: BUILD_NOTES.md,
"SSM scans".) Positions are counted in *processing order* (descending time when
`reverse`), so the same kernels serve both directions.

Forward, two launches:
1. summary: each chunk runs from a zero state; it writes its end state and
   the sum of its `delta`s (the chunk's decay is `exp(A sum delta)`).
2. apply: each chunk folds the summaries of the chunks before it into its
   start state, runs again, writes `y_t = h_t C_t` and, when a gradient is
   needed, the state before every tile (the checkpoints, `[B, T / unroll,
   D, S]`, `unroll` times smaller than the state sequence).

Backward, two launches in the opposite order of time, on the adjoint
`c_t = dL/dh_t = a_{t+1} c_{t+1} + dy_t C_t` (`a = exp(delta A)`; `t+1` the
next step in forward order, read from a copy of `delta` shifted by one):
1. summary: each chunk's adjoint from zero (it reads only `C`, `dy`, `delta`).
2. apply: each chunk folds the later chunks' summaries into its adjoint;
   each tile (last first) recomputes its states from its checkpoint
   (forward over its rows), walks its rows backward with the adjoint and
   forms du, ddelta, dB and dC (per channel block, summed outside) and dA
   (per program, summed outside) from the two. Each row's decay `a_t` serves
   twice: in `a_t h_{t-1}` (a product, not `h_t - delta_t u_t B_t`, which
   cancels under strong decay) and as the adjoint's multiplier one row
   earlier, so only a chunk's last row reads the shifted `delta`. The adjoint
   of the initial state is `a_first c_first`, formed outside.

With a single chunk the summary launches are skipped. Without a final state
(`return_final_state=False`) the apply launch writes no end states and the
backward starts its adjoint from zero instead of reading `dfinal`.

`B` and `C` each come per step ([B, T, S], read as a [1, S] row per step),
per group ([B, T, G, S], the channel block's group chosen by the index map)
or time-invariant ([D, S], a [block_d, S] block read once per program, whose
gradient is summed per program like dA's).

Glossary of shapes: B batch, T time, D channels, S state size, C chunks,
K checkpoints (= T / unroll).
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
from ops._rows import tile_steps
from ops.selective_scan import configs
from ops.selective_scan.step import finish_output
from ops.selective_scan.step import prepare_delta
from ops._triton import next_pow2

_F32 = jnp.float32


def _rows(ref, steps):
  """`ref`'s rows at `steps` (from `tile_steps`), float32. Every load of a
  tile is issued before any of its arithmetic and stores: a load after a
  store cannot be moved above it (the compiler cannot prove the buffers
  apart), so loading row by row would pay a memory latency per step."""
  return [ref[t, :].astype(_F32) for t in steps]


def _decays(deltas, A):
  """`exp(delta A)` per row: [bd, S] each."""
  return [jnp.exp(delta[:, None] * A) for delta in deltas]


def _projection(ref, fixed):
  """A projection's values per tile row, shaped to broadcast against the
  [bd, S] state: `rows(steps)` gives a [1, S] row per step, or the
  time-invariant [bd, S] block (`fixed`), loaded once, for every step."""
  if fixed:
    block = ref[...].astype(_F32)
    return lambda steps: [block] * len(steps)
  return lambda steps: [row[None, :] for row in _rows(ref, steps)]


def _walk_states(decays, xs, vs, h):
  """`h <- a h + x v` over a tile's rows, in processing order.

  decays (`a = exp(delta A)`), h: [bd, S]; xs: per row [bd]; vs: per row
  [1, S] or [bd, S] (from `_projection`). Returns the state after every row;
  each row is elementwise on the state.
  """
  states = []
  for a, x, v in zip(decays, xs, vs):
    h = a * h + x[:, None] * v
    states.append(h)
  return states


def _fold(h, k_end, end_ref, dsum_ref, A):
  """Folds the summaries of chunks 0..k_end-1 (processing order) into `h`."""
  def one(k, h):
    dsum = dsum_ref[pl.ds(k, 1), :].astype(_F32)[0][:, None]   # [bd, 1]
    return jnp.exp(dsum * A) * h + end_ref[k].astype(_F32)
  return jax.lax.fori_loop(0, k_end, one, h)


def _forward_kernel(u_ref, delta_ref, A_ref, B_ref, C_ref, h0_ref, *refs,
                    mode, reverse, chunk, unroll, fold, save, fixed, final):
  """mode 'summary': outputs (end [bd, S], dsum [1, bd]) from a zero state.
  mode 'apply': inputs [end_all, dsum_all if fold]; outputs y, [end if
  final], [ckpt if save]. fixed: whether (B, C) are time-invariant [bd, S]."""
  A = A_ref[...].astype(_F32)                                   # [bd, S]
  if mode == "apply":
    if fold:
      end_all, dsum_all, refs = refs[0], refs[1], refs[2:]
      h = _fold(h0_ref[...], pl.program_id(2), end_all, dsum_all, A)
    else:
      h = h0_ref[...]
    y_ref, refs = refs[0], refs[1:]
    end_ref, refs = (refs[0], refs[1:]) if final else (None, refs)
    ckpt_ref = refs[0] if save else None
  else:
    end_ref, dsum_ref = refs
    h = jnp.zeros(A.shape, _F32)
  dsum = jnp.zeros((A.shape[0],), _F32)
  B_rows, C_rows = _projection(B_ref, fixed[0]), _projection(C_ref, fixed[1])

  def body(j, carry):
    h, dsum = carry
    steps = tile_steps(j, chunk, unroll, reverse)
    if save:
      ckpt_ref[j] = h
    deltas, us, Bs = _rows(delta_ref, steps), _rows(u_ref, steps), B_rows(steps)
    Cs = C_rows(steps) if mode == "apply" else None
    states = _walk_states(_decays(deltas, A), [d * u for d, u in zip(deltas, us)],
                          Bs, h)
    if mode == "apply":
      for t, state, C in zip(steps, states, Cs):
        y_ref[t, :] = jnp.sum(state * C, axis=1)
    else:
      dsum = dsum + sum(deltas)
    return states[-1], dsum

  h, dsum = jax.lax.fori_loop(0, chunk // unroll, body, (h, dsum))
  if end_ref is not None:
    end_ref[...] = h
  if mode == "summary":
    dsum_ref[...] = dsum[None, :]


def _backward_summary_kernel(delta_next_ref, A_ref, C_ref, dy_ref, end_ref,
                             dsum_ref, *, reverse, chunk, unroll, c_fixed):
  """The chunk's adjoint from zero, walking in backward order.

  `reverse` is the forward direction. The adjoint `c_t = dL/dh_t` obeys
  `c_t = a_{t+1} c_{t+1} + dy_t C_t` (`t+1` the next step in forward order),
  so it is the same recurrence on `(delta_next, dy, C)` the other way.
  """
  A = A_ref[...].astype(_F32)
  c = jnp.zeros(A.shape, _F32)
  dsum = jnp.zeros((A.shape[0],), _F32)
  C_rows = _projection(C_ref, c_fixed)

  def body(j, carry):
    c, dsum = carry
    steps = tile_steps(j, chunk, unroll, not reverse)
    deltas_next = _rows(delta_next_ref, steps)
    cs = _walk_states(_decays(deltas_next, A), _rows(dy_ref, steps), C_rows(steps), c)
    return cs[-1], dsum + sum(deltas_next)

  c, dsum = jax.lax.fori_loop(0, chunk // unroll, body, (c, dsum))
  end_ref[...] = c
  dsum_ref[...] = dsum[None, :]


def _backward_kernel(u_ref, delta_ref, delta_next_ref, A_ref, B_ref, C_ref, dy_ref,
                     *refs, reverse, chunk, unroll, fold, fixed, final):
  """Per chunk (backward order): du, ddelta, dB and dC (per-step partials per
  channel block, or per-program sums when time-invariant), the dA partial
  and the adjoint `c` at the chunk's first step (forward order).

  `reverse` is the *forward* direction; this kernel walks the other way.
  Each tile recomputes its states from its checkpoint (forward over its
  rows), then walks its rows backward with the adjoint and forms every
  gradient of the step from the two. refs: [dfinal if final], ckpt,
  [end_all, dsum_all if fold], then the outputs.
  """
  A = A_ref[...].astype(_F32)
  dfinal_ref, refs = (refs[0], refs[1:]) if final else (None, refs)
  ckpt_ref, refs = refs[0], refs[1:]
  c = dfinal_ref[...] if final else jnp.zeros(A.shape, _F32)
  if fold:
    end_all, dsum_all, refs = refs[0], refs[1], refs[2:]
    c = _fold(c, pl.program_id(2), end_all, dsum_all, A)
  du_ref, ddelta_ref, dB_ref, dC_ref, dA_ref, c_ref = refs
  B_fixed, C_fixed = fixed
  B_rows, C_rows = _projection(B_ref, B_fixed), _projection(C_ref, C_fixed)
  num_tiles = chunk // unroll
  # The decay of the step after the chunk (forward order): the adjoint's
  # first multiplier. Inside the chunk each row hands its own decay on.
  last = tile_steps(num_tiles - 1, chunk, unroll, reverse)[-1]
  a_next = jnp.exp(delta_next_ref[last, :].astype(_F32)[:, None] * A)
  zero = jnp.zeros(A.shape, _F32)
  # Per-program sums over the chunk: dA, and dB/dC when time-invariant.
  sums = dict(A=zero, **{name: zero for name, f in (("B", B_fixed), ("C", C_fixed)) if f})

  def body(jb, carry):
    c, a_next, sums = carry
    # The tile's rows in forward processing order; the walk below goes back.
    j = num_tiles - 1 - jb
    steps = tile_steps(j, chunk, unroll, reverse)
    deltas, us, Bs = _rows(delta_ref, steps), _rows(u_ref, steps), B_rows(steps)
    Cs, dys = C_rows(steps), _rows(dy_ref, steps)
    xs = [d * u for d, u in zip(deltas, us)]
    decays = _decays(deltas, A)
    h_start = ckpt_ref[j]
    hs = _walk_states(decays, xs, Bs, h_start)
    for r in reversed(range(unroll)):
      t = steps[r]
      delta, x, dy = deltas[r], xs[r], dys[r]
      c = a_next * c + dy[:, None] * Cs[r]
      # dL/d(delta A) = c_t a_t h_{t-1}, formed as a product: h_t - x_t B_t
      # cancels when the decay is strong and lost every digit of a_t h_{t-1}.
      g = c * (decays[r] * (hs[r - 1] if r else h_start))
      dx = jnp.sum(c * Bs[r], axis=1)                                   # [bd]
      dC = dy[:, None] * hs[r]                                           # [bd, S]
      dB = c * x[:, None]
      if C_fixed:
        sums["C"] = sums["C"] + dC
      else:
        dC_ref[t, :] = jnp.sum(dC, axis=0)                               # [S]
      if B_fixed:
        sums["B"] = sums["B"] + dB
      else:
        dB_ref[t, :] = jnp.sum(dB, axis=0)
      du_ref[t, :] = dx * delta
      ddelta_ref[t, :] = dx * us[r] + jnp.sum(g * A, axis=1)
      sums["A"] = sums["A"] + g * delta[:, None]
      a_next = decays[r]
    return c, a_next, sums

  c, _, sums = jax.lax.fori_loop(0, num_tiles, body, (c, a_next, sums))
  dA_ref[...] = sums["A"]
  if B_fixed:
    dB_ref[...] = sums["B"]
  if C_fixed:
    dC_ref[...] = sums["C"]
  c_ref[...] = c


def _layout(batch, time, width, state, blocks):
  bd, chunk = blocks.block_d, blocks.chunk
  num_chunks = _shapes.cdiv(time, chunk)
  padded_d = _shapes.round_up(width, bd)
  return bd, chunk, num_chunks, padded_d, (batch, padded_d // bd, num_chunks)


def _pad_seq(x, chunk, bd=None):
  x = _shapes.pad_axis(x, 1, chunk)
  return x if bd is None else _shapes.pad_axis(x, 2, bd)


def _pad_projection(x, chunk, bd):
  """A time-invariant [D, S] projection padded to whole channel blocks; a
  per-step one to whole chunks."""
  return _shapes.pad_axis(x, 0, bd) if x.ndim == 2 else _pad_seq(x, chunk)


def _specs(chunk, bd, state, num_chunks, reverse, unroll, width):
  """BlockSpecs over grid (batch, channel block, chunk in processing order).

  `proj(x)` is the spec of a projection: a [bd, S] block of a time-invariant
  [D, S] one, a chunk of rows of a per-step [B, T, S] one, or of a per-group
  [B, T, G, S] one at the channel block's group (D / G of the `width`
  channels per group, a multiple of `bd`).
  """
  def phys(c):
    return num_chunks - 1 - c if reverse else c

  def proj(x):
    if x.ndim == 2:
      return pl.BlockSpec((bd, state), lambda i, d, c: (d, 0))
    if x.ndim == 3:
      return pl.BlockSpec((None, chunk, state), lambda i, d, c: (i, phys(c), 0))
    per_group = width // x.shape[2]
    return pl.BlockSpec((None, chunk, None, state),
                        lambda i, d, c: (i, phys(c), d * bd // per_group, 0))
  return dict(
      proj=proj,
      seq=pl.BlockSpec((None, chunk, bd), lambda i, d, c: (i, phys(c), d)),
      a=pl.BlockSpec((bd, state), lambda i, d, c: (d, 0)),
      state=pl.BlockSpec((None, bd, state), lambda i, d, c: (i, d, 0)),
      chunk_state=pl.BlockSpec((None, None, bd, state), lambda i, d, c: (i, c, d, 0)),
      chunk_vec=pl.BlockSpec((None, 1, bd), lambda i, d, c: (i, c, d)),
      all_states=pl.BlockSpec((None, num_chunks, bd, state), lambda i, d, c: (i, 0, d, 0)),
      all_vecs=pl.BlockSpec((None, num_chunks, bd), lambda i, d, c: (i, 0, d)),
      ckpt=pl.BlockSpec((None, chunk // unroll, bd, state),
                        lambda i, d, c: (i, c, d, 0)),
      ckpt_rev=pl.BlockSpec((None, chunk // unroll, bd, state),
                            lambda i, d, c: (i, num_chunks - 1 - c, d, 0)),
      partial_s=pl.BlockSpec((None, None, chunk, state),
                             lambda i, d, c: (i, d, phys(c), 0)),
  )


def _forward(u, delta, A, B, C, h0, *, reverse, blocks, save, final):
  """Core forward: y [B, T, D] f32, the final state (or None unless
  `final`), the checkpoints (or None unless `save`)."""
  batch, time, width = u.shape
  state = A.shape[1]
  bd, chunk, num_chunks, padded_d, grid = _layout(batch, time, width, state, blocks)
  sp = _specs(chunk, bd, state, num_chunks, reverse, blocks.unroll, width)
  u_p, delta_p = _pad_seq(u, chunk, bd), _pad_seq(delta, chunk, bd)
  B_p, C_p = _pad_projection(B, chunk, bd), _pad_projection(C, chunk, bd)
  A_p = _shapes.pad_axis(A, 0, bd)
  h0_p = _shapes.pad_axis(h0, 1, bd)
  params = plgpu.CompilerParams(num_warps=blocks.num_warps,
                                num_stages=blocks.num_stages)
  interpret = _backend.pallas_interpret()
  kw = dict(reverse=reverse, chunk=chunk, unroll=blocks.unroll,
            fixed=(B.ndim == 2, C.ndim == 2))
  ins = (u_p, delta_p, A_p, B_p, C_p, h0_p)
  in_specs = [sp["seq"], sp["seq"], sp["a"], sp["proj"](B), sp["proj"](C), sp["state"]]
  states = jax.ShapeDtypeStruct((batch, num_chunks, padded_d, state), _F32)
  vecs = jax.ShapeDtypeStruct((batch, num_chunks, padded_d), _F32)
  fold = num_chunks > 1
  summaries = ()
  if fold:
    summaries = _pallas.pallas_call(
        functools.partial(_forward_kernel, mode="summary", fold=False, save=False,
                          final=True, **kw),
        grid=grid, in_specs=in_specs, out_specs=[sp["chunk_state"], sp["chunk_vec"]],
        out_shape=[states, vecs], compiler_params=params, interpret=interpret,
        name="selective_scan_summary")(*ins)
  out_specs = [sp["seq"]]
  out_shape = [jax.ShapeDtypeStruct(u_p.shape, _F32)]
  if final:
    out_specs.append(sp["chunk_state"])
    out_shape.append(states)
  if save:
    out_specs.append(sp["ckpt"])
    out_shape.append(jax.ShapeDtypeStruct(
        (batch, num_chunks * chunk // blocks.unroll, padded_d, state), _F32))
  outs = _pallas.pallas_call(
      functools.partial(_forward_kernel, mode="apply", fold=fold, save=save,
                        final=final, **kw),
      grid=grid, in_specs=in_specs + [sp["all_states"], sp["all_vecs"]][:len(summaries)],
      out_specs=out_specs, out_shape=out_shape, compiler_params=params,
      interpret=interpret, name="selective_scan")(*ins, *summaries)
  y, outs = outs[0], outs[1:]
  ends, outs = (outs[0][:, -1, :width], outs[1:]) if final else (None, outs)
  ckpt = outs[0] if save else None
  return y[:, :time, :width], ends, ckpt


def _backward(u, delta, A, B, C, ckpt, dy, dfinal, *, reverse, blocks):
  """Core backward: (du, ddelta, dA, dB, dC, dh0), float32. `dfinal` is None
  when the forward returned no final state."""
  batch, time, width = u.shape
  state = A.shape[1]
  bd, chunk, num_chunks, padded_d, grid = _layout(batch, time, width, state, blocks)
  # The backward walks the other way; chunk c of the grid is forward chunk C-1-c.
  sp = _specs(chunk, bd, state, num_chunks, not reverse, blocks.unroll, width)
  u_p, delta_p = _pad_seq(u, chunk, bd), _pad_seq(delta, chunk, bd)
  # delta of the next step in forward order (0, a decay of 1, past the end):
  # the adjoint's recurrence multiplies by the next step's decay.
  zero = jnp.zeros_like(delta_p[:, :1])
  delta_next = (jnp.concatenate([zero, delta_p[:, :-1]], axis=1) if reverse
                else jnp.concatenate([delta_p[:, 1:], zero], axis=1))
  dy_p = _pad_seq(dy.astype(_F32), chunk, bd)
  B_p, C_p = _pad_projection(B, chunk, bd), _pad_projection(C, chunk, bd)
  A_p = _shapes.pad_axis(A, 0, bd)
  final = dfinal is not None
  dfinal_p = (_shapes.pad_axis(dfinal.astype(_F32), 1, bd),) if final else ()
  params = plgpu.CompilerParams(num_warps=blocks.num_warps,
                                num_stages=blocks.num_stages)
  interpret = _backend.pallas_interpret()
  kw = dict(chunk=chunk, unroll=blocks.unroll)
  states = jax.ShapeDtypeStruct((batch, num_chunks, padded_d, state), _F32)
  vecs = jax.ShapeDtypeStruct((batch, num_chunks, padded_d), _F32)
  fold = num_chunks > 1
  summaries = ()
  if fold:
    summaries = _pallas.pallas_call(
        functools.partial(_backward_summary_kernel, reverse=reverse,
                          c_fixed=C.ndim == 2, **kw),
        grid=grid, in_specs=[sp["seq"], sp["a"], sp["proj"](C), sp["seq"]],
        out_specs=[sp["chunk_state"], sp["chunk_vec"]], out_shape=[states, vecs],
        compiler_params=params, interpret=interpret,
        name="selective_scan_backward_summary")(delta_next, A_p, C_p, dy_p)
  seq = jax.ShapeDtypeStruct(u_p.shape, _F32)
  partial_s = jax.ShapeDtypeStruct((batch, padded_d // bd, u_p.shape[1], state), _F32)

  def projection_grad(x):  # per-program sums when time-invariant, else per-step partials
    return (sp["chunk_state"], states) if x.ndim == 2 else (sp["partial_s"], partial_s)

  (dB_spec, dB_shape), (dC_spec, dC_shape) = projection_grad(B), projection_grad(C)
  du, ddelta, dB, dC, dA, c = _pallas.pallas_call(
      functools.partial(_backward_kernel, reverse=reverse, fold=fold,
                        fixed=(B.ndim == 2, C.ndim == 2), final=final, **kw),
      grid=grid,
      in_specs=[sp["seq"], sp["seq"], sp["seq"], sp["a"], sp["proj"](B), sp["proj"](C),
                sp["seq"]] + ([sp["state"]] if final else []) + [sp["ckpt_rev"]]
      + [sp["all_states"], sp["all_vecs"]][:len(summaries)],
      out_specs=[sp["seq"], sp["seq"], dB_spec, dC_spec,
                 sp["chunk_state"], sp["chunk_state"]],
      out_shape=[seq, seq, dB_shape, dC_shape, states, states],
      compiler_params=params, interpret=interpret,
      name="selective_scan_backward")(u_p, delta_p, delta_next, A_p, B_p, C_p, dy_p,
                                      *dfinal_p, ckpt, *summaries)
  # dL/dh0 = a_first c_first: the adjoint at the first step (forward order)
  # times that step's decay.
  first = delta_p[:, -1] if reverse else delta_p[:, 0]                  # [B, Dp]
  dh0 = jnp.exp(first.astype(_F32)[:, :, None] * A_p) * c[:, -1]

  def reduce(dx, x):
    if x.ndim == 2:  # [B, C, Dp, S] per program -> [D, S]
      return jnp.sum(dx, axis=(0, 1))[:width]
    if x.ndim == 3:  # [B, Dp / bd, T, S] per channel block -> [B, T, S]
      return jnp.sum(dx, axis=1)[:, :time]
    groups = x.shape[2]  # -> [B, T, G, S]: bd divides D / G, so Dp = D
    dx = dx.reshape(batch, groups, -1, *dx.shape[2:]).sum(axis=2)
    return jnp.swapaxes(dx, 1, 2)[:, :time]

  return (du[:, :time, :width], ddelta[:, :time, :width],
          jnp.sum(dA, axis=(0, 1))[:width], reduce(dB, B), reduce(dC, C), dh0[:, :width])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _selective_scan_core(u, delta, A, B, C, h0, reverse, blocks, final):
  """(y, final_state) when `final`, else (y,)."""
  y, end, _ = _forward(u, delta, A, B, C, h0, reverse=reverse, blocks=blocks,
                       save=False, final=final)
  return (y, end) if final else (y,)


def _core_fwd(u, delta, A, B, C, h0, reverse, blocks, final):
  y, end, ckpt = _forward(u, delta, A, B, C, h0, reverse=reverse, blocks=blocks,
                          save=True, final=final)
  return ((y, end) if final else (y,)), (u, delta, A, B, C, ckpt,
                                         _pallas.type_tokens(u, delta, A, B, C, h0))


def _core_bwd(reverse, blocks, final, residuals, cotangents):
  u, delta, A, B, C, ckpt, tokens = residuals
  dy, dfinal = cotangents if final else (cotangents[0], None)
  du, ddelta, dA, dB, dC, dh0 = _backward(u, delta, A, B, C, ckpt, dy, dfinal,
                                          reverse=reverse, blocks=blocks)
  return _pallas.typed_like((du.astype(u.dtype), ddelta.astype(delta.dtype),
                             dA.astype(A.dtype), dB.astype(B.dtype), dC.astype(C.dtype),
                             dh0), tokens)


_selective_scan_core.defvjp(_core_fwd, _core_bwd)
_selective_scan_core_shared = _pallas.shared_lowering(
    _selective_scan_core, static_argnums=(6, 7, 8))


def selective_scan_pallas(u, delta, A, B, C, *, D=None, z=None, delta_bias=None,
                          delta_softplus=False, initial_state=None, reverse=False,
                          return_final_state=True,
                          blocks: configs.TritonConfig | None = None):
  """Same contract as `selective_scan_reference`, on the Pallas kernels.

  `delta_bias`/softplus, the skip `D` and the gate `z` are elementwise XLA
  around the kernel (differentiated by JAX); the kernels carry the recurrence.
  A channel block must not straddle two groups of a per-group `B` or `C`:
  the default `blocks` shrink `block_d` to fit, an explicit one that does
  not divide their channels per group is a ValueError.
  """
  batch, time, width = u.shape
  state = A.shape[1]
  grouped = [(name, width // x.shape[2]) for name, x in (("B", B), ("C", C))
             if x.ndim == 4]
  if blocks is None:
    blocks = configs.TritonConfig.get_default(batch, time, width, state)
    for _, per_group in grouped:
      blocks = dataclasses.replace(
          blocks, block_d=min(blocks.block_d, per_group & -per_group))
  for name, per_group in grouped:
    if per_group % blocks.block_d:
      raise ValueError(f"`blocks.block_d`={blocks.block_d} must divide the channels "
                       f"per group of `{name}`, {per_group}")
  delta = prepare_delta(delta, delta_bias, delta_softplus)
  h0 = (jnp.zeros((batch, width, state), _F32) if initial_state is None
        else initial_state.astype(_F32))
  # Triton tiles are powers of two: pad S with inert states (A = B = C = h0 = 0
  # keeps them at zero and out of y).
  padded = next_pow2(state)
  A, B, C, h0 = (_shapes.pad_axis(x, x.ndim - 1, padded) for x in (A.astype(_F32), B, C, h0))
  outs = _selective_scan_core_shared(u, delta, A, B, C, h0, reverse, blocks,
                                     return_final_state)
  final = outs[1][..., :state] if return_final_state else None
  return finish_output(outs[0], u, D, z), final
