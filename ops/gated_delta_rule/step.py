"""One token of the gated delta rule (Gated DeltaNet): the decode step.

Yang, Kautz & Hatamizadeh 2024, https://arxiv.org/abs/2412.06464. The
recurrence that `ops.gated_delta_rule` computes for a whole sequence, for one
token, with the state kept as `M = S^T` ([K, V] per head, the layout of
`ops.ssd`):

    M' = exp(g_t) M_{t-1};  u_t = beta_t (v_t - M'^T k_t);  M_t = M' + k_t u_t^T
    y_t = scale * M_t^T q_t

`gated_delta_rule_reference` is this step in a `lax.scan`; GatedDeltaNetCell
decodes with it. The per-token input options of flash-linear-attention
(`l2_normalize`, `write_strength`) live here too, so that every tier applies
them the same way.

Glossary of shapes: B batch, N heads, G query/key groups (N % G == 0),
K key size, V value size.
"""

import jax
import jax.numpy as jnp

from ops.ssd.groups import expand_groups

_F32 = jnp.float32
L2NORM_EPS = 1e-6  # flash-linear-attention's, inside the square root


def l2_normalize(x: jax.Array) -> jax.Array:
  """`x / sqrt(sum(x^2) + 1e-6)` over the last axis, in float32."""
  x = x.astype(_F32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def write_strength(beta: jax.Array, *, use_beta_sigmoid_in_kernel: bool = False,
                   allow_neg_eigval: bool = False) -> jax.Array:
  """The beta the rule uses, float32: `sigmoid(beta)` for a logit, doubled
  with `allow_neg_eigval`."""
  beta = beta.astype(_F32)
  if use_beta_sigmoid_in_kernel:
    beta = jax.nn.sigmoid(beta)
  return 2.0 * beta if allow_neg_eigval else beta


def gated_delta_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                     log_decay: jax.Array | None, beta: jax.Array, *, scale: float,
                     use_qk_l2norm_in_kernel: bool = False,
                     use_beta_sigmoid_in_kernel: bool = False,
                     allow_neg_eigval: bool = False) -> tuple[jax.Array, jax.Array]:
  """One token of `ops.gated_delta_rule`, in float32.

  Args:
    state: [B, N, K, V] float32, the state before this token.
    q: [B, N, K] or [B, G, K] query.
    k: key, the shape of `q` (the rule assumes unit norm).
    v: [B, N, V] value.
    log_decay: [B, N] log of the gate alpha (<= 0), or None (no gate: the
      delta rule).
    beta: [B, N] write strength.
    scale: output scale (`ops.gated_delta_rule`'s default is K ** -0.5).
    use_qk_l2norm_in_kernel: L2-normalize q and k per head first.
    use_beta_sigmoid_in_kernel: `beta` holds logits: the rule uses sigmoid(beta).
    allow_neg_eigval: the rule uses 2 beta (after the sigmoid, if any).

  Returns:
    (y [B, N, V] float32, the state after this token [B, N, K, V] float32).
  """
  heads = v.shape[-2]
  q, k = expand_groups(q, heads), expand_groups(k, heads)
  if use_qk_l2norm_in_kernel:
    q, k = l2_normalize(q), l2_normalize(k)
  q, k, v = (x.astype(_F32) for x in (q, k, v))
  if log_decay is not None:
    state = jnp.exp(log_decay.astype(_F32))[..., None, None] * state
  beta = write_strength(beta, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                        allow_neg_eigval=allow_neg_eigval)
  u = beta[..., None] * (v - jnp.einsum("bnkv,bnk->bnv", state, k))
  state = state + k[..., :, None] * u[..., None, :]
  y = scale * jnp.einsum("bnkv,bnk->bnv", state, q)
  return y, state
