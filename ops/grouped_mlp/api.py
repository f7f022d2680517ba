"""`ops.grouped_mlp`: one two-layer MLP per contiguous group of rows.

The expert layer of a dropless mixture of experts after its tokens are sorted
by expert: row i of group g is `act(x[i] @ w_in[g]) @ w_out[g]`. Two
`ops.grouped_matmul` calls compute the same function; this op exists so that
the Pallas path can apply the activation (and, backward, its derivative)
inside the matmul kernels instead of in separate passes over the hidden
activations (pallas.py says how).

Glossary of shapes: M rows, D input width, F hidden width, D' output width,
G groups.
"""

import jax
import jax.numpy as jnp

from ops import _backend
from ops import _shapes
from ops.grouped_matmul.api import kernel_limit
from ops.grouped_matmul.api import run_rows_per_shard
from ops.grouped_matmul.api import validate_group_sizes
from ops.grouped_mlp import pallas
from ops.grouped_mlp import xla
from ops.grouped_mlp.activations import Activation
from ops.grouped_mlp.activations import ACTIVATIONS

_DTYPES = (jnp.float32, jnp.bfloat16)


def _validate(x, w_in, w_out, group_sizes, activation) -> None:
  if activation not in ACTIVATIONS:
    raise ValueError(f"`activation` must be one of {ACTIVATIONS}, got "
                     f"{activation!r}")
  _shapes.check_arrays("grouped_mlp", (("x", x), ("w_in", w_in), ("w_out", w_out),
                                       ("group_sizes", group_sizes)))
  if x.ndim != 2:
    raise ValueError(f"`x` must be [M, D], got shape {x.shape}")
  if w_in.ndim != 3 or w_out.ndim != 3:
    raise ValueError(f"`w_in` and `w_out` must be [G, D, Fi] and [G, F, D'], got "
                     f"{w_in.shape=} {w_out.shape=}")
  if w_in.shape[1] != x.shape[1]:
    raise ValueError(f"`w_in` [G, D, Fi] must take the D = {x.shape[1]} columns of "
                     f"`x`, got {w_in.shape=}")
  if w_in.shape[0] != w_out.shape[0]:
    raise ValueError(f"`w_in` and `w_out` must have the same number of groups G, got "
                     f"{w_in.shape=} {w_out.shape=}")
  fi = (2 if activation == "swiglu" else 1) * w_out.shape[1]
  if w_in.shape[2] != fi:
    raise ValueError(f"with activation={activation!r}, `w_in` [G, D, Fi] needs "
                     f"Fi = {fi} columns for the F = {w_out.shape[1]} rows of "
                     f"`w_out`, got {w_in.shape=}")
  if x.dtype not in _DTYPES:
    raise ValueError(f"`x` must be float32 or bfloat16, got {x.dtype}")
  for name, w in (("w_in", w_in), ("w_out", w_out)):
    if w.dtype not in (jnp.float32, x.dtype):
      raise ValueError(f"`{name}` must be float32 or x's dtype {x.dtype}, got "
                       f"{w.dtype}")
  validate_group_sizes(group_sizes, x.shape[0], w_in.shape[0])


def grouped_mlp(x: jax.Array, w_in: jax.Array, w_out: jax.Array,
                group_sizes: jax.Array, *, activation: Activation = "gelu",
                implementation: _backend.Implementation = None) -> jax.Array:
  """Grouped two-layer MLP: row i of group g is `act(x[i] @ w_in[g]) @ w_out[g]`.

  Args:
    x: [M, D] float32 or bfloat16.
    w_in: [G, D, F] for 'gelu', [G, D, 2F] for 'swiglu' (gate columns first),
      float32 or x.dtype.
    w_out: [G, F, D'], float32 or x.dtype.
    group_sizes: [G] non-negative integers, the rows of each group in order
      (`ops.grouped_matmul`'s convention: rows after the last group are zero
      in the output and get zero gradient).
    activation: 'gelu' (`jax.nn.gelu`, tanh form) or 'swiglu'
      (`jax.nn.silu(gate) * value`).
    implementation: None (the Pallas kernels on NVIDIA GPUs, else XLA),
      'pallas' (interpret mode off GPU) or 'xla' (`jax.lax.ragged_dot`).

  Returns:
    [M, D'] in `x.dtype`. Both matmuls run in x's dtype with float32
    accumulation (float32 weights are cast); gradients come back in each
    input's own dtype.

  Raises:
    ValueError: for bad shapes, dtypes or activation, and for concrete
      `group_sizes` that are negative or sum to more than M.
  """
  _validate(x, w_in, w_out, group_sizes, activation)
  backend = _backend.choose("grouped_mlp", implementation,
                            lambda: kernel_limit("x", x.shape[0], "w_in", w_in.shape[0]))
  if backend == "pallas":
    return run_rows_per_shard(
        "grouped_mlp", lambda x, w_in, w_out, starts, ends: pallas.grouped_mlp_pallas(
            x, w_in, w_out, starts, ends, activation=activation),
        ("x", x), (("w_in", w_in), ("w_out", w_out)), group_sizes)
  return xla.grouped_mlp_xla(x, w_in, w_out, group_sizes, activation=activation)
