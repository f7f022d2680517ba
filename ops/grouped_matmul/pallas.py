"""The Pallas implementation of `grouped_matmul`: the custom VJP over the
Triton kernels (`triton.py`) and the Mosaic GPU kernels (`mosaic.py`,
`mosaic_tgmm.py`), and the per-call choice between them.

`_grouped_matmul` is the `jax.custom_vjp`: the forward `gmm`, the input
gradient `gmm(transpose_rhs=True)` and the weight gradient `tgmm`. On Hopper
with 16-bit inputs, `grouped_matmul_pallas` runs the forward and the input
gradient on the Mosaic GPU kernel of `mosaic.py` instead (`mosaic.preferred`),
and the weight gradient on `mosaic_tgmm.py`'s where `mosaic_tgmm_default` says
so (`weight_gradient` picks).

Glossary of shapes: M rows, K contraction, N output columns, G groups.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ops import _backend
from ops import _pallas
from ops import _shapes
from ops.grouped_matmul import configs
from ops.grouped_matmul import mosaic as mosaic_gmm
from ops.grouped_matmul import mosaic_tgmm as tgmm_mosaic
from ops.grouped_matmul.triton import gmm
from ops.grouped_matmul.triton import tgmm


def weight_gradient(lhs: jax.Array, dout: jax.Array, starts: jax.Array,
                    ends: jax.Array, *, out_dtype=None, mosaic: bool,
                    block_sizes: configs.TritonConfig | None = None,
                    interpret: bool | None = None) -> jax.Array:
  """`tgmm` on the Mosaic GPU kernel (`mosaic_tgmm.py`, 16-bit inputs) or on
  Triton's; same arguments and result. `block_sizes` are Triton's tiles."""
  interpret = _backend.pallas_interpret() if interpret is None else interpret
  if mosaic:
    return tgmm_mosaic.tgmm(lhs, dout, starts, ends, out_dtype=out_dtype,
                            interpret=interpret)
  return tgmm(lhs, dout, starts, ends, out_dtype=out_dtype, block_sizes=block_sizes,
              interpret=interpret)


class _Kernels(NamedTuple):
  """Which kernel runs each of the op's matmuls (hashable: a custom_vjp static)."""
  mosaic: bool       # the forward and the input gradient on Mosaic GPU
  mosaic_tgmm: bool  # the weight gradient on Mosaic GPU


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _grouped_matmul(lhs, rhs, starts, ends, block_sizes, kernels, out_dtype):
  return _forward(lhs, rhs, starts, ends, block_sizes, kernels.mosaic, out_dtype)


def _forward(lhs, rhs, starts, ends, block_sizes, mosaic, out_dtype):
  if mosaic:
    return _mosaic_gmm(lhs, rhs, ends, transpose_rhs=False, out_dtype=out_dtype)
  return gmm(lhs, rhs, starts, ends, out_dtype=out_dtype, block_sizes=block_sizes)


def _mosaic_gmm(lhs, rhs, ends, *, transpose_rhs, out_dtype):
  """`mosaic_gmm.gmm`, with K and N padded to its tiles."""
  multiple = mosaic_gmm.candidates().width_multiple
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  lhs_p = _shapes.pad_axis(lhs, 1, multiple)
  rhs_p = _shapes.pad_axis(_shapes.pad_axis(rhs, 1, multiple), 2, multiple)
  n_p = rhs_p.shape[1] if transpose_rhs else rhs_p.shape[2]
  [out] = mosaic_gmm.gmm(lhs_p, rhs_p, ends, transpose_rhs=transpose_rhs,
                         outputs=[jax.ShapeDtypeStruct((lhs.shape[0], n_p), out_dtype)],
                         interpret=_backend.pallas_interpret())
  return out[:, :n]


def _grouped_matmul_fwd(lhs, rhs, starts, ends, block_sizes, kernels, out_dtype):
  out = _forward(lhs, rhs, starts, ends, block_sizes, kernels.mosaic, out_dtype)
  return out, (lhs, rhs, starts, ends)


