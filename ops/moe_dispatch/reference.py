"""The specification of `moe_dispatch`: every expert on every token, then a
masked combine.

Token t's output is `sum_j gates[t, j] * expert_{expert_ids[t, j]}(x[t])`,
each expert a bias-free MLP `act(x @ w_in[e]) @ w_out[e]`. With a capacity
factor, an assignment beyond its expert's C slots (choice-major priority)
contributes nothing. This is also the 'dense' path: E / k times the
arithmetic the routing needs, in x's dtype.

Glossary of shapes: T tokens, D d_model, F d_hidden (F' = F, or 2F for
SwiGLU, columns of w_in), E experts, k top_k.
"""

import jax
import jax.numpy as jnp

from ops.grouped_mlp.activations import activate
from ops.grouped_mlp.activations import Activation
from ops.moe_dispatch.sorting import capacity_positions
from ops.moe_dispatch.sorting import expert_capacity


def dense_experts(x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                  w_in: jax.Array, w_out: jax.Array, *,
                  activation: Activation) -> jax.Array:
  """Every expert on every token, combined by the gates: [T, D] -> [T, D].

  Args:
    x: [T, D]; expert_ids: [T, k] (E: no expert); gates: [T, k] float32;
    w_in: [E, D, F'] and w_out: [E, F, D], in x's dtype.
    activation: 'gelu' or 'swiglu'.
  """
  num_experts = w_in.shape[0]
  combine = jnp.sum(jax.nn.one_hot(expert_ids, num_experts) * gates[..., None], axis=1)
  h = activate(jnp.einsum("td,edf->etf", x, w_in), activation)
  y = jnp.einsum("etf,efd->etd", h, w_out)  # [E, T, D]
  return jnp.einsum("te,etd->td", combine.astype(x.dtype), y)


def moe_dispatch_reference(x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                           w_in: jax.Array, w_out: jax.Array, *,
                           activation: Activation = "gelu",
                           capacity_factor: float | None = None
                           ) -> tuple[jax.Array, jax.Array]:
  """The mixture of experts on routed tokens, computed densely on one device.

  Args:
    x: [T, D] tokens.
    expert_ids: [T, k] int, each token's experts.
    gates: [T, k], each assignment's weight in the token's output.
    w_in: [E, D, F] for 'gelu', [E, D, 2F] for 'swiglu' (gate columns first).
    w_out: [E, F, D].
    activation: 'gelu' (`jax.nn.gelu`, tanh form) or 'swiglu'.
    capacity_factor: None (dropless), else each expert takes
      C = ceil(capacity_factor * T * k / E) assignments, first choices before
      second choices, then in token order.

  Returns:
    y: [T, D] in x's dtype (the weights are cast to it).
    keep: [T, k] bool, the assignments that reached their expert.
  """
  w_in, w_out = w_in.astype(x.dtype), w_out.astype(x.dtype)
  num_tokens, top_k = expert_ids.shape
  num_experts = w_in.shape[0]
  if capacity_factor is None:
    keep = jnp.ones(expert_ids.shape, bool)
  else:
    capacity = expert_capacity(capacity_factor, num_tokens, top_k, num_experts)
    _, keep = capacity_positions(expert_ids, num_experts, capacity)
  y = dense_experts(x, expert_ids, gates.astype(jnp.float32) * keep, w_in, w_out,
                    activation=activation)
  return y, keep
