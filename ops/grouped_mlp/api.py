"""`ops.grouped_mlp`: one two-layer MLP per contiguous group of rows.

The expert layer of a dropless mixture of experts after its tokens are sorted
by expert: row i of group g is `act(x[i] @ w_in[g]) @ w_out[g]`. Two
`ops.grouped_matmul` calls compute the same function; this op exists so that
the Pallas path can apply the activation (and, backward, its derivative)
inside the matmul kernels instead of in separate passes over the hidden
activations (triton.py says how).

Glossary of shapes: M rows, D input width, F hidden width, D' output width,
G groups.
"""

import jax
import jax.numpy as jnp

from ops import _shapes
from ops import registry
from ops.grouped_matmul import api as grouped_matmul_api
from ops.grouped_matmul import configs as grouped_matmul_configs
from ops.grouped_matmul.api import kernel_limit
from ops.grouped_matmul.api import run_rows_per_shard
from ops.grouped_matmul.api import validate_group_sizes
from ops.grouped_mlp import configs
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
                implementation: registry.Choice = None) -> jax.Array:
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
    implementation: None (on NVIDIA GPUs the kernels where measured faster,
      `ops/dispatch_tables/grouped_mlp.json`; XLA elsewhere and where
      unmeasured), 'pallas' (the kernels as tuned per dtype: Triton's fused
      matmuls, Mosaic GPU's where pallas.py's defaults put them; interpret
      mode off GPU), 'triton' (every matmul on Triton), 'mosaic' (every matmul
      on Mosaic GPU: 16-bit operands on a Hopper GPU), 'xla'
      (`jax.lax.ragged_dot`), or a sequence of these tried in order
      (`ops.registry`).

  Returns:
    [M, D'] in `x.dtype`. Both matmuls run in x's dtype with float32
    accumulation (float32 weights are cast); gradients come back in each
    input's own dtype.

  Raises:
    ValueError: for bad shapes, dtypes or activation, and for concrete
      `group_sizes` that are negative or sum to more than M.
  """
  _validate(x, w_in, w_out, group_sizes, activation)
  call = dict(x=x, w_in=w_in, w_out=w_out, group_sizes=group_sizes, activation=activation)
  return IMPLEMENTATIONS.choose(implementation, call).run(**call)


def _xla(**call):
  return xla.grouped_mlp_xla(**call)


def _kernels(**lowering):
  """The kernel path, with `lowering` (pallas.py's mosaic flags) fixing which
  matmuls run on Mosaic GPU; none given: pallas.py's tuned defaults."""
  def run(x, w_in, w_out, group_sizes, activation):
    return run_rows_per_shard(
        "grouped_mlp", lambda x, w_in, w_out, starts, ends: pallas.grouped_mlp_pallas(
            x, w_in, w_out, starts, ends, activation=activation, **lowering),
        ("x", x), (("w_in", w_in), ("w_out", w_out)), group_sizes)
  return run


def _kernel_supports(call) -> str | None:
  return kernel_limit("x", call["x"].shape[0], "w_in", call["w_in"].shape[0])


def _mosaic_supports(call) -> str | None:
  if (limit := _kernel_supports(call)) is not None:
    return limit
  return grouped_matmul_api.IMPLEMENTATIONS["mosaic"].supports(dict(
      lhs=call["x"], rhs=call["w_in"], out_dtype=call["x"].dtype, precision=None))


# ops/dispatch_tables/grouped_mlp.json, where it exists, times the kernels as 'pallas'.
IMPLEMENTATIONS = registry.Registry("grouped_mlp", table="grouped_mlp")
IMPLEMENTATIONS.register("xla", _xla)
IMPLEMENTATIONS.register("pallas", _kernels(), supports=_kernel_supports, kernel=True)
IMPLEMENTATIONS.register("triton", _kernels(mosaic=False, mosaic_tgmm=False),
                         supports=_kernel_supports, kernel=True, config=configs.TritonConfig)
# The Mosaic GPU kernels run on the grouped matmul's tiles (grouped_mlp has none of its own).
IMPLEMENTATIONS.register("mosaic", _kernels(mosaic=True, mosaic_tgmm=True),
                         supports=_mosaic_supports, kernel=True,
                         config=grouped_matmul_configs.MosaicConfig)
