"""The experts on one device's tokens: dropless (dense or sorted) or with capacity.

Each function runs whole on one device, or inside the op's `jax.shard_map` on
one shard of the tokens. The sorted paths ('ragged_dot', 'sort', 'gmm') sort
the assignments by expert (`sorting.py`), run the experts on the sorted rows
and unsort; 'dense' runs every expert on every token (`reference.py`).

Glossary of shapes: T tokens (of this device), D d_model, F d_hidden (F' = F,
or 2F for SwiGLU, columns of w_in), E experts, k top_k, A = T * k assignments,
R rows, C expert capacity.
"""

import jax
import jax.numpy as jnp

from ops import registry
from ops.grouped_mlp.activations import activate
from ops.grouped_mlp.activations import Activation
from ops.grouped_mlp.api import grouped_mlp
from ops.moe_dispatch.block_padded import block_padded_experts
from ops.moe_dispatch.reference import dense_experts
from ops.moe_dispatch.sorting import gather_tokens
from ops.moe_dispatch.sorting import sort_by_expert
from ops.moe_dispatch.sorting import unsort


def sorted_experts(xs: jax.Array, group_sizes: jax.Array, sorted_ids: jax.Array,
                   w_in: jax.Array, w_out: jax.Array, *, activation: Activation,
                   impl: str, gmm_implementation: registry.Choice) -> jax.Array:
  """Experts on rows sorted by expert: [R, D] -> [R, D] (empty rows -> 0).

  'gmm' and 'ragged_dot' are `ops.grouped_mlp` (its kernels, or its XLA path
  of two `ragged_dot`s), which takes the float32 weights, casts them and
  returns float32 gradients; 'sort' takes them in xs's dtype.

  Args:
    xs: [R, D]; group_sizes: [E]; sorted_ids: [R] (E: empty row);
    w_in: [E, D, F']; w_out: [E, F, D].
    activation: 'gelu' or 'swiglu'.
    impl: 'ragged_dot', 'sort' or 'gmm'.
    gmm_implementation: `ops.grouped_mlp`'s `implementation` on 'gmm'.
  """
  if impl == "sort":
    return block_padded_experts(xs, group_sizes, sorted_ids, w_in.astype(xs.dtype),
                                w_out.astype(xs.dtype), activation)
  implementation = gmm_implementation if impl == "gmm" else "xla"
  return grouped_mlp(xs, w_in, w_out, group_sizes, activation=activation,
                     implementation=implementation)


def experts_on_rows(rows: jax.Array, ids: jax.Array, w_in: jax.Array, w_out: jax.Array,
                    *, activation: Activation, impl: str,
                    gmm_implementation: registry.Choice) -> jax.Array:
  """Rows [R, D] each bound for expert ids[r] (E = none) -> [R, D].

  Args as `sorted_experts`, with `impl` also 'dense'; ids: [R].
  """
  num_experts = w_in.shape[0]
  if impl == "dense":
    return dense_experts(rows, ids[:, None], jnp.ones(ids.shape + (1,), jnp.float32),
                         w_in, w_out, activation=activation)
  order, inverse, group_sizes, sorted_ids = sort_by_expert(ids, num_experts)
  xs = gather_tokens(rows, order, inverse, 1)
  ys = sorted_experts(xs, group_sizes, sorted_ids, w_in, w_out, activation=activation,
                      impl=impl, gmm_implementation=gmm_implementation)
  return unsort(ys, order, inverse)


def dropless_experts(x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                     w_in: jax.Array, w_out: jax.Array, *, activation: Activation,
                     impl: str, gmm_implementation: registry.Choice) -> jax.Array:
  """Dropless experts for local tokens: [T, D] -> [T, D].

  Args:
    x: [T, D]; expert_ids: [T, k]; gates: [T, k] float32; w_in: [E, D, F'];
      w_out: [E, F, D] (in x's dtype for 'dense').
    activation, impl, gmm_implementation: as `experts_on_rows`.
  """
  num_tokens, d = x.shape
  top_k = expert_ids.shape[1]
  num_experts = w_in.shape[0]
  if impl == "dense":
    return dense_experts(x, expert_ids, gates, w_in, w_out, activation=activation)
  order, inverse, group_sizes, sorted_ids = sort_by_expert(expert_ids.reshape(-1),
                                                           num_experts)
  xs = gather_tokens(x, order, inverse, top_k)  # [A, D]
  ys = sorted_experts(xs, group_sizes, sorted_ids, w_in, w_out, activation=activation,
                      impl=impl, gmm_implementation=gmm_implementation)
  y = unsort(ys, order, inverse).reshape(num_tokens, top_k, d)  # [T, k, D]
  return jnp.einsum("tk,tkd->td", gates.astype(x.dtype), y)


def capacity_experts(x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                     slot: jax.Array, keep: jax.Array, w_in: jax.Array, w_out: jax.Array,
                     *, capacity: int, activation: Activation) -> jax.Array:
  """Token-dropping experts on [E, C, D] buffers (GShard/Switch style).

  Args:
    x: [T, D]; expert_ids, gates, slot, keep: [T, k] (`capacity_positions`);
    w_in: [E, D, F'] and w_out: [E, F, D] in x's dtype.
    capacity: C.
    activation: 'gelu' or 'swiglu'.

  Returns:
    [T, D]; dropped assignments contribute nothing.
  """
  num_tokens, d = x.shape
  top_k = expert_ids.shape[1]
  num_experts = w_in.shape[0]
  dest = jnp.where(keep, expert_ids * capacity + slot, num_experts * capacity)  # [T, k]
  tokens = jnp.broadcast_to(x[:, None, :], (num_tokens, top_k, d))
  buffer = jnp.zeros((num_experts * capacity, d), x.dtype).at[dest.reshape(-1)].set(
      tokens.reshape(-1, d), mode="drop").reshape(num_experts, capacity, d)
  h = activate(jnp.einsum("ecd,edf->ecf", buffer, w_in), activation)
  out = jnp.einsum("ecf,efd->ecd", h, w_out).reshape(num_experts * capacity, d)
  y = out.at[dest.reshape(-1)].get(mode="fill", fill_value=0).reshape(num_tokens, top_k, d)
  return jnp.einsum("tk,tkd->td", (gates * keep).astype(x.dtype), y)
