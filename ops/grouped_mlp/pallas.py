"""The Pallas implementation of `grouped_mlp`: the activation in the matmul
epilogues, on the Triton kernels (`triton.py`) or the Mosaic GPU ones
(`mosaic.py`), with the plain grouped matmuls of `ops.grouped_matmul`.

Two fused kernels and four of `ops.grouped_matmul`, under one
`jax.custom_vjp`:
- forward: `mlp_in` (h = x @ w_in[g], a = act(h); stores a, and h when a
  gradient will be needed), then `gmm(a, w_out)`;
- backward: `hidden_grad` (dh = act'(h) * (dy @ w_out[g]^T)), then
  `tgmm(a, dy)`, `gmm(dh, w_in^T)` and `tgmm(x, dh)` from `ops.grouped_matmul`.

Float32 weights with a bfloat16 `x` are cast once per call, and their
gradients are stored in float32 straight from the kernels' accumulators.

`mosaic=True` runs the fused kernels on Mosaic GPU (`ops/grouped_mlp/mosaic.py`,
Hopper, 16-bit rows); it is not the default (`mosaic_default` says why). The
two plain grouped matmuls choose their kernel on their own (`mosaic_plain`,
default `mosaic_plain_default`), and so do the two weight gradients
(`mosaic_tgmm`, `ops/grouped_matmul/mosaic_tgmm.py`).

Glossary of shapes: M rows, D input width, F hidden width (Fi = F, or 2F for
SwiGLU, columns of w_in), D' output width, G groups; a `p` suffix means padded
to the tiles.
"""

import functools
from typing import NamedTuple

import jax
import numpy as np

from ops import _backend
from ops import _pallas
from ops import _shapes
from ops.grouped_matmul import configs as gmm_configs
from ops.grouped_matmul import mosaic as mosaic_gmm
from ops.grouped_matmul.pallas import mosaic_tgmm_default
from ops.grouped_matmul.pallas import weight_gradient
from ops.grouped_matmul.triton import gmm
from ops.grouped_mlp import configs
from ops.grouped_mlp import mosaic as mosaic_mlp
from ops.grouped_mlp import triton as triton_mlp
from ops.grouped_mlp.activations import halves


class _Statics(NamedTuple):
  """Hashable facts the backward pass needs about the primal inputs."""
  activation: str
  hidden: int            # F, unpadded
  w_in_dtype: np.dtype
  w_out_dtype: np.dtype
  block_sizes: gmm_configs.TritonConfig
  hidden_grad_block_sizes: gmm_configs.TritonConfig  # of `grouped_mlp_hidden_grad`
  mosaic: bool  # the fused kernels on Mosaic GPU (Hopper) instead of Triton
  mosaic_plain: bool  # the plain grouped matmuls (y = a @ w_out, dx) on Mosaic GPU
  mosaic_tgmm: bool  # the weight gradients on Mosaic GPU
  mosaic_config: gmm_configs.MosaicConfig | None  # None: each kernel's default

  @property
  def width_multiple(self) -> int:
    """What D, F and D' are padded to: a multiple of every tile that spans them."""
    bs = self.block_sizes
    multiple = max(bs.block_k, bs.block_n)
    if self.mosaic or self.mosaic_plain:
      cfg = self.mosaic_config
      multiple = max(multiple, *((cfg.block_k, cfg.block_n) if cfg
                                 else (mosaic_gmm.candidates().width_multiple,)))
    return multiple


