"""Step-by-step reference for the gated delta rule (Gated DeltaNet).

Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", https://arxiv.org/abs/2412.06464. With the state kept as
`M = S^T` ([K, V] per head, the layout of `ops.ssd`):

    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
    <=>  M' = exp(g_t) M_{t-1};  u_t = beta_t (v_t - M'^T k_t);  M_t = M' + k_t u_t^T
    y_t = scale * M_t^T q_t

The specification the chunked tier is tested against, float32 throughout, and
the decode step of GatedDeltaNetCell.

Glossary of shapes: B batch, T time, N heads, K key size, V value size.
"""

import jax
import jax.numpy as jnp

from ops.ssd.reference import expand_groups

_F32 = jnp.float32


def gated_delta_step(state, q, k, v, log_decay, beta, *, scale):
  """One token: state [B, N, K, V] f32, q/k [B, N, K], v [B, N, V],
  log_decay/beta [B, N] -> (y [B, N, V] f32, new state)."""
  q, k, v = (x.astype(_F32) for x in (q, k, v))
  state = jnp.exp(log_decay.astype(_F32))[..., None, None] * state
  u = beta.astype(_F32)[..., None] * (v - jnp.einsum("bnkv,bnk->bnv", state, k))
  state = state + k[..., :, None] * u[..., None, :]
  y = scale * jnp.einsum("bnkv,bnk->bnv", state, q)
  return y, state


def gated_delta_rule_reference(q, k, v, log_decay, beta, *, scale=None,
                               initial_state=None, chunk_size=None):
  """The gated delta rule, one token at a time.

  Args:
    q: [B, T, N, K] (or [B, T, G, K] shared by N // G heads) queries.
    k: keys, the shape of `q` (the rule assumes unit norm: L2-normalize them).
    v: [B, T, N, V] values; sets the output dtype.
    log_decay: [B, T, N] log of the gate alpha (<= 0).
    beta: [B, T, N] write strength (in [0, 1] for a stable rule).
    scale: output scale, default K ** -0.5.
    initial_state: [B, N, K, V] or None (zeros).
    chunk_size: ignored (one signature for every tier).

  Returns:
    y: [B, T, N, V] in `v`'s dtype.
    final_state: [B, N, K, V] float32.
  """
  del chunk_size
  batch, _, heads, value = v.shape
  key = q.shape[-1]
  scale = key ** -0.5 if scale is None else scale
  q, k = expand_groups(q, heads), expand_groups(k, heads)
  h0 = (jnp.zeros((batch, heads, key, value), _F32) if initial_state is None
        else initial_state.astype(_F32))

  def step(state, xs):
    y, state = gated_delta_step(state, *xs, scale=scale)
    return state, y

  xs = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, log_decay, beta))
  final, y = jax.lax.scan(step, h0, xs)
  return jnp.swapaxes(y, 0, 1).astype(v.dtype), final
