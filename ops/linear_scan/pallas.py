"""Pallas kernel for the linear recurrence `h_t = a_t * h_{t-1} + b_t`.

Each program owns `block_d` channels of one batch row and one chunk of
`chunk` time steps, and walks through the chunk `unroll` steps per loop
iteration: the iteration's rows are loaded first, then the recurrence runs
row by row, elementwise on [1, block_d] rows (a tile-wide associative scan
moves its operands between threads through shared memory at every step, and
a load per step waits on memory at every step: BUILD_NOTES.md, "SSM scans").
Two launches make the chunks independent:

1. summary: every chunk runs from a zero state and writes its end state and
   the product of its `a`s (`[B, C, D]` each);
2. apply: every chunk folds the summaries of the chunks before it into its
   start state, runs again from there and writes `h`.

So the kernel reads the inputs twice and writes `h` once, with `B * D /
block_d * C` programs in flight instead of `B * D / block_d` serial chains.
With a single chunk the summary launch is skipped.

A decay shared by every step (`a` [D], the LRU's) is read once per program
as one [1, block_d] row. Complex inputs (the LRU's) travel as separate real
and imaginary float32 planes; Triton has no complex type, and XLA cannot
bitcast a complex buffer, so each split or merge is a pass over memory: the
custom VJP keeps its residuals (`a` and `h`) as the kernel's planes, and the
backward works on planes until its results.

The backward is the same kernel run in the other direction on the output
cotangent, with the carry kept *decayed* (`decayed_carry`): the carry is
`c_t = a_t dh_t`, each step computes `dh_t = dh_out_t + c_{t+1}` and then
`c_t = a_t dh_t`. So it reads `a` unshifted, and `dfinal` (whose step has no
decay in front of it) is simply the carry it starts from. Then
`da_t = dh_t h_{t-1}` (for a shared decay, summed over batch and time),
`db_t = dh_t` and d initial_state is the last carry, `a dh` at the first step.

Glossary of shapes: B batch, T time, D channels, C chunks.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import _backend
from ops import _pallas
from ops import _shapes
from ops._rows import tile_steps
from ops.linear_scan import configs


def _mul(x, y):
  """Product of two values given as planes: (re,) or (re, im)."""
  if len(x) == 1:
    return (x[0] * y[0],)
  return (x[0] * y[0] - x[1] * y[1], x[0] * y[1] + x[1] * y[0])


def _add(x, y):
  return tuple(p + q for p, q in zip(x, y))


def _scan_kernel(*refs, planes: int, mode: str, reverse: bool, chunk: int,
                 unroll: int, fold: bool, const_a: bool, decayed_carry: bool):
  """One program: `block_d` channels, one chunk of time, planes of f32.

  refs: a planes, b planes, h0 planes, [prod planes, end planes if fold],
  then the outputs: (prod, end) planes for mode 'summary', h planes for 'apply'.
  With `const_a` the a planes are one [1, block_d] row used at every step.
  With `decayed_carry` the carry is `c = a h` instead of `h`: a step writes
  `h = b + c` and carries `a h` (the backward's form, module docstring); the
  chunk summaries compose the same way.
  """
  a_refs, b_refs, refs = refs[:planes], refs[planes:2 * planes], refs[2 * planes:]
  h0_refs, refs = refs[:planes], refs[planes:]
  if fold:
    prod_in, end_in, refs = refs[:planes], refs[planes:2 * planes], refs[2 * planes:]
  out_refs = refs
  block_d = a_refs[0].shape[-1]

  def row(ref, t):  # [1, block_d] in float32
    return ref[pl.ds(t, 1), :].astype(jnp.float32)

  if mode == "apply":
    h = tuple(row(r, 0) for r in h0_refs)
    if fold:
      # Chunks run in processing order; fold the summaries of those before.
      def fold_one(k, h):
        return _add(_mul(tuple(row(r, k) for r in prod_in), h),
                    tuple(row(r, k) for r in end_in))
      h = jax.lax.fori_loop(0, pl.program_id(2), fold_one, h)
    prod = ()
  else:
    h = tuple(jnp.zeros((1, block_d), jnp.float32) for _ in range(planes))
    prod = (jnp.ones((1, block_d), jnp.float32),) + tuple(
        jnp.zeros((1, block_d), jnp.float32) for _ in range(planes - 1))

  # Each loop iteration walks a tile of `unroll` steps one row at a time:
  # the tile's rows are loaded first (a load after a store cannot be moved
  # above it), then the recurrence runs elementwise on [1, block_d] rows.
  a_const = tuple(r[...].astype(jnp.float32) for r in a_refs) if const_a else None

  def body(j, carry):
    h, prod = carry
    steps = tile_steps(j, chunk, unroll, reverse)
    a_rows = ([a_const] * unroll if const_a else
              [tuple(row(r, t) for r in a_refs) for t in steps])
    b_rows = [tuple(row(r, t) for r in b_refs) for t in steps]
    for t, a, b in zip(steps, a_rows, b_rows):
      out = _add(b, h) if decayed_carry else _add(_mul(a, h), b)
      h = _mul(a, out) if decayed_carry else out
      if mode == "apply":
        for r, v in zip(out_refs, out):
          r[pl.ds(t, 1), :] = v.astype(r.dtype)
      else:
        prod = _mul(a, prod)
    return h, prod

  h, prod = jax.lax.fori_loop(0, chunk // unroll, body, (h, prod))
  if mode == "summary":
    for r, v in zip(out_refs, prod + h):
      r[...] = v


def _to_planes(x: jax.Array) -> tuple[jax.Array, ...]:
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return (jnp.real(x).astype(jnp.float32), jnp.imag(x).astype(jnp.float32))
  return (x,)


def _from_planes(planes: tuple[jax.Array, ...], dtype) -> jax.Array:
  if len(planes) == 2:
    return jax.lax.complex(*planes).astype(dtype)
  return planes[0].astype(dtype)


def _scan_planes(a_planes, b_planes, h0_planes, *, reverse: bool,
                 blocks: configs.TritonConfig, decayed_carry: bool = False) -> tuple:
  """The kernel pair on planes (module docstring): a [B, T, D] or [D], b
  [B, T, D], h0 [B, D], one plane each or (re, im) -> h planes [B, T, D]
  (float32 for complex, else b's dtype)."""
  planes = len(b_planes)
  batch, time, width = b_planes[0].shape
  const_a = a_planes[0].ndim == 1
  bd, chunk = blocks.block_d, blocks.chunk
  num_chunks = _shapes.cdiv(time, chunk)
  # Padded steps go after the real ones in processing order (at the start of
  # time when `reverse`), so they can only change states nobody reads; with a
  # per-step `a` they are the identity step (a = 1, b = 0) besides.
  extra = num_chunks * chunk - time
  pad_time = lambda p, value=0.0: _shapes.pad_axis(p, 1, chunk, value, at_start=reverse)
  if const_a:
    a_p = [_shapes.pad_axis(p, 0, bd, 1.0 if k == 0 else 0.0)[None, :]
           for k, p in enumerate(a_planes)]                       # [1, Dp]
  else:
    a_p = [_shapes.pad_axis(pad_time(p, 1.0 if k == 0 else 0.0), 2, bd)
           for k, p in enumerate(a_planes)]
  b_p = [_shapes.pad_axis(pad_time(p), 2, bd) for p in b_planes]
  h0_p = [_shapes.pad_axis(p.astype(jnp.float32), 1, bd)[:, None, :] for p in h0_planes]
  padded_d = b_p[0].shape[2]
  grid = (batch, padded_d // bd, num_chunks)

  def chunk_index(c):
    return num_chunks - 1 - c if reverse else c

  seq_spec = pl.BlockSpec((None, chunk, bd), lambda i, d, c: (i, chunk_index(c), d))
  one_spec = pl.BlockSpec((None, 1, bd), lambda i, d, c: (i, 0, d))
  a_spec = pl.BlockSpec((1, bd), lambda i, d, c: (0, d)) if const_a else seq_spec
  kernel = functools.partial(_scan_kernel, planes=planes, reverse=reverse,
                             chunk=chunk, unroll=blocks.unroll, const_a=const_a,
                             decayed_carry=decayed_carry)
  params = plgpu.CompilerParams(num_warps=blocks.num_warps,
                                num_stages=blocks.num_stages)
  interpret = _backend.pallas_interpret()
  fold = num_chunks > 1
  summaries = []
  if fold:
    summary_shape = jax.ShapeDtypeStruct((batch, num_chunks, padded_d), jnp.float32)
    summaries = _pallas.pallas_call(
        functools.partial(kernel, mode="summary", fold=False),
        grid=grid,
        in_specs=[a_spec] * planes + [seq_spec] * planes + [one_spec] * planes,
        out_specs=[pl.BlockSpec((None, 1, bd), lambda i, d, c: (i, c, d))] * (2 * planes),
        out_shape=[summary_shape] * (2 * planes),
        compiler_params=params, interpret=interpret,
        name="linear_scan_summary")(*a_p, *b_p, *h0_p)
  all_spec = pl.BlockSpec((None, num_chunks, bd), lambda i, d, c: (i, 0, d))
  h = _pallas.pallas_call(
      functools.partial(kernel, mode="apply", fold=fold),
      grid=grid,
      in_specs=[a_spec] * planes + [seq_spec] * planes + [one_spec] * planes
      + [all_spec] * len(summaries),
      out_specs=[seq_spec] * planes,
      out_shape=[jax.ShapeDtypeStruct(b_p[0].shape, b_p[0].dtype)] * planes,
      compiler_params=params, interpret=interpret,
      name="linear_scan")(*a_p, *b_p, *h0_p, *summaries)
  first = extra if reverse else 0
  return tuple(p[:, first:first + time, :width] for p in h)


def _final(h: jax.Array, reverse: bool) -> jax.Array:
  return h[:, 0] if reverse else h[:, -1]


def _forward(a, b, h0, reverse, blocks):
  """(h, final state, a's and h's planes)."""
  dtype = jnp.result_type(a, b)
  a_planes = _to_planes(a.astype(dtype))
  b_planes = _to_planes(b.astype(dtype))
  h_planes = _scan_planes(a_planes, b_planes, _to_planes(h0.astype(dtype)),
                          reverse=reverse, blocks=blocks)
  h = _from_planes(h_planes, dtype)
  return h, _final(h, reverse), a_planes, h_planes


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _linear_scan(a, b, h0, reverse, blocks):
  h, final, _, _ = _forward(a, b, h0, reverse, blocks)
  return h, final


def _linear_scan_fwd(a, b, h0, reverse, blocks):
  h, final, a_planes, h_planes = _forward(a, b, h0, reverse, blocks)
  return (h, final), (a_planes, h_planes, h0, _pallas.type_tokens(a, b, h0))


def _linear_scan_bwd(reverse, blocks, residuals, cotangents):
  a_planes, h_planes, h0, tokens = residuals
  dh_out, dfinal = cotangents  # [B, T, D], [B, D]
  dtype = jnp.result_type(*tokens[:2])
  as_planes = lambda x: _to_planes(x.astype(dtype))
  # The adjoint scan, reversed, with the carry c = a dh; dfinal is its start.
  dh = _scan_planes(a_planes, as_planes(dh_out), as_planes(dfinal),
                    reverse=not reverse, blocks=blocks, decayed_carry=True)
  f32 = lambda planes: tuple(p.astype(jnp.float32) for p in planes)
  dh32, h32, h0_32 = f32(dh), f32(h_planes), f32(as_planes(h0))
  # h_{t-1} of each step in processing order; the first step's is h0.
  if reverse:
    h_prev = tuple(jnp.concatenate([h[:, 1:], p[:, None]], axis=1)
                   for h, p in zip(h32, h0_32))
  else:
    h_prev = tuple(jnp.concatenate([p[:, None], h[:, :-1]], axis=1)
                   for h, p in zip(h32, h0_32))
  da = _mul(dh32, h_prev)
  if a_planes[0].ndim == 1:  # a shared decay: summed over batch and time
    da = tuple(jnp.sum(p, axis=(0, 1)) for p in da)
  first = -1 if reverse else 0
  a_first = tuple(p if p.ndim == 1 else p[:, first] for p in f32(a_planes))
  dh0 = _mul(a_first, tuple(p[:, first] for p in dh32))
  a_dtype, h0_dtype = tokens[0].dtype, tokens[2].dtype
  return _pallas.typed_like((_from_planes(da, a_dtype), _from_planes(dh, dtype),
                             _from_planes(dh0, h0_dtype)), tokens)


_linear_scan.defvjp(_linear_scan_fwd, _linear_scan_bwd)
_linear_scan_shared = _pallas.shared_lowering(_linear_scan, static_argnums=(3, 4))


def linear_scan_pallas(a: jax.Array, b: jax.Array, *,
                       initial_state: jax.Array | None = None,
                       reverse: bool = False,
                       blocks: configs.TritonConfig | None = None
                       ) -> tuple[jax.Array, jax.Array]:
  """Same contract as `linear_scan_reference`, on the Pallas kernel."""
  out_dtype = jnp.result_type(a, b)
  batch, time, width = b.shape
  if blocks is None:
    blocks = configs.TritonConfig.get_default(batch, time, width)
  if initial_state is None:
    initial_state = jnp.zeros((batch, width), out_dtype)
  return _linear_scan_shared(a.astype(out_dtype), b.astype(out_dtype),
                             initial_state.astype(out_dtype), reverse, blocks)
