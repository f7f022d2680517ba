"""Mixture-of-experts feed-forward layer: dropless by default, or with capacity.

Switch Transformer (https://arxiv.org/abs/2101.03961): top-k routing, the
load-balancing loss and expert capacity. ST-MoE (https://arxiv.org/abs/2202.08906):
the router z-loss. MegaBlocks (https://arxiv.org/abs/2211.15841): dropless
experts as grouped matmuls over tokens sorted by expert.

The layer holds the parameters, routes (`route`) and records the router's
statistics; the op `ops.moe_dispatch` (ops/moe_dispatch/) runs the experts:
the dispatch paths, capacity, and the split over a mesh.

Glossary of shapes: T tokens (every leading axis of the input, flattened),
D d_model, F d_hidden, E experts, k top_k, N shards of the tokens over the
mesh, T_s = T / N tokens of one shard, n devices on `expert_axis`, C expert
capacity. How the layer splits over a mesh: `MoELayer`'s docstring.
"""

import math
from typing import Any, Callable

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import ops
from ops.grouped_mlp import Activation
from ops.grouped_mlp import IMPLEMENTATIONS as GROUPED_MLP_IMPLEMENTATIONS
from ops.moe_dispatch import capacity_positions
from ops.moe_dispatch import choose_dropless_impl
from ops.moe_dispatch import DROPLESS_IMPLS
from ops.moe_dispatch import DroplessImpl
from ops.moe_dispatch import GROUPED_MATMUL_IMPLEMENTATIONS
from ops.moe_dispatch import GroupedMatmulImplementation
from ops.moe_dispatch import load_balance_loss
from ops.moe_dispatch import route
from ops.moe_dispatch import router_logits
from ops.moe_dispatch import router_z_loss
from ops.moe_dispatch import Routing
from ops.moe_dispatch import tokens_per_expert
from probjax_hk import arguments
from probjax_hk import layers

__all__ = ("capacity_positions", "choose_dropless_impl", "DROPLESS_IMPLS", "DroplessImpl",
           "expert_parameter_sharding", "load_balance_loss", "MoELayer", "route",
           "router_logits", "router_z_loss", "Routing")

_EXPERT_WEIGHTS = ("w_in", "w_out")  # the parameters `expert_parameter_sharding` splits


def _path_leaf_name(path) -> str:
  """The last name in a parameter path: a key path, a tuple or 'a/b/c'."""
  if isinstance(path, str):
    return path.rsplit("/", 1)[-1]
  last = path[-1] if len(path) else ""
  for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
    if hasattr(last, attr):
      return str(getattr(last, attr))
  return str(last)


def expert_parameter_sharding(expert_axis: str) -> Callable[[Any, Any], P | None]:
  """A `fit(..., parameter_sharding=...)` rule placing MoE experts over a mesh axis.

  Each device then holds `num_experts / n` experts' weights and their
  optimizer state (n the size of `expert_axis`), which is what
  `MoELayer(expert_axis=...)`'s shard_map takes without a gather. Every other
  parameter is replicated. Compose it with another rule for the rest:
  `lambda path, leaf: expert_rule(path, leaf) or other_rule(path, leaf)`.

  Args:
    expert_axis: the mesh axis given to the layers as `MoELayer(expert_axis=...)`.

  Returns:
    `rule(path, leaf) -> PartitionSpec | None`: for a leaf named `w_in` or
    `w_out` (MoELayer's [E, D, F'] and [E, F, D] expert weights; with more
    dimensions, as under `hk.layer_stack`, the leading ones are stacked
    layers) the spec splitting its expert dimension over `expert_axis`, e.g.
    `P('expert')` or `P(None, 'expert')`; None (replicated) otherwise.
    `path` is a key path (`jax.tree_util.tree_map_with_path`), a tuple of
    names or a '/'-joined string.

  Raises:
    ValueError: when `expert_axis` is not a non-empty string.
  """
  if not isinstance(expert_axis, str) or not expert_axis:
    raise ValueError(f"`expert_axis` must be a mesh axis name, got {expert_axis!r}")

  def rule(path, leaf) -> P | None:
    ndim = len(getattr(leaf, "shape", ()))
    if _path_leaf_name(path) in _EXPERT_WEIGHTS and ndim >= 3:
      return P(*([None] * (ndim - 3)), expert_axis)
    return None
  return rule


