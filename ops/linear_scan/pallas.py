"""Pallas kernel for the linear recurrence `h_t = a_t * h_{t-1} + b_t`.

Each program owns `block_d` channels of one batch row and one chunk of
`chunk` time steps, and walks through the chunk `unroll` steps per loop
iteration: the iteration's rows are loaded first, then the recurrence runs
row by row, elementwise on [1, block_d] rows (an earlier version scanned
each tile with Triton's associative scan, whose operands crossed threads
through shared memory at every step; a loop that loaded, multiplied and
stored one step at a time waited on memory at every step). Two launches
make the chunks independent:

1. summary: every chunk runs from a zero state and writes its end state and
   the product of its `a`s (`[B, C, D]` each);
2. apply: every chunk folds the summaries of the chunks before it into its
   start state, runs again from there and writes `h`.

So the kernel reads the inputs twice and writes `h` once, with `B * D /
block_d * C` programs in flight instead of `B * D / block_d` serial chains.
With a single chunk the summary launch is skipped.

A decay shared by every step (`a` [D], the LRU's) is read once per program
as one [1, block_d] row. Complex inputs (the LRU's) travel as separate real
and imaginary float32 planes; Triton has no complex type. The backward pass
is the same kernel run in the other direction on (`a` shifted by one step,
the output cotangent): it gives `dh`, then `da_t = dh_t h_{t-1}` and
`db_t = dh_t` (for a shared decay, `da` sums over batch and time).

Glossary of shapes: B batch, T time, D channels, C chunks.
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


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class LinearScanBlocks:
  """Tiling of the linear scan kernel."""
  block_d: int = 32     # channels per program; a power of two
  unroll: int = 16      # time steps per loop iteration (loaded together); a power of two
  chunk: int = 256      # time steps per program; a multiple of `unroll`
  num_warps: int = 1    # warps per program
  num_stages: int = 1   # Triton's software pipelining of the loop

  def __post_init__(self):
    _shapes.check_time_blocks(self)

  @classmethod
  def get_default(cls, batch: int, time: int, width: int) -> "LinearScanBlocks":
    """16 steps per iteration x 32 channels, one warp (one channel per
    thread), about a thousand programs, at most 64 chunks: the best of the
    row walk's sweep on the H200 at B 8, T 4096, D 256, complex
    (BUILD_NOTES.md, "SSM scans"; two warps were 14-33 % slower)."""
    block_d = max(8, min(32, _next_pow2(width)))
    unroll = min(16, _next_pow2(time))
    chains = batch * _shapes.cdiv(width, block_d)
    num_chunks = min(64, max(1, _shapes.cdiv(1024, chains)))
    chunk = _shapes.round_up(_shapes.cdiv(time, num_chunks), unroll)
    return cls(block_d=block_d, unroll=unroll, chunk=chunk, num_warps=1)


def _mul(x, y):
  """Product of two values given as planes: (re,) or (re, im)."""
  if len(x) == 1:
    return (x[0] * y[0],)
  return (x[0] * y[0] - x[1] * y[1], x[0] * y[1] + x[1] * y[0])


def _add(x, y):
  return tuple(p + q for p, q in zip(x, y))


def _scan_kernel(*refs, planes: int, mode: str, reverse: bool, chunk: int,
                 unroll: int, fold: bool, const_a: bool):
  """One program: `block_d` channels, one chunk of time, planes of f32.

  refs: a planes, b planes, h0 planes, [prod planes, end planes if fold],
  then the outputs: (prod, end) planes for mode 'summary', h planes for 'apply'.
  With `const_a` the a planes are one [1, block_d] row used at every step.
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
      h = _add(_mul(a, h), b)
      if mode == "apply":
        for r, v in zip(out_refs, h):
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


