"""`ops.moe_dispatch`: routed tokens through their experts and back.

The expert layer of a mixture of experts after routing: token t's output is
`sum_j gates[t, j] * expert_{expert_ids[t, j]}(x[t])`, each expert a bias-free
MLP `act(x @ w_in[e]) @ w_out[e]`. Dropless by default (MegaBlocks,
https://arxiv.org/abs/2211.15841: grouped matmuls over tokens sorted by
expert); with a capacity factor, Switch/GShard's expert capacity
(https://arxiv.org/abs/2101.03961).

`dropless_impl` picks how the tokens reach their experts; every path computes
the function of `reference.py`:
- 'dense': every expert on every token, then a masked combine (the reference).
- 'ragged_dot': sort the assignments by expert, `jax.lax.ragged_dot`.
- 'sort': sort, pad each expert's rows to a block multiple, and run a batched
  matmul over blocks with each block's expert weights gathered
  (`block_padded.py`).
- 'gmm': sort, `ops.grouped_mlp`: both grouped matmuls with the activation in
  their kernels.
- 'auto': `choose_dropless_impl`.

Glossary of shapes: T tokens, D d_model, F d_hidden (F' = F, or 2F for
SwiGLU, columns of w_in), E experts, k top_k, N shards of the tokens over
the mesh, T_s = T / N, El local experts, C expert capacity.
"""

import numbers
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
import numpy as np

from ops import _shapes
from ops import registry
from ops.grouped_mlp import IMPLEMENTATIONS as GROUPED_MLP_IMPLEMENTATIONS
from ops.grouped_mlp.activations import Activation
from ops.grouped_mlp.activations import ACTIVATIONS
from ops.moe_dispatch.experts import capacity_experts
from ops.moe_dispatch.experts import dropless_experts
from ops.moe_dispatch.exchange import dispatch_plan
from ops.moe_dispatch.exchange import expert_parallel_experts
from ops.moe_dispatch.exchange import TOKENS
from ops.moe_dispatch.reference import dense_experts
from ops.moe_dispatch.sorting import capacity_positions
from ops.moe_dispatch.sorting import expert_capacity

DroplessImpl = Literal["dense", "ragged_dot", "sort", "gmm", "auto"]
DROPLESS_IMPLS = ("dense", "ragged_dot", "sort", "gmm", "auto")
# `ops.grouped_mlp`'s `implementation`, taken on the 'gmm' path.
GroupedMatmulImplementation = registry.Choice
GROUPED_MATMUL_IMPLEMENTATIONS = (None, *GROUPED_MLP_IMPLEMENTATIONS.names)

_OP = "moe_dispatch"


def choose_dropless_impl(num_tokens: int, num_experts: int, top_k: int, d_model: int,
                         d_hidden: int) -> str:
  """The 'auto' rule: the fastest measured path for the platform.

  On NVIDIA GPUs, the path timed fastest (fwd+bwd) at the measured layer that
  judges this one (`ops/dispatch_tables/moe.json`), among those measured on
  this device kind ('gmm', the Pallas kernels, only where they passed their
  check there); 'ragged_dot' where nothing decides. Elsewhere the Pallas
  kernel would run interpreted, so XLA's 'ragged_dot' is used.
  (`IMPLEMENTATIONS.choose(None, ...)`, the registry's default.)

  Args:
    num_tokens: T; num_experts: E; top_k: k; d_model: D; d_hidden: F.

  Returns:
    'dense', 'ragged_dot', 'sort' or 'gmm'.
  """
  return IMPLEMENTATIONS.choose(None, {}, **_measured_at(
      num_tokens, num_experts, top_k, d_model, d_hidden)).name


def _measured_at(num_tokens, num_experts, top_k, d_model, d_hidden) -> dict:
  """The call's point on the axes of ops/dispatch_tables/moe.json."""
  return dict(experts=num_experts, top_k=top_k, d_model=d_model, d_hidden=d_hidden,
              tokens=num_tokens)


def _check_options(activation, dropless_impl, capacity_factor, expert_axis,
                   grouped_matmul_implementation) -> None:
  for name, value, choices in (
      ("activation", activation, ACTIVATIONS),
      ("dropless_impl", dropless_impl, DROPLESS_IMPLS)):
    if not (value is None or isinstance(value, str)) or value not in choices:
      raise ValueError(f"{_OP}: `{name}` must be one of {choices}, got {value!r}")
  GROUPED_MLP_IMPLEMENTATIONS.check(grouped_matmul_implementation,
                                    "grouped_matmul_implementation")
  if capacity_factor is not None:
    if isinstance(capacity_factor, (bool, np.bool_)) or not (
        isinstance(capacity_factor, numbers.Real) or getattr(capacity_factor, "shape", 1) == ()):
      raise TypeError(f"{_OP}: `capacity_factor` must be a number or None, got "
                      f"{capacity_factor!r}")
    if not float(capacity_factor) > 0:
      raise ValueError(f"{_OP}: `capacity_factor` must be > 0, got {capacity_factor!r}")
  if expert_axis is not None and not isinstance(expert_axis, str):
    raise TypeError(f"{_OP}: `expert_axis` must be a mesh axis name or None, got "
                    f"{expert_axis!r}")
  if expert_axis == "":
    raise ValueError(f"{_OP}: `expert_axis` must be a mesh axis name or None, got ''")
  if capacity_factor is not None and expert_axis is not None:
    raise ValueError(f"{_OP}: `capacity_factor` with `expert_axis` is not supported: "
                     "the expert-parallel path is dropless")


