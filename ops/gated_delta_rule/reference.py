"""Step-by-step reference for the gated delta rule (Gated DeltaNet).

Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", https://arxiv.org/abs/2412.06464. With the state kept as
`M = S^T` ([K, V] per head, the layout of `ops.ssd`):

    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
    <=>  M' = exp(g_t) M_{t-1};  u_t = beta_t (v_t - M'^T k_t);  M_t = M' + k_t u_t^T
    y_t = scale * M_t^T q_t

The specification the chunked tier is tested against: one `lax.scan` step per
token (`ops/gated_delta_rule/step.py`'s `gated_delta_step`, the decode step of
GatedDeltaNetCell), float32 throughout. With no gate (`log_decay=None`) it is
the plain delta rule (Yang et al. 2024, https://arxiv.org/abs/2406.06484).
The input options of flash-linear-attention's `chunk_gated_delta_rule` act on
each token: `use_qk_l2norm_in_kernel` (`x / sqrt(|x|^2 + 1e-6)` for q and k),
`use_beta_sigmoid_in_kernel` (beta given as a logit) and `allow_neg_eigval`
(beta doubled, into [0, 2]: the transition `I - beta k k^T` may then have a
negative eigenvalue).

Glossary of shapes: B batch, T time, N heads, K key size, V value size.
"""

import jax
import jax.numpy as jnp

from ops.gated_delta_rule.step import gated_delta_step
from ops.ssd.groups import expand_groups
from ops.ssd.reference import scan_tokens

_F32 = jnp.float32


def no_gate(log_decay: jax.Array | None, beta: jax.Array) -> jax.Array:
  """`log_decay`, or for the plain delta rule (None) float32 zeros like `beta`
  [B, T, N] (sharded like it)."""
  return jnp.zeros_like(beta, _F32) if log_decay is None else log_decay


def gated_delta_rule_reference(q, k, v, log_decay, beta, *, scale=None,
                               initial_state=None, chunk_size=None, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=False,
                               use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
  """The gated delta rule, one token at a time.

  Args:
    q: [B, T, N, K] (or [B, T, G, K] shared by N // G heads) queries.
    k: keys, the shape of `q` (the rule assumes unit norm: L2-normalize them).
    v: [B, T, N, V] values; sets the output dtype.
    log_decay: [B, T, N] log of the gate alpha (<= 0), or None (no gate: the
      delta rule).
    beta: [B, T, N] write strength (in [0, 1] for a stable rule, [0, 2] with
      `allow_neg_eigval`).
    scale: output scale, default K ** -0.5.
    initial_state: [B, N, K, V] ([S, N, K, V] with `cu_seqlens`) or None (zeros).
    chunk_size: ignored (one signature for every tier).
    cu_seqlens: None, or int [S + 1]: B = 1 and the time axis packs S
      sequences, each from its own initial state (`ops/ssd/varlen.py`).
    use_qk_l2norm_in_kernel: L2-normalize q and k per token and head first.
    use_beta_sigmoid_in_kernel: `beta` holds logits: the rule uses sigmoid(beta).
    allow_neg_eigval: the rule uses 2 beta (after the sigmoid, if any).

  Returns:
    y: [B, T, N, V] in `v`'s dtype.
    final_state: [B, N, K, V] float32 ([S, N, K, V] with `cu_seqlens`).
  """
  del chunk_size
  key = q.shape[-1]
  scale = key ** -0.5 if scale is None else scale
  q, k = expand_groups(q, v.shape[2]), expand_groups(k, v.shape[2])

  def step(state, xs):
    y, state = gated_delta_step(
        state, *xs, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval)
    return state, y

  return scan_tokens(step, (q, k, v, no_gate(log_decay, beta), beta), v, key,
                     initial_state, cu_seqlens)