def _scan_call(a: jax.Array, b: jax.Array, h0: jax.Array, *, reverse: bool,
               blocks: LinearScanBlocks) -> jax.Array:
  """The kernel pair without a gradient rule: a [B, T, D] or [D], b [B, T, D],
  h0 [B, D] -> h."""
  out_dtype = jnp.result_type(a, b)
  is_complex = jnp.issubdtype(out_dtype, jnp.complexfloating)
  batch, time, width = b.shape
  const_a = a.ndim == 1
  planes = 2 if is_complex else 1
  bd, chunk = blocks.block_d, blocks.chunk
  num_chunks = _shapes.cdiv(time, chunk)
  # Padded steps go after the real ones in processing order (at the start of
  # time when `reverse`), so they can only change states nobody reads; with a
  # per-step `a` they are the identity step (a = 1, b = 0) besides.
  extra = num_chunks * chunk - time
  pad_time = lambda p, value=0.0: _shapes.pad_axis(p, 1, chunk, value, at_start=reverse)
  a_planes = _to_planes(a.astype(out_dtype))
  if const_a:
    a_p = [_shapes.pad_axis(p, 0, bd, 1.0 if k == 0 else 0.0)[None, :]
           for k, p in enumerate(a_planes)]                       # [1, Dp]
  else:
    a_p = [_shapes.pad_axis(pad_time(p, 1.0 if k == 0 else 0.0), 2, bd)
           for k, p in enumerate(a_planes)]
  b_p = [_shapes.pad_axis(pad_time(p), 2, bd) for p in _to_planes(b.astype(out_dtype))]
  h0_p = [_shapes.pad_axis(p.astype(jnp.float32), 1, bd)[:, None, :]
          for p in _to_planes(h0)]
  padded_d = b_p[0].shape[2]
  grid = (batch, padded_d // bd, num_chunks)

  def chunk_index(c):
    return num_chunks - 1 - c if reverse else c

  seq_spec = pl.BlockSpec((None, chunk, bd), lambda i, d, c: (i, chunk_index(c), d))
  one_spec = pl.BlockSpec((None, 1, bd), lambda i, d, c: (i, 0, d))
  a_spec = pl.BlockSpec((1, bd), lambda i, d, c: (0, d)) if const_a else seq_spec
  kernel = functools.partial(_scan_kernel, planes=planes, reverse=reverse,
                             chunk=chunk, unroll=blocks.unroll, const_a=const_a)
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
  store_dtype = jnp.float32 if is_complex else out_dtype
  all_spec = pl.BlockSpec((None, num_chunks, bd), lambda i, d, c: (i, 0, d))
  h = _pallas.pallas_call(
      functools.partial(kernel, mode="apply", fold=fold),
      grid=grid,
      in_specs=[a_spec] * planes + [seq_spec] * planes + [one_spec] * planes
      + [all_spec] * len(summaries),
      out_specs=[seq_spec] * planes,
      out_shape=[jax.ShapeDtypeStruct(b_p[0].shape, store_dtype)] * planes,
      compiler_params=params, interpret=interpret,
      name="linear_scan")(*a_p, *b_p, *h0_p, *summaries)
  first = extra if reverse else 0
  h = [p[:, first:first + time, :width] for p in h]
  return jax.lax.complex(*h) if is_complex else h[0]


def _final(h: jax.Array, reverse: bool) -> jax.Array:
  return h[:, 0] if reverse else h[:, -1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _linear_scan(a, b, h0, reverse, blocks):
  h = _scan_call(a, b, h0, reverse=reverse, blocks=blocks)
  return h, _final(h, reverse)


def _linear_scan_fwd(a, b, h0, reverse, blocks):
  h = _scan_call(a, b, h0, reverse=reverse, blocks=blocks)
  return (h, _final(h, reverse)), (a, h, h0, _pallas.type_tokens(a, b, h0))


def _linear_scan_bwd(reverse, blocks, residuals, cotangents):
  a, h, h0, tokens = residuals
  dh_out, dfinal = cotangents  # [B, T, D], [B, D]
  if a.ndim == 1:
    return _pallas.typed_like(_const_decay_bwd(reverse, blocks, a, h, h0, dh_out, dfinal),
                              tokens)
  one = jnp.ones_like(a[:, :1])
  h0 = h0.astype(h.dtype)[:, None]
  if reverse:
    a_next = jnp.concatenate([one, a[:, :-1]], axis=1)    # a_{t-1}
    h_prev = jnp.concatenate([h[:, 1:], h0], axis=1)       # h_{t+1}
  else:
    a_next = jnp.concatenate([a[:, 1:], one], axis=1)     # a_{t+1}
    h_prev = jnp.concatenate([h0, h[:, :-1]], axis=1)      # h_{t-1}
  # dL/dh_t = dh_out_t + a_{t+1} dL/dh_{t+1}, starting from dfinal.
  dh = _scan_call(a_next, dh_out.astype(h.dtype), dfinal.astype(h.dtype),
                  reverse=not reverse, blocks=blocks)
  da = (dh * h_prev).astype(a.dtype)
  first = -1 if reverse else 0
  dh0 = (a[:, first] * dh[:, first]).astype(residuals[2].dtype)
  return _pallas.typed_like((da, dh.astype(h.dtype), dh0), tokens)


def _const_decay_bwd(reverse, blocks, a, h, h0, dh_out, dfinal):
  """The backward for a decay `a` [D] shared by every step.

  The adjoint scan runs with the same `a` at every step, so `dfinal` (whose
  step has no decay in front of it) enters as an addition to the cotangent of
  the first step the backward processes instead of as its initial state; `da`
  sums `dh_t h_{t-1}` over batch and time.
  """
  dtype = h.dtype
  first_back = 0 if reverse else -1  # the step the adjoint scan starts from
  dh_in = dh_out.astype(dtype).at[:, first_back].add(dfinal.astype(dtype))
  dh = _scan_call(a, dh_in, jnp.zeros_like(dfinal, dtype), reverse=not reverse,
                  blocks=blocks)
  h0 = h0.astype(dtype)
  if reverse:   # h_prev of step t is h_{t+1}; the last step's is h0
    da = jnp.sum(dh[:, :-1] * h[:, 1:], axis=(0, 1)) + jnp.sum(dh[:, -1] * h0, axis=0)
  else:         # h_prev of step t is h_{t-1}; the first step's is h0
    da = jnp.sum(dh[:, 1:] * h[:, :-1], axis=(0, 1)) + jnp.sum(dh[:, 0] * h0, axis=0)
  first = -1 if reverse else 0
  dh0 = (a * dh[:, first]).astype(h0.dtype)
  return da.astype(a.dtype), dh, dh0


_linear_scan.defvjp(_linear_scan_fwd, _linear_scan_bwd)
_linear_scan_shared = _pallas.shared_lowering(_linear_scan, static_argnums=(3, 4))


def linear_scan_pallas(a: jax.Array, b: jax.Array, *,
                       initial_state: jax.Array | None = None,
                       reverse: bool = False,
                       blocks: LinearScanBlocks | None = None
                       ) -> tuple[jax.Array, jax.Array]:
  """Same contract as `linear_scan_reference`, on the Pallas kernel."""
  out_dtype = jnp.result_type(a, b)
  batch, time, width = b.shape
  if blocks is None:
    blocks = LinearScanBlocks.get_default(batch, time, width)
  if initial_state is None:
    initial_state = jnp.zeros((batch, width), out_dtype)
  return _linear_scan_shared(a.astype(out_dtype), b.astype(out_dtype),
                             initial_state.astype(out_dtype), reverse, blocks)
