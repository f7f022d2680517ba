"""Expert parallelism: how the dispatch splits over a mesh, and the all-to-all
exchange of tokens between the devices that hold the experts.

Without `expert_axis` each shard of the tokens runs every expert on its own
tokens. With it, device i on `expert_axis` (n devices) holds experts
[i El, (i + 1) El), El = E / n, and each device sends its assignments to the
devices holding their experts and receives the results back, in buffers
sized for the worst case so that nothing drops.

Glossary of shapes: T tokens, T_s = T / N tokens of one of N shards, D
d_model, F d_hidden (F' = F, or 2F for SwiGLU, columns of w_in), E experts,
El local experts, k top_k, A_s = T_s * k assignments of one shard, n devices
on `expert_axis`.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from ops import registry
from ops import _sharding
from ops.grouped_mlp.activations import Activation
from ops.moe_dispatch.experts import experts_on_rows
from ops.moe_dispatch.sorting import gather_tokens
from ops.moe_dispatch.sorting import sort_by_expert
from ops.moe_dispatch.sorting import unsort

TOKENS = ("batch", None)  # [T, D] and [T, k]: tokens split like a batch
EXPERTS = ("experts", None, None)  # [E, D, F']: split over `expert_axis` only


def dispatch_plan(op: str, x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                  w_in: jax.Array, w_out: jax.Array,
                  expert_axis: str | None, *, dropless: bool = True) -> _sharding.Plan:
  """How the dispatch splits over the mesh (`ops/_sharding.plan`).

  Tokens split like a batch: over the axes their Explicit types name, else
  over the context mesh's Auto axes (`_sharding`'s rule, padding a token
  count they do not divide when `dropless`: a padded token then takes no
  other token's place). Without `expert_axis` the expert weights are
  replicated; with it they split over `expert_axis` alone, and the tokens
  over their batch axes plus `expert_axis` (or over `expert_axis` alone when
  the token count does not divide that product), so each group of devices
  along `expert_axis` exchanges its own tokens.

  Args:
    op: the op's name, for messages.
    x: [T, D]; expert_ids, gates: [T, k]; w_in: [E, D, F']; w_out: [E, F, D].
    expert_axis: None, or the mesh axis the experts split over.
    dropless: False when each shard's experts take a capacity of its tokens.

  Raises:
    ValueError: when `expert_axis` is not an Auto or Explicit axis of the
      mesh in context, when the experts or tokens do not divide over it, or
      when a capacity is kept and the tokens do not divide over the mesh.
  """
  weights = EXPERTS if expert_axis is not None else (None,) * 3
  plan = _sharding.plan(op, (
      ("x", x, TOKENS), ("expert_ids", expert_ids, TOKENS), ("gates", gates, TOKENS),
      ("w_in", w_in, weights), ("w_out", w_out, weights)),
      split=("batch", "experts") if expert_axis is not None else ("batch",),
      pad=expert_axis is None)
  if expert_axis is None:
    if plan.rows is not None and not dropless:
      axes = plan.axes["batch"]
      raise ValueError(
          f"{op}: the token count {x.shape[0]} (every leading axis of `x`) cannot be "
          f"split evenly over mesh axes {axes} of sizes "
          f"{tuple(plan.mesh.shape[a] for a in axes)}, and with `capacity_factor` the "
          "tokens cannot be padded (a padded token would take capacity): make it a "
          f"multiple of {plan.size('batch')}")
    return plan
  mesh = plan.mesh
  if mesh.empty or expert_axis not in mesh.axis_names:
    raise ValueError(f"`expert_axis`={expert_axis!r} is not an axis of the current mesh "
                     f"({mesh.axis_names if not mesh.empty else 'no mesh set'}); call "
                     "it under `jax.set_mesh(mesh)`")
  if dict(zip(mesh.axis_names, mesh.axis_types))[expert_axis] == AxisType.Manual:
    raise ValueError(f"`expert_axis`={expert_axis!r} is already manual (inside a "
                     "`shard_map` over it); call it outside that shard_map")
  num_devices = mesh.shape[expert_axis]
  num_experts, num_tokens = w_in.shape[0], x.shape[0]
  if num_experts % num_devices:
    raise ValueError(f"`num_experts`={num_experts} must be a multiple of the "
                     f"{num_devices} devices on mesh axis {expert_axis!r}")
  if plan.axes.get("experts", (expert_axis,)) != (expert_axis,):
    raise ValueError(f"`w_in` and `w_out` are sharded over {plan.axes['experts']} along "
                     f"their expert axis (axis 0), but `expert_axis` is {expert_axis!r}; "
                     "place them with `expert_parameter_sharding(expert_axis)`")
  batch = plan.axes.get("batch", ())
  if expert_axis not in batch:
    wider = tuple(a for a in batch if a != expert_axis) + (expert_axis,)
    batch = wider if num_tokens % math.prod(mesh.shape[a] for a in wider) == 0 else (
        expert_axis,)
  if num_tokens % math.prod(mesh.shape[a] for a in batch):
    raise ValueError(f"the token count {num_tokens} (every leading axis of `x`) must be "
                     f"a multiple of the {num_devices} devices on mesh axis "
                     f"{expert_axis!r}")
  return dataclasses.replace(plan, axes={**plan.axes, "batch": batch,
                                         "experts": (expert_axis,)})


def expert_parallel_experts(x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                            w_in: jax.Array, w_out: jax.Array, *, expert_axis: str,
                            num_experts: int, activation: Activation, impl: str,
                            gmm_implementation: registry.Choice) -> jax.Array:
  """One device's part of the expert-parallel dispatch (inside `jax.shard_map`).

  Each device sorts its assignments by expert, sends each device on
  `expert_axis` its rows in a [n, A_s, D] buffer (sized for the worst case,
  every local assignment bound for one device, so no token is ever dropped),
  runs its El experts on what it received, and sends the results back.

  Args:
    x: [T_s, D] this device's tokens; expert_ids, gates: [T_s, k] (global
      expert ids).
    w_in: [El, D, F'] and w_out: [El, F, D], the experts this device holds:
      device i on `expert_axis` holds experts [i * El, (i + 1) * El).
    expert_axis: the mesh axis (manual here) the experts split over.
    num_experts: E.
    activation, impl, gmm_implementation: as `experts.experts_on_rows`.

  Returns:
    [T_s, D].
  """
  num_tokens, d = x.shape
  top_k = expert_ids.shape[1]
  num_assign = num_tokens * top_k
  local_experts = w_in.shape[0]
  num_devices = num_experts // local_experts
  order, inverse, group_sizes, sorted_ids = sort_by_expert(expert_ids.reshape(-1),
                                                           num_experts)
  xs = gather_tokens(x, order, inverse, top_k)  # [A_s, D] in expert order
  device = sorted_ids // local_experts  # [A_s] destination of each row
  per_device = group_sizes.reshape(num_devices, local_experts).sum(axis=1)  # [n]
  slot = jnp.arange(num_assign) - (jnp.cumsum(per_device) - per_device)[device]
  send = jnp.zeros((num_devices, num_assign, d), x.dtype).at[device, slot].set(xs)
  send_ids = jnp.full((num_devices, num_assign), local_experts, jnp.int32).at[
      device, slot].set(sorted_ids % local_experts)
  recv = jax.lax.all_to_all(send, expert_axis, 0, 0)  # [n, A_s, D] by source
  recv_ids = jax.lax.all_to_all(send_ids, expert_axis, 0, 0)
  y_rows = experts_on_rows(recv.reshape(-1, d), recv_ids.reshape(-1), w_in, w_out,
                           activation=activation, impl=impl,
                           gmm_implementation=gmm_implementation)
  back = jax.lax.all_to_all(y_rows.reshape(num_devices, num_assign, d), expert_axis, 0, 0)
  ys = back[device, slot]  # [A_s, D] in expert order
  y = unsort(ys, order, inverse).reshape(num_tokens, top_k, d)
  return jnp.einsum("tk,tkd->td", gates.astype(x.dtype), y)
