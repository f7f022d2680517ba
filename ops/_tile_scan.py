"""An associative scan over one axis of a value inside a Pallas Triton kernel.

Pallas's Triton lowering exposes Triton's `tt.scan` only as `jnp.cumsum`; the
scan kernels need it with their own combine rule, the pair operator of a
linear recurrence `(a1, b1) . (a2, b2) = (a1 a2, a2 b1 + b2)`. This module
binds that as a primitive, `tile_associative_scan`, with

- a Triton lowering to `tt.scan` (any axis, forward or reverse), so a tile of
  `[steps, ...]` values is scanned in registers with a log-depth tree instead
  of a chain of `steps` dependent steps;
- an ordinary lowering through `lax.associative_scan`, which is what runs in
  interpret mode (CPU) and under XLA.

The Triton rule uses JAX's private Pallas lowering module (pinned: jax
0.11.2); BUILD_NOTES.md records this.
"""

from typing import Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import batching
from jax.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering

Combine = Callable[[tuple, tuple], tuple]

_tile_scan_p = jex_core.Primitive("tile_associative_scan")
_tile_scan_p.multiple_results = True


def tile_associative_scan(combine: Combine, elems: Sequence[jax.Array], *,
                          axis: int = 0, reverse: bool = False) -> tuple:
  """Inclusive scan of `elems` (a tuple of same-shape arrays) along `axis`.

  `combine(x, y)` takes two tuples of scalars-or-arrays (earlier, later in
  scan order) and returns one tuple; it must be associative. With
  `reverse=True` the scan runs from the last index to the first.
  """
  elems = tuple(elems)
  shapes = {e.shape for e in elems}
  if len(shapes) != 1:
    raise ValueError(f"`elems` must share one shape, got {sorted(shapes)}")
  ndim = elems[0].ndim
  if not -ndim <= axis < ndim:
    raise ValueError(f"`axis` must be in [{-ndim}, {ndim}), got {axis}")
  return tuple(_tile_scan_p.bind(*elems, combine=combine, axis=axis % ndim,
                                 reverse=reverse))


def pick_row(x: jax.Array, row, *, keepdims: bool = False) -> jax.Array:
  """`x[row]` along axis 0 of a value inside a kernel, as a masked sum over
  that axis (Triton values cannot be indexed). `row` may be traced."""
  rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.sum(jnp.where(rows == row, x, 0.0), axis=0, keepdims=keepdims)


@_tile_scan_p.def_abstract_eval
def _abstract_eval(*avals, combine, axis, reverse):
  del combine, axis, reverse
  return [jax.core.ShapedArray(a.shape, a.dtype) for a in avals]


def _xla_impl(*elems, combine, axis, reverse):
  return list(lax.associative_scan(combine, tuple(elems), reverse=reverse,
                                   axis=axis))


_tile_scan_p.def_impl(_xla_impl)
mlir.register_lowering(_tile_scan_p, mlir.lower_fun(_xla_impl, multiple_results=True))


def _batch_rule(args, dims, *, combine, axis, reverse):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  moved = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
           for a, d in zip(args, dims)]
  out = _tile_scan_p.bind(*moved, combine=combine, axis=axis + 1, reverse=reverse)
  return out, [0] * len(out)


batching.primitive_batchers[_tile_scan_p] = _batch_rule


@triton_lowering.register_lowering(_tile_scan_p)
def _triton_lowering(ctx, *args, combine, axis, reverse):
  n = len(args)
  scalar_avals = [jax.core.ShapedArray((), a.dtype) for a in ctx.avals_in]

  def flat_combine(*xs):
    return list(combine(tuple(xs[:n]), tuple(xs[n:])))

  closed = jax.make_jaxpr(flat_combine)(*scalar_avals, *scalar_avals)
  if closed.consts:
    raise NotImplementedError("the combine function of a tile scan cannot "
                              "close over arrays")
  element_types = [ir.RankedTensorType(a.type).element_type for a in args]
  scan = tt_dialect.ScanOp(list(args), axis, reverse)
  entry = scan.regions[0].blocks.append(*element_types, *element_types)
  with ir.InsertionPoint.at_block_begin(entry):
    results = triton_lowering.lower_jaxpr_to_triton_ir(
        ctx.context, closed.jaxpr, None, *entry.arguments)
    tt_dialect.scan_return(results)
  scan.verify()
  return list(scan.result)