def _pad_hidden(w, axis, halves, multiple):
  """Pads the hidden axis to a multiple, each of its `halves` separately."""
  split = w.shape[:axis] + (halves, w.shape[axis] // halves) + w.shape[axis + 1:]
  w = _shapes.pad_axis(w.reshape(split), axis + 1, multiple)
  return w.reshape(w.shape[:axis] + (-1,) + w.shape[axis + 2:])


def _unpad_hidden(w, axis, halves, hidden):
  """Inverse of `_pad_hidden`: keeps the first `hidden` columns of each half."""
  split = w.shape[:axis] + (halves, w.shape[axis] // halves) + w.shape[axis + 1:]
  w = jax.lax.slice_in_dim(w.reshape(split), 0, hidden, axis=axis + 1)
  return w.reshape(w.shape[:axis] + (-1,) + w.shape[axis + 2:])


def _padded_weights(w_in, w_out, dtype, statics):
  """Weights in the compute dtype, padded: [G, Dp, Fip] and [G, Fp, D'p]."""
  multiple = statics.width_multiple
  w_in = _shapes.pad_axis(w_in.astype(dtype), 1, multiple)
  w_in = _pad_hidden(w_in, 2, halves(statics.activation), multiple)
  w_out = _shapes.pad_axis(w_out.astype(dtype), 2, multiple)
  w_out = _pad_hidden(w_out, 1, 1, multiple)
  return w_in, w_out


def _plain_gmm(lhs, rhs, starts, ends, statics, *, transpose_rhs):
  """lhs [Mp, K] times each row's group of rhs ([G, K, N], or [G, N, K] with
  `transpose_rhs`), on the kernel `statics` names; either pads the rows to its
  own tiles."""
  interpret = _backend.pallas_interpret()
  if statics.mosaic_plain:
    [out] = mosaic_gmm.gmm(lhs, rhs, ends, transpose_rhs=transpose_rhs,
                           config=statics.mosaic_config, interpret=interpret)
    return out
  return gmm(lhs, rhs, starts, ends, transpose_rhs=transpose_rhs,
             block_sizes=statics.block_sizes, interpret=interpret)


def _forward(x, w_in, w_out, starts, ends, statics, *, save_hidden):
  bs, act = statics.block_sizes, statics.activation
  interpret = _backend.pallas_interpret()
  num_rows, out_width = x.shape[0], w_out.shape[2]
  w_in_p, w_out_p = _padded_weights(w_in, w_out, x.dtype, statics)
  x_p = _shapes.pad_axis(x, 1, statics.width_multiple)
  hidden_p = w_out_p.shape[1]
  if statics.mosaic:
    cfg = statics.mosaic_config
    a, *h = mosaic_mlp.mlp_in(x_p, w_in_p, ends, activation=act,
                              hidden=hidden_p, save_hidden=save_hidden, config=cfg,
                              interpret=interpret)
  else:
    x_p = _shapes.pad_axis(x_p, 0, bs.block_m)
    a, *h = triton_mlp.mlp_in(x_p, w_in_p, starts, ends, activation=act,
                              hidden=hidden_p, save_hidden=save_hidden, block_sizes=bs,
                              interpret=interpret)
  y = _plain_gmm(a, w_out_p, starts, ends, statics, transpose_rhs=False)
  y = y[:num_rows, :out_width]
  residuals = (x_p, w_in_p, w_out_p, h[0] if h else None, a, starts, ends)
  return y, residuals


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _grouped_mlp(x, w_in, w_out, starts, ends, statics):
  return _forward(x, w_in, w_out, starts, ends, statics, save_hidden=False)[0]


def _grouped_mlp_fwd(x, w_in, w_out, starts, ends, statics):
  y, residuals = _forward(x, w_in, w_out, starts, ends, statics, save_hidden=True)
  return y, (residuals, x.shape, w_out.shape[2])


def _grouped_mlp_bwd(statics, saved, dy):
  (x_p, w_in_p, w_out_p, h, a, starts, ends), x_shape, out_width = saved
  bs, act, hidden = statics.block_sizes, statics.activation, statics.hidden
  interpret = _backend.pallas_interpret()
  dy = dy.astype(x_p.dtype)
  dy_p = _shapes.pad_axis(_shapes.pad_axis(dy, 0, x_p.shape[0]), 1, w_out_p.shape[2])
  if statics.mosaic:
    cfg = statics.mosaic_config
    dh = mosaic_mlp.hidden_grad(dy_p, w_out_p, h, ends, activation=act,
                                config=cfg, interpret=interpret)
  else:
    dh = triton_mlp.hidden_grad(dy_p, w_out_p, h, starts, ends, activation=act,
                                block_sizes=statics.hidden_grad_block_sizes,
                                interpret=interpret)
  dx = _plain_gmm(dh, w_in_p, starts, ends, statics, transpose_rhs=True)  # [Mp, Dp]
  def dw(lhs, dout, out_dtype):
    return weight_gradient(lhs, dout, starts, ends, out_dtype=out_dtype,
                           mosaic=statics.mosaic_tgmm, block_sizes=bs,
                           interpret=interpret)
  dw_out = dw(a, dy_p, statics.w_out_dtype)  # [G, Fp, D'p]
  dw_in = dw(x_p, dh, statics.w_in_dtype)  # [G, Dp, Fip]
  num_rows, width = x_shape
  dw_in = _unpad_hidden(dw_in[:, :width], 2, halves(act), hidden)
  dw_out = _unpad_hidden(dw_out[:, :, :out_width], 1, 1, hidden)
  grads = _pallas.typed_like((dx[:num_rows, :width], dw_in, dw_out), (x_p, w_in_p, w_out_p))
  return (*grads, None, None)


_grouped_mlp.defvjp(_grouped_mlp_fwd, _grouped_mlp_bwd)
_grouped_mlp_shared = _pallas.shared_lowering(_grouped_mlp, static_argnums=(5,))


def mosaic_default(dtype) -> bool:
  """Whether `grouped_mlp_pallas` runs the Mosaic GPU kernels by default: no.

  Its fused epilogues (two stored outputs; a tile of h read back) cost more
  than its faster main loop saves: the MoE layer ran slower with them on an
  H200 (BUILD_NOTES.md, "MoE"). The plain grouped matmuls are another matter
  (`ops.grouped_matmul`, `mosaic_gmm.preferred`), see `mosaic_plain_default`.
  """
  del dtype
  return False


def mosaic_plain_default(dtype) -> bool:
  """Whether the two plain grouped matmuls of the MLP (the forward's
  `a @ w_out` and the input gradient `dh @ w_in^T`) run on the Mosaic GPU
  kernel when the fused ones stay on Triton: as `ops.grouped_matmul` does
  (`mosaic_gmm.preferred`, bf16/f16 on Hopper).
  """
  return mosaic_gmm.preferred(dtype)


def grouped_mlp_pallas(x: jax.Array, w_in: jax.Array, w_out: jax.Array,
                       starts: jax.Array, ends: jax.Array, *, activation: str,
                       block_sizes: gmm_configs.TritonConfig | None = None,
                       mosaic: bool | None = None,
                       mosaic_plain: bool | None = None,
                       mosaic_tgmm: bool | None = None,
                       mosaic_config: gmm_configs.MosaicConfig | None = None) -> jax.Array:
  """Differentiable grouped MLP on the Pallas kernels.

  Args:
    x: [M, D] float32 or bfloat16.
    w_in: [G, D, Fi] (Fi = F, or 2F for 'swiglu'), float32 or x.dtype.
    w_out: [G, F, D'], float32 or x.dtype.
    starts, ends: [G] int32 contiguous row bounds (`group_bounds`).
    activation: 'gelu' or 'swiglu'.
    block_sizes: tile sizes of every Triton kernel; defaults from
      `ops.grouped_matmul.TritonConfig.get_default(M, D, F)`, with the hidden
      gradient's as `configs.TritonConfig` changes them.
    mosaic: run the matmuls with x's rows on the Mosaic GPU kernels
      (`mosaic.py`; the weight gradients as `mosaic_tgmm` says); default
      `mosaic_default(x.dtype)`, which is False. Off the GPU they run in
      Mosaic GPU interpret mode.
    mosaic_plain: the same for the two plain grouped matmuls alone (the
      fused kernels as `mosaic` says); default `mosaic` if given, else
      `mosaic_plain_default(x.dtype)`.
    mosaic_tgmm: the two weight gradients on the Mosaic GPU kernel
      (`ops/grouped_matmul/mosaic_tgmm.py`); default
      `ops.grouped_matmul.pallas.mosaic_tgmm_default(x.dtype)`.
    mosaic_config: their tiles; default per kernel (`mosaic_gmm.choose_config`).

  Returns:
    [M, D'] in `x.dtype`; gradients of the weights in their own dtypes.
  """
  if mosaic_plain is None:
    mosaic_plain = mosaic if mosaic is not None else mosaic_plain_default(x.dtype)
  if mosaic is None:
    mosaic = mosaic_default(x.dtype)
  if mosaic_tgmm is None:
    mosaic_tgmm = mosaic_tgmm_default(x.dtype)
  if mosaic or mosaic_plain or mosaic_tgmm:
    mosaic_gmm.check_dtype(x.dtype, "grouped_mlp", "x")
  hidden = w_out.shape[1]
  grad_bs = block_sizes
  if block_sizes is None:
    block_sizes = gmm_configs.TritonConfig.get_default(x.shape[0], x.shape[1], hidden)
    grad_bs = configs.TritonConfig().hidden_grad(block_sizes)
  statics = _Statics(activation=activation, hidden=hidden,
                     w_in_dtype=np.dtype(w_in.dtype), w_out_dtype=np.dtype(w_out.dtype),
                     block_sizes=block_sizes, hidden_grad_block_sizes=grad_bs,
                     mosaic=mosaic, mosaic_plain=mosaic_plain,
                     mosaic_tgmm=mosaic_tgmm, mosaic_config=mosaic_config)
  return _grouped_mlp_shared(x, w_in, w_out, starts, ends, statics)
