"""Mosaic GPU (Hopper) kernels of `grouped_mlp`: the activation in the epilogues.

The same two fused kernels as the Triton ones in `triton.py`, on
`ops.grouped_matmul.mosaic.gmm` (TMA, wgmma, warp specialization):
- `mlp_in`: `a = act(x @ w_in[g])`, and the pre-activation `h` when a gradient
  will be taken;
- `hidden_grad`: `dh = act'(h) * (dy @ w_out[g]^T)`, with the `h` tile read in
  the epilogue.
The plain grouped matmuls of the MLP (`a @ w_out`, `dh @ w_in^T`) are
`mosaic.gmm` without an epilogue; the weight gradients are chosen on their
own (`pallas.py`'s `mosaic_tgmm`).

Shapes as in `pallas.py`: x [M, Dp], w_in [G, Dp, Fip], w_out [G, Fp, D'p], with
every padded width a multiple of the config's `block_k` and `block_n`.
"""

import jax
import jax.numpy as jnp

from ops.grouped_matmul import configs
from ops.grouped_matmul import mosaic
from ops.grouped_mlp.activations import activation_grads
from ops.grouped_mlp.activations import activation_value
from ops.grouped_mlp.activations import approximate_tanh
from ops.grouped_mlp.activations import col_offsets


def mlp_in(x, w_in, ends, *, activation: str, hidden: int, save_hidden: bool,
           config: configs.MosaicConfig | None, interpret: bool) -> list[jax.Array]:
  """[a] or [a, h]: a [M, Fp] = act(h), h [M, Fip] = x @ w_in[g]."""
  offsets = col_offsets(activation, hidden)
  num_rows = x.shape[0]
  outputs = [jax.ShapeDtypeStruct((num_rows, hidden), x.dtype)]
  results = [(0, 0)]
  if save_hidden:
    outputs.append(jax.ShapeDtypeStruct((num_rows, w_in.shape[2]), x.dtype))
    results += [(1, offset) for offset in offsets]

  def epilogue(accs, _):
    act = activation_value(accs, activation, jnp.tanh)
    return [act] + (accs if save_hidden else [])

  return mosaic.gmm(x, w_in, ends, config=config, col_offsets=offsets,
                    outputs=outputs,
                    epilogue=mosaic.Epilogue(epilogue, (), tuple(results)),
                    approx_math=approximate_tanh(x.dtype, interpret), interpret=interpret)


def hidden_grad(dy, w_out, h, ends, *, activation: str,
                config: configs.MosaicConfig | None, interpret: bool) -> jax.Array:
  """dh [M, Fip] = act'(h) * (dy @ w_out[g]^T), both halves for SwiGLU."""
  hidden = w_out.shape[1]
  offsets = tuple((0, offset) for offset in col_offsets(activation, hidden))

  def epilogue(accs, pre):
    return activation_grads(accs[0], pre, activation, jnp.tanh)

  [dh] = mosaic.gmm(dy, w_out, ends, transpose_rhs=True, config=config,
                    inputs=[h], outputs=[jax.ShapeDtypeStruct(h.shape, dy.dtype)],
                    epilogue=mosaic.Epilogue(epilogue, offsets, offsets),
                    approx_math=approximate_tanh(dy.dtype, interpret), interpret=interpret)
  return dh
