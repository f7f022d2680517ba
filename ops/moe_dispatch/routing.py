"""The router of a mixture of experts: float32 logits, top-k, gates, aux losses.

Switch Transformer (https://arxiv.org/abs/2101.03961): top-k routing and the
load-balancing loss. ST-MoE (https://arxiv.org/abs/2202.08906): the router
z-loss.

Glossary of shapes: T tokens, D d_model, E experts, k top_k.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
  """The router's decisions for T tokens (all float32)."""
  logits: jax.Array      # [T, E]
  probs: jax.Array       # [T, E] softmax over experts
  expert_ids: jax.Array  # [T, k] int32, the top-k experts of each token
  gates: jax.Array       # [T, k] top-k probabilities renormalized to sum to 1


def route(x: jax.Array, w_router: jax.Array, top_k: int) -> Routing:
  """Softmax router with top-k and renormalized gates, in float32.

  Args:
    x: [T, D] tokens (any float dtype).
    w_router: [D, E] float32.
    top_k: experts per token.

  Returns:
    The `Routing` of the T tokens.
  """
  logits = router_logits(x, w_router.astype(jnp.float32))  # [T, E]
  probs = jax.nn.softmax(logits, axis=-1)
  top_probs, expert_ids = top_k_experts(probs, top_k)  # [T, k]
  gates = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
  return Routing(logits, probs, expert_ids, gates)


def _bfloat16_parts(a: jax.Array, axis: int) -> jax.Array:
  """Three bfloat16 arrays summing to float32 `a`, concatenated along `axis`.

  8 + 8 + 8 significand bits hold all 24 of a float32 (up to underflow of the
  last part), so a product with a bfloat16 operand, accumulated in float32,
  loses nothing that a float32 matmul would keep.
  """
  hi = a.astype(jnp.bfloat16)
  rest = a - hi.astype(jnp.float32)
  mid = rest.astype(jnp.bfloat16)
  lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
  return jnp.concatenate([hi, mid, lo], axis=axis)


@jax.custom_vjp
def _router_logits_bf16(x, w):
  """bf16 x [T, D] @ f32 w [D, E] -> f32 [T, E], to float32 accuracy."""
  num_experts = w.shape[1]
  parts = jnp.dot(x, _bfloat16_parts(w, axis=1), preferred_element_type=jnp.float32)
  return parts.reshape(x.shape[0], 3, num_experts).sum(axis=1)


def _router_logits_bf16_fwd(x, w):
  return _router_logits_bf16(x, w), (x, w)


def _router_logits_bf16_bwd(residuals, dlogits):
  x, w = residuals
  # dx is rounded to bfloat16: the default (TF32 on GPUs) product is enough.
  dx = jnp.dot(dlogits, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
  parts = jnp.dot(x.T, _bfloat16_parts(dlogits, axis=1),
                  preferred_element_type=jnp.float32)  # [D, 3E]
  dw = parts.reshape(w.shape[0], 3, w.shape[1]).sum(axis=1)
  return dx, dw


_router_logits_bf16.defvjp(_router_logits_bf16_fwd, _router_logits_bf16_bwd)


def router_logits(x: jax.Array, w_router: jax.Array) -> jax.Array:
  """Router logits `x @ w_router` in float32: [T, D] x [D, E] -> [T, E].

  A float32 matmul at full precision (no TF32) of a [T, D] x [D, 8] shape
  runs at a fraction of the GPU's speed; for bfloat16 tokens the weights are
  split into three bfloat16 parts instead (`_bfloat16_parts`), one native
  bfloat16 matmul with float32 accumulation that keeps float32 accuracy.

  Args:
    x: [T, D] tokens, float32 or bfloat16.
    w_router: [D, E] float32.

  Returns:
    [T, E] float32.
  """
  if x.dtype == jnp.bfloat16:
    return _router_logits_bf16(x, w_router)
  return jnp.dot(x.astype(jnp.float32), w_router, precision=jax.lax.Precision.HIGHEST)


def top_k_experts(probs: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
  """`jax.lax.top_k` over the last axis as k argmax passes (ties: lowest index).

  For the few experts of a router this fuses into elementwise work, where the
  general top-k is a separate, slower kernel on GPUs; the gradient flows
  through one-hot products instead of a scatter.

  Args:
    probs: [T, E].
    top_k: k <= E.

  Returns:
    (values [T, k], ids [T, k] int32), largest first.
  """
  remaining = probs
  values, ids = [], []
  for _ in range(top_k):
    idx = jnp.argmax(remaining, axis=-1).astype(jnp.int32)  # [T]
    pick = jax.nn.one_hot(idx, probs.shape[-1], dtype=probs.dtype)  # [T, E]
    values.append(jnp.sum(probs * pick, axis=-1))
    ids.append(idx)
    remaining = jnp.where(pick > 0, -jnp.inf, remaining)
  return jnp.stack(values, axis=-1), jnp.stack(ids, axis=-1)


def load_balance_loss(routing: Routing, num_experts: int) -> jax.Array:
  """Switch loss `E * sum_e f_e P_e`: f_e the fraction of assignments to
  expert e, P_e its mean router probability. 1.0 when perfectly balanced.

  Args:
    routing: the router's decisions for T tokens.
    num_experts: E.

  Returns:
    A float32 scalar; its gradient flows through P_e only.
  """
  counts = tokens_per_expert(routing.expert_ids, num_experts)  # [E]
  fraction = counts / routing.expert_ids.size
  mean_prob = jnp.mean(routing.probs, axis=0)  # [E]
  return num_experts * jnp.sum(jax.lax.stop_gradient(fraction) * mean_prob)


def router_z_loss(routing: Routing) -> jax.Array:
  """ST-MoE z-loss: mean squared log-partition of the router logits.

  Args:
    routing: the router's decisions for T tokens.

  Returns:
    A float32 scalar.
  """
  return jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1)))


def tokens_per_expert(expert_ids: jax.Array, num_experts: int) -> jax.Array:
  """How many assignments each expert receives (before any drop).

  Args:
    expert_ids: [T, k].
    num_experts: E.

  Returns:
    [E] float32.
  """
  return jnp.sum(jax.nn.one_hot(expert_ids, num_experts), axis=(0, 1))