def _grouped_matmul_bwd(block_sizes, kernels, out_dtype, residuals, dout):
  del out_dtype
  lhs, rhs, starts, ends = residuals
  # The backward multiplies in the operands' dtype, as the forward does.
  dout = dout.astype(lhs.dtype)
  # Rows outside every group got no weight: their lhs gradient is zero, which
  # the pseudo-group of gmm writes.
  if kernels.mosaic:
    dlhs = _mosaic_gmm(dout, rhs, ends, transpose_rhs=True, out_dtype=lhs.dtype)
  else:
    dlhs = gmm(dout, rhs, starts, ends, transpose_rhs=True, block_sizes=block_sizes)
  drhs = weight_gradient(lhs, dout, starts, ends, mosaic=kernels.mosaic_tgmm,
                         block_sizes=block_sizes)
  return (*_pallas.typed_like((dlhs, drhs.astype(rhs.dtype)), (lhs, rhs)), None, None)


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)
_grouped_matmul_shared = _pallas.shared_lowering(_grouped_matmul, static_argnums=(4, 5, 6))


def grouped_matmul_pallas(lhs: jax.Array, rhs: jax.Array, starts: jax.Array,
                          ends: jax.Array, *, out_dtype=None,
                          block_sizes: configs.TritonConfig | None = None,
                          mosaic: bool | None = None,
                          mosaic_tgmm: bool | None = None) -> jax.Array:
  """Differentiable grouped matmul on the Pallas kernels.

  Args:
    lhs: [M, K] float32, bfloat16 or float16.
    rhs: [G, K, N] (same dtype as `lhs`).
    starts, ends: [G] int32 contiguous row bounds (`reference.group_bounds`).
    out_dtype: the result's dtype (default `lhs.dtype`): the kernels round
      their float32 accumulator once to it. The gradients come back in the
      operands' dtype, computed from the cotangent rounded to it.
    block_sizes: tile sizes of the Triton kernels; defaults from
      `configs.TritonConfig.get_default`.
    mosaic: run the matmuls over rows (forward, input gradient) on the Mosaic
      GPU kernel (`mosaic.py`). Default `mosaic.preferred(lhs.dtype)`: 16-bit
      inputs on a Hopper GPU. Off the GPU it runs in Mosaic GPU interpret mode.
    mosaic_tgmm: the same for the weight gradient (`mosaic_tgmm.py`); default
      `mosaic_tgmm_default(lhs.dtype)`.

  Returns:
    [M, N] in `out_dtype`.
  """
  if rhs.dtype != lhs.dtype:
    raise ValueError(f"grouped_matmul_pallas: `rhs` must have lhs's dtype {lhs.dtype}, "
                     f"got {rhs.dtype}")
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  if mosaic is None:
    mosaic = mosaic_gmm.preferred(lhs.dtype)
  if mosaic_tgmm is None:
    mosaic_tgmm = mosaic_tgmm_default(lhs.dtype)
  if mosaic or mosaic_tgmm:
    mosaic_gmm.check_dtype(lhs.dtype, "grouped_matmul", "lhs")
  bs = block_sizes or configs.TritonConfig.get_default(lhs.shape[0], lhs.shape[1],
                                                       rhs.shape[2])
  return _grouped_matmul_shared(lhs, rhs, starts, ends, bs, _Kernels(mosaic, mosaic_tgmm),
                                out_dtype)


def mosaic_tgmm_default(dtype) -> bool:
  """Whether the weight gradients of `grouped_matmul_pallas` and of the grouped
  MLP run the Mosaic GPU kernel (`mosaic_tgmm.py`) by default: where the
  forward does (`mosaic.preferred`, 16-bit inputs on Hopper), measured faster
  than Triton's `tgmm` there (BUILD_NOTES.md, "MoE"). One place, so that a
  benchmark can compare both kernels."""
  return mosaic_gmm.preferred(dtype)
