"""Step-by-step reference for the selective scan (Mamba-1's S6 recurrence).

Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces", https://arxiv.org/abs/2312.00752:

    h_t = exp(delta_t A) * h_{t-1} + (delta_t u_t) B_t      # [D, S]
    y_t = h_t C_t + D u_t,   y_t *= silu(z_t) when z is given

The specification every faster tier is tested against: one `lax.scan` step
per time step (`ops/selective_scan/step.py`'s `selective_scan_step`, the decode
step of MambaCell), float32 throughout.

Glossary of shapes: B batch, T time, D channels, S state size.
"""

import jax
import jax.numpy as jnp

from ops.selective_scan.step import finish_output
from ops.selective_scan.step import prepare_delta
from ops.selective_scan.step import selective_scan_step


def selective_scan_reference(u, delta, A, B, C, *, D=None, z=None,
                             delta_bias=None, delta_softplus=False,
                             initial_state=None, reverse=False,
                             return_final_state=True):
  """The selective scan, one step at a time.

  Args:
    u: [B, T, D] input.
    delta: [B, T, D] step sizes (before `delta_bias` and softplus).
    A: [D, S] state matrix (diagonal per channel; negative for decay).
    B: [B, T, S] input projection, per group [B, T, G, S] (D % G == 0;
      channel d uses group d // (D / G)), or time-invariant [D, S].
    C: [B, T, S] output projection, per group [B, T, G', S] (its own G'), or
      time-invariant [D, S].
    D: [D] skip, or None.
    z: [B, T, D] gate, or None.
    delta_bias: [D], or None.
    delta_softplus: apply softplus to `delta + delta_bias`.
    initial_state: [B, D, S] state before the first step processed, or None.
    reverse: scan from the last time step to the first.
    return_final_state: False returns None in place of the final state.

  Returns:
    y: [B, T, D] in `u`'s dtype.
    final_state: [B, D, S] float32, the state after the last step processed
      (None unless `return_final_state`).
  """
  batch, _, width = u.shape
  state = A.shape[-1]
  delta = prepare_delta(delta, delta_bias, delta_softplus)
  A = A.astype(jnp.float32)
  h0 = (jnp.zeros((batch, width, state), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))

  def step(h, xs):
    u_t, delta_t, b_t, c_t = xs  # [B, D], [B, D], [B, (G,) S] or None (x2)
    # A time-invariant [D, S] projection is one group per channel: [1, D, S].
    b_t = B[None] if b_t is None else b_t
    c_t = C[None] if c_t is None else c_t
    y, h = selective_scan_step(h, u_t, delta_t, A, b_t, c_t)
    return h, y

  # Time-invariant projections stay out of the scanned sequences.
  xs = tuple(None if x.ndim == 2 else jnp.swapaxes(x.astype(jnp.float32), 0, 1)
             for x in (u, delta, B, C))
  final, y = jax.lax.scan(step, h0, xs, reverse=reverse)
  return finish_output(jnp.swapaxes(y, 0, 1), u, D, z), (
      final if return_final_state else None)