def _check_arrays(x, expert_ids, gates, w_in, w_out, activation) -> None:
  _shapes.check_arrays(_OP, (("x", x), ("expert_ids", expert_ids), ("gates", gates),
                             ("w_in", w_in), ("w_out", w_out)))
  if x.ndim != 2 or x.shape[1] < 1:
    raise ValueError(f"{_OP}: `x` must be [T, D] with D >= 1, got shape {x.shape}")
  if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0] or expert_ids.shape[1] < 1:
    raise ValueError(f"{_OP}: `expert_ids` must be [T, k] with T = {x.shape[0]} and "
                     f"k >= 1, got shape {expert_ids.shape}")
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise ValueError(f"{_OP}: `expert_ids` must be integers, got {expert_ids.dtype}")
  if gates.shape != expert_ids.shape:
    raise ValueError(f"{_OP}: `gates` must have the shape of `expert_ids` "
                     f"{expert_ids.shape}, got {gates.shape}")
  _shapes.check_inexact(_OP, (("x", x), ("gates", gates), ("w_in", w_in),
                              ("w_out", w_out)))
  if w_in.ndim != 3 or w_out.ndim != 3 or w_in.shape[0] != w_out.shape[0]:
    raise ValueError(f"{_OP}: `w_in` and `w_out` must be [E, D, F'] and [E, F, D] with "
                     f"the same E, got {w_in.shape=} {w_out.shape=}")
  if w_in.shape[0] < 1:
    raise ValueError(f"{_OP}: there must be at least one expert, got {w_in.shape=}")
  swiglu = activation == "swiglu"
  if (w_in.shape[1:] != (x.shape[1], (2 if swiglu else 1) * w_out.shape[1])
      or w_out.shape[2] != x.shape[1]):
    raise ValueError(f"{_OP}: with D = {x.shape[1]} and activation={activation!r}, "
                     f"`w_in` must be [E, D, {'2F' if swiglu else 'F'}] and `w_out` "
                     f"[E, F, D], got {w_in.shape=} {w_out.shape=}")


def _experts_per_shard(x, expert_ids, gates, w_in, w_out, *, num_experts, capacity,
                       expert_axis, activation, impl, gmm_implementation):
  """The experts on one shard's tokens (on all of them when nothing is split).

  Args:
    x: [T_s, D]; expert_ids, gates: [T_s, k]; w_in: [E or El, D, F'];
      w_out: [E or El, F, D].
    capacity: None (dropless) or C, the slots per expert in this shard.

  Returns:
    [T_s, D] when dropless; else ([T_s, D], keep [T_s, k] bool).
  """
  common = dict(activation=activation, impl=impl, gmm_implementation=gmm_implementation)
  if expert_axis is not None:
    return expert_parallel_experts(x, expert_ids, gates, w_in, w_out,
                                   expert_axis=expert_axis, num_experts=num_experts,
                                   **common)
  if capacity is None:
    return dropless_experts(x, expert_ids, gates, w_in, w_out, **common)
  slot, keep = capacity_positions(expert_ids, num_experts, capacity)
  if impl == "dense":
    y = dense_experts(x, expert_ids, gates * keep, w_in, w_out, activation=activation)
  else:
    y = capacity_experts(x, expert_ids, gates, slot, keep, w_in, w_out,
                         capacity=capacity, activation=activation)
  return y, keep


