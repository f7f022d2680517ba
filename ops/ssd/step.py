"""One token of SSD, the state-space dual of Mamba-2: the decode step.

Dao & Gu 2024, https://arxiv.org/abs/2405.21060. The recurrence that
`ops.ssd` computes for a whole sequence, for one token:

    S_t = exp(log_decay_t) S_{t-1} + k_t v_t^T       # [K, V] per head
    y_t = S_t^T q_t                                  # [V]

`ssd_reference` is this step in a `lax.scan`; the SSD cells decode with it.

Glossary of shapes: B batch, N heads, G query/key groups (N % G == 0),
K key size, V value size.
"""

import jax
import jax.numpy as jnp

from ops.ssd.groups import expand_groups

_F32 = jnp.float32


def ssd_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
             log_decay: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One token of `ops.ssd`, in float32.

  Args:
    state: [B, N, K, V] float32, the state before this token.
    q: [B, N, K] or [B, G, K] query (C in Mamba-2's notation).
    k: key, the shape of `q` (B in Mamba-2's notation).
    v: [B, N, V] value (dt * x in Mamba-2's notation).
    log_decay: [B, N] log of this token's decay (dt * A, <= 0).

  Returns:
    (y [B, N, V] float32, the state after this token [B, N, K, V] float32).
  """
  heads = v.shape[-2]
  q, k = expand_groups(q, heads), expand_groups(k, heads)
  decay = jnp.exp(log_decay.astype(_F32))[..., None, None]             # [B, N, 1, 1]
  state = decay * state + (k.astype(_F32)[..., :, None]
                           * v.astype(_F32)[..., None, :])             # [B, N, K, V]
  y = jnp.einsum("bnk,bnkv->bnv", q.astype(_F32), state)
  return y, state