class MoELayer(hk.Module):
  """Top-k mixture-of-experts MLP, `[..., D] -> [..., D]`.

  Experts are bias-free MLPs (`w_in` [E, D, F] with GELU, or [E, D, 2F] with
  SwiGLU; `w_out` [E, F, D]); parameters are float32 and the experts compute
  in the input's dtype. The router computes in float32 whatever the input.

  State written with `hk.set_state` on every call (use `hk.transform_with_state`)
  so that a training loop can add `aux_loss` to its loss and log the rest::

    aux_loss:            load_balance_loss_weight * load_balance_loss
                         + router_z_loss_weight * router_z_loss   (scalar, f32)
    load_balance_loss:   Switch's `E * sum_e f_e P_e` (1.0 when balanced)
    router_z_loss:       mean squared logsumexp of the router logits
    tokens_per_expert:   [E] f32 assignments routed to each expert (before drops)
    dropped_tokens:      scalar int32 assignments dropped for capacity (0 when
                         dropless)

  Sharding. Under a mesh (`jax.set_mesh(mesh)`, or inputs with Explicit-axis
  types) the experts run once per shard of the tokens, through
  `ops.moe_dispatch` (one `jax.shard_map`); with no mesh the layer runs whole.
  Routing is per token, so every split computes the same function, and the
  aux losses and `tokens_per_expert` are reduced over all T tokens (equal to
  one device's).

  - Data parallel (no `expert_axis`): the tokens split like the batch, over
    the mesh axes `x` is sharded over (Explicit types) or, for Auto axes, over
    all of the mesh's axes, a T they do not divide padded (with
    `capacity_factor`, where a padded token would take capacity, such a T
    is a ValueError). Each device routes, sorts and runs the experts on its
    own T/N tokens: no token leaves its device, only the loss, the aux
    losses and the weight gradients are all-reduced. Each device holds every expert: 2 E D F floats (3 E D F for
    SwiGLU), plus their gradients and optimizer state.
  - Capacity (`capacity_factor`) is per shard, as in GShard and Switch: each
    device gives each expert C = ceil(capacity_factor * (T/N) * k / E) slots
    for its own tokens, with choice-major priority among them. So which
    tokens drop depends on N: on N devices the layer equals the unsharded
    layer applied to each device's tokens separately (N = 1: the global rule).
  - Expert parallel (`expert_axis` of size n): device i on `expert_axis` holds
    experts [i E/n, (i+1) E/n) (`w_in` [E/n, D, F'], `w_out` [E/n, F, D]: the
    shard_map takes them split along E, so weights placed that way, e.g. by
    `fit(..., parameter_sharding=expert_parameter_sharding(expert_axis))`,
    are never gathered; replicated ones are sliced). The tokens split over
    their batch axes and `expert_axis` (on a ('data', 'expert') mesh: over
    both, each 'data' group exchanging its own tokens along 'expert'), and
    move by all-to-all in [n, T_s k, D] buffers (T_s tokens a device), sized
    for the worst case so that nothing drops: per device E/n experts'
    weights and state, plus about 2 n T_s k D activations in flight. With
    Explicit types and `x` split over fewer axes than that, `y` returns in
    `x`'s layout (an all-gather of [T_s, D] rows along `expert_axis`); split
    the batch over both axes to avoid it.
  """

  def __init__(self, num_experts: int, top_k: int, d_hidden: int, *,
               activation: Activation = "gelu", dropless_impl: DroplessImpl = "auto",
               capacity_factor: float | None = None,
               router_z_loss_weight: float = 1e-3,
               load_balance_loss_weight: float = 1e-2,
               expert_axis: str | None = None,
               grouped_matmul_implementation: GroupedMatmulImplementation = None,
               name: str | None = None):
    """Constructs the layer.

    Args:
      num_experts: E >= 1.
      top_k: experts per token, 1 <= top_k <= num_experts.
      d_hidden: F, each expert's hidden width.
      activation: 'gelu' or 'swiglu'.
      dropless_impl: how the experts are run; every path computes the same
        function:

        - `'dense'`: every expert on every token, then a masked combine (the
          reference; E / k times the arithmetic the routing needs).
        - `'ragged_dot'`: sort assignments by expert, `jax.lax.ragged_dot`.
        - `'sort'`: sort, pad each expert's rows to a block multiple, and run a
          batched matmul over blocks with each block's expert weights gathered.
        - `'gmm'`: sort, `ops.grouped_mlp`: both grouped matmuls with the
          activation in their kernels (Pallas on NVIDIA GPUs, `ragged_dot`
          elsewhere).
        - `'auto'`: on NVIDIA GPUs the path measured fastest
          (`ops/dispatch_tables/moe.json`; 'gmm' only where its kernels passed
          their check on that device kind), elsewhere 'ragged_dot'.

        With `capacity_factor`, 'dense' applies the drops to the dense
        reference and every other value uses [E, C, D] buffers.
      capacity_factor: None for dropless; else each expert takes
        C = ceil(capacity_factor * T * k / E) assignments and drops the rest
        (T the tokens of one shard when the tokens are split: class docstring).
      router_z_loss_weight, load_balance_loss_weight: weights in `aux_loss`.
      expert_axis: mesh axis to shard the experts (E / n each, n its size)
        and the tokens over, exchanging tokens with all-to-all; call under
        `jax.set_mesh(mesh)`. E and T must be multiples of n.
      grouped_matmul_implementation: `implementation` of `ops.grouped_mlp`
        on the 'gmm' path (None: Pallas on NVIDIA GPUs, XLA elsewhere).
      name: module name.

    Raises:
      TypeError: a size that is not an integer, a factor or weight that is
        not a number, or an `expert_axis` that is not a string.
      ValueError: a size below 1, `top_k` above `num_experts`, a factor or
        weight out of range, an unknown `activation`, `dropless_impl` or
        `grouped_matmul_implementation`, or `capacity_factor` with
        `expert_axis`.
    """
    arguments.check_name(name)
    super().__init__(name=name or "moe_layer")
    arguments.check_positive_ints(num_experts=num_experts, top_k=top_k, d_hidden=d_hidden)
    if top_k > num_experts:
      raise ValueError(f"`top_k` must be in [1, num_experts], got {top_k=} {num_experts=}")
    arguments.check_choice("activation", activation, layers.ACTIVATIONS)
    arguments.check_choice("dropless_impl", dropless_impl, DROPLESS_IMPLS)
    arguments.check_positive_numbers_or_none(capacity_factor=capacity_factor)
    arguments.check_nonnegative_numbers(router_z_loss_weight=router_z_loss_weight,
                                        load_balance_loss_weight=load_balance_loss_weight)
    if expert_axis is not None and not isinstance(expert_axis, str):
      raise TypeError(f"`expert_axis` must be a mesh axis name or None, got {expert_axis!r}")
    if expert_axis == "":
      raise ValueError("`expert_axis` must be a mesh axis name or None, got ''")
    GROUPED_MLP_IMPLEMENTATIONS.check(grouped_matmul_implementation,
                                      "grouped_matmul_implementation")
    if capacity_factor is not None and expert_axis is not None:
      raise ValueError("`capacity_factor` with `expert_axis` is not supported: the "
                       "expert-parallel path is dropless")
    self.num_experts = num_experts
    self.top_k = top_k
    self.d_hidden = d_hidden
    self.activation = activation
    self.dropless_impl = dropless_impl
    self.capacity_factor = capacity_factor
    self.router_z_loss_weight = router_z_loss_weight
    self.load_balance_loss_weight = load_balance_loss_weight
    self.expert_axis = expert_axis
    self.grouped_matmul_implementation = grouped_matmul_implementation

  def __call__(self, x: jax.Array) -> jax.Array:
    """Routes each token to its top-k experts and mixes their outputs.

    Args:
      x: [..., D] float32 or bfloat16; the leading axes (T tokens in all)
        may be sharded like a batch (class docstring).

    Returns:
      [..., D] in `x.dtype`.

    Raises:
      ValueError: for a bad `x` shape; with `expert_axis`, when it is not an
        axis of the mesh in context or E or T is not a multiple of its size.
    """
    if x.ndim < 1 or x.shape[-1] < 1:
      raise ValueError(f"`x` must be [..., D] with D >= 1, got shape {x.shape}")
    d_model = x.shape[-1]
    e, f = self.num_experts, self.d_hidden
    x2 = x.reshape(-1, d_model)  # [T, D]
    w_router = hk.get_parameter("router", [d_model, e], jnp.float32,
                                init=hk.initializers.TruncatedNormal(1.0 / math.sqrt(d_model)))
    f_in = 2 * f if self.activation == "swiglu" else f
    w_in = hk.get_parameter("w_in", [e, d_model, f_in], jnp.float32,
                            init=hk.initializers.TruncatedNormal(1.0 / math.sqrt(d_model)))
    w_out = hk.get_parameter("w_out", [e, f, d_model], jnp.float32,
                             init=hk.initializers.TruncatedNormal(1.0 / math.sqrt(f)))
    routing = route(x2, w_router, self.top_k)  # float32
    y, keep = ops.moe_dispatch(
        x2, routing.expert_ids, routing.gates, w_in, w_out, activation=self.activation,
        dropless_impl=self.dropless_impl, capacity_factor=self.capacity_factor,
        expert_axis=self.expert_axis,
        grouped_matmul_implementation=self.grouped_matmul_implementation)  # [T, D]
    if self.capacity_factor is None:
      dropped = jnp.zeros((), jnp.int32)
    else:
      dropped = jnp.sum(~keep).astype(jnp.int32)

    balance = load_balance_loss(routing, e)
    z_loss = router_z_loss(routing)
    hk.set_state("aux_loss", self.load_balance_loss_weight * balance
                 + self.router_z_loss_weight * z_loss)
    hk.set_state("load_balance_loss", balance)
    hk.set_state("router_z_loss", z_loss)
    hk.set_state("tokens_per_expert", tokens_per_expert(routing.expert_ids, e))
    hk.set_state("dropped_tokens", dropped)
    return y.reshape(x.shape).astype(x.dtype)