def moe_dispatch(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, w_in: jax.Array,
                 w_out: jax.Array, *, activation: Activation = "gelu",
                 dropless_impl: DroplessImpl = "auto",
                 capacity_factor: float | None = None, expert_axis: str | None = None,
                 grouped_matmul_implementation: GroupedMatmulImplementation = None
                 ) -> tuple[jax.Array, jax.Array]:
  """Each token through its routed experts, mixed by its gates: [T, D] -> [T, D].

  Token t's output is `sum_j gates[t, j] * expert_{expert_ids[t, j]}(x[t])`
  with expert e the MLP `act(x @ w_in[e]) @ w_out[e]`
  (`moe_dispatch_reference`).

  Under a mesh (`jax.set_mesh(mesh)`, or inputs with Explicit-axis types) the
  experts run once per shard of the tokens (one `jax.shard_map`), which split
  like a batch: over the axes `x`'s Explicit type names, else over the
  mesh's Auto axes (`ops/_sharding.py`: a T they do not divide is padded,
  except with `capacity_factor`, where a padded token would take capacity
  and such a T is a ValueError). With `expert_axis` (n devices) the experts
  split over it too, device i holding experts [i E/n, (i+1) E/n), and the
  tokens move by all-to-all in [n, T_s k, D] buffers sized so that nothing
  drops; `w_in` and `w_out` split along E over `expert_axis` are never
  gathered. Under Explicit types `y` returns in `x`'s layout.

  Args:
    x: [T, D] tokens, float32 or bfloat16 (the experts compute in its dtype).
    expert_ids: [T, k] int, each token's experts in [0, E).
    gates: [T, k] float32, each assignment's weight.
    w_in: [E, D, F] for 'gelu', [E, D, 2F] for 'swiglu' (gate columns first),
      float32 or x's dtype.
    w_out: [E, F, D], float32 or x's dtype.
    activation: 'gelu' (`jax.nn.gelu`, tanh form) or 'swiglu'
      (`jax.nn.silu(gate) * value`).
    dropless_impl: how the tokens reach their experts: 'dense', 'ragged_dot',
      'sort', 'gmm' or 'auto' (module docstring; 'auto' is
      `choose_dropless_impl`). Every value computes the same function. With
      `capacity_factor`, 'dense' applies the drops to the dense reference and
      every other value uses [E, C, D] buffers.
    capacity_factor: None (dropless), else each expert takes
      C = ceil(capacity_factor * T_s * k / E) assignments of each shard's
      T_s tokens (T_s = T with no mesh), first choices before second
      choices, then in token order, and drops the rest.
    expert_axis: None, or the mesh axis to split the experts and the tokens
      over (E and T multiples of its size); call under `jax.set_mesh(mesh)`.
      Not with `capacity_factor`.
    grouped_matmul_implementation: `ops.grouped_mlp`'s `implementation` on
      the 'gmm' path (`ops.grouped_mlp.IMPLEMENTATIONS`: None, a name or a
      sequence of names).

  Returns:
    y: [T, D] in x's dtype.
    keep: [T, k] bool, the assignments that reached their expert (all True
      when dropless).

  Raises:
    TypeError: for an argument that is not an array, a `capacity_factor`
      that is not a number or an `expert_axis` that is not a string.
    ValueError: for bad shapes or dtypes, an unknown option, a
      `capacity_factor` <= 0 or with `expert_axis`; with `expert_axis`, when
      it is not an axis of the mesh in context or E or T is not a multiple of
      its size; with `capacity_factor`, when T does not split evenly over
      the mesh's Auto axes.
  """
  _check_options(activation, dropless_impl, capacity_factor, expert_axis,
                 grouped_matmul_implementation)
  _check_arrays(x, expert_ids, gates, w_in, w_out, activation)
  num_tokens, d_model = x.shape
  num_experts, top_k = w_in.shape[0], expert_ids.shape[1]
  impl = IMPLEMENTATIONS.choose(
      None if dropless_impl == "auto" else dropless_impl, {},
      **_measured_at(num_tokens, num_experts, top_k, d_model, w_out.shape[1])).name
  if impl == "dense" or capacity_factor is not None:
    w_in, w_out = w_in.astype(x.dtype), w_out.astype(x.dtype)
  # else the sorted paths cast in `experts.sorted_experts` ('gmm' inside its op).
  plan = dispatch_plan(_OP, x, expert_ids, gates, w_in, w_out, expert_axis,
                       dropless=capacity_factor is None)
  capacity = None
  if capacity_factor is not None:  # per shard: the formula on its own tokens
    capacity = expert_capacity(capacity_factor, num_tokens // plan.size("batch"), top_k,
                               num_experts)

  def experts(*args):
    return _experts_per_shard(
        *args, num_experts=num_experts, capacity=capacity, expert_axis=expert_axis,
        activation=activation, impl=impl, gmm_implementation=grouped_matmul_implementation)

  if capacity is None:
    y = plan.run(experts, TOKENS)  # [T, D]
    keep = jnp.ones_like(expert_ids, dtype=bool)
  else:
    y, keep = plan.run(experts, [TOKENS, TOKENS])
  if plan.splits and AxisType.Explicit in plan.mesh.axis_types:
    # Explicit types: give y x's layout (expert parallelism may split finer).
    spec = jax.typeof(x).sharding.spec
    if jax.typeof(y).sharding.spec != spec:
      y = jax.sharding.reshard(y, spec)
  return y, keep


def _path(name: str):
  """Registered for its name: `moe_dispatch` runs the chosen path per shard."""
  def run(**call):
    del call
    return name
  return run


# How the tokens reach their experts, chosen by ops/dispatch_tables/moe.json
# on NVIDIA GPUs ('auto' = None); every path takes every call.
IMPLEMENTATIONS = registry.Registry(_OP, table="moe", established=("ragged_dot",))
for _name in ("gmm", "ragged_dot", "sort", "dense"):
  IMPLEMENTATIONS.register(_name, _path(_name), kernel=_name == "gmm")
