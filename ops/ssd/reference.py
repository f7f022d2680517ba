"""Step-by-step reference for SSD, the state-space dual of Mamba-2.

Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient
Algorithms Through Structured State Space Duality",
https://arxiv.org/abs/2405.21060. With `G_t = sum_{s<=t} log_decay_s`:

    y_t = sum_{s<=t} exp(G_t - G_s) (q_t . k_s) v_s

which is the recurrence, one step per token,

    S_t = exp(log_decay_t) S_{t-1} + k_t v_t^T       # [K, V] per head
    y_t = S_t^T q_t                                  # [V]

The specification every faster tier is tested against: one `lax.scan` step per
token (`ops/ssd/step.py`'s `ssd_step`, the cells' decode step), float32
throughout.

Glossary of shapes: B batch, T time, N heads, G query/key groups (N % G == 0),
K key size, V value size.
"""

import jax
import jax.numpy as jnp

from ops.ssd import varlen
from ops.ssd.groups import expand_groups
from ops.ssd.step import ssd_step

_F32 = jnp.float32


def ssd_reference(q, k, v, log_decay, *, initial_state=None, chunk_size=None,
                  cu_seqlens=None):
  """SSD, one token at a time.

  Args:
    q: [B, T, N, K] or [B, T, G, K] queries (C in Mamba-2's notation).
    k: keys, the shape of `q` (B in Mamba-2's notation).
    v: [B, T, N, V] values (dt * x in Mamba-2's notation).
    log_decay: [B, T, N] log of the per-step decay (dt * A, <= 0).
    initial_state: [B, N, K, V] state before the first token ([S, N, K, V]
      with `cu_seqlens`), or None (zeros).
    chunk_size: ignored (the reference has no chunks); accepted so every tier
      shares one signature.
    cu_seqlens: None, or int [S + 1]: B = 1 and the time axis packs S
      sequences, each from its own initial state (`ops/ssd/varlen.py`).

  Returns:
    y: [B, T, N, V] in `v`'s dtype.
    final_state: [B, N, K, V] float32 ([S, N, K, V] with `cu_seqlens`).
  """
  del chunk_size
  q, k = expand_groups(q, v.shape[2]), expand_groups(k, v.shape[2])

  def step(state, xs):
    y, state = ssd_step(state, *xs)
    return state, y

  return scan_tokens(step, (q, k, v, log_decay), v, q.shape[-1], initial_state, cu_seqlens)


def scan_tokens(step, inputs, v, key, initial_state, cu_seqlens):
  """The references' loop: `step(state, token's inputs) -> (state, y)` over
  the time axis of `inputs` ([B, T, ...] each), from `initial_state` (None:
  zeros), restarting per sequence with `cu_seqlens`. Returns (y in `v`'s
  dtype [B, T, N, V], final state(s) float32)."""
  batch, time, heads, value = v.shape
  h0 = (jnp.zeros((varlen.num_states(batch, cu_seqlens), heads, key, value), _F32)
        if initial_state is None
        else initial_state.astype(_F32))
  xs = tuple(jnp.swapaxes(x, 0, 1) for x in inputs)
  if cu_seqlens is None:
    final, y = jax.lax.scan(step, h0, xs)
  else:
    y, final = varlen.scan_with_resets(step, xs, *varlen.token_layout(cu_seqlens, time), h0)
  return jnp.swapaxes(y, 0, 1).astype(v.dtype), final
