"""Step-by-step reference for the selective scan (Mamba-1's S6 recurrence).

Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces", https://arxiv.org/abs/2312.00752:

    h_t = exp(delta_t A) * h_{t-1} + (delta_t u_t) B_t      # [D, S]
    y_t = h_t C_t + D u_t,   y_t *= silu(z_t) when z is given

The specification every faster tier is tested against: one `lax.scan` step
per time step, float32 throughout.

Glossary of shapes: B batch, T time, D channels, S state size.
"""

import jax
import jax.numpy as jnp


def prepare_delta(delta: jax.Array, delta_bias: jax.Array | None,
                  delta_softplus: bool) -> jax.Array:
  """float32 `softplus(delta + delta_bias)` (each part optional): [B, T, D]."""
  delta = delta.astype(jnp.float32)
  if delta_bias is not None:
    delta = delta + delta_bias.astype(jnp.float32)
  if delta_softplus:
    delta = jax.nn.softplus(delta)
  return delta


def finish_output(y: jax.Array, u: jax.Array, D: jax.Array | None,
                  z: jax.Array | None) -> jax.Array:
  """Adds the skip `D u`, gates by `silu(z)`, casts to `u`'s dtype: [B, T, D]."""
  y = y.astype(jnp.float32)
  if D is not None:
    y = y + u.astype(jnp.float32) * D.astype(jnp.float32)
  if z is not None:
    y = y * jax.nn.silu(z.astype(jnp.float32))
  return y.astype(u.dtype)


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

  def per_channel(x_t, x):  # this step's projection, broadcasting to [B, D, S]
    if x.ndim == 2:  # time-invariant [D, S]
      return x.astype(jnp.float32)
    if x_t.ndim == 3:  # per group [B, G, S]
      return jnp.repeat(x_t, width // x_t.shape[1], axis=1)
    return x_t[:, None, :]

  def step(h, xs):
    u_t, delta_t, b_t, c_t = xs  # [B, D], [B, D], [B, (G,) S] or None (x2)
    decay = jnp.exp(delta_t[:, :, None] * A)                     # [B, D, S]
    h = decay * h + (delta_t * u_t)[:, :, None] * per_channel(b_t, B)
    return h, jnp.sum(h * per_channel(c_t, C), axis=-1)

  # Time-invariant projections stay out of the scanned sequences.
  xs = tuple(None if x.ndim == 2 else jnp.swapaxes(x.astype(jnp.float32), 0, 1)
             for x in (u, delta, B, C))
  final, y = jax.lax.scan(step, h0, xs, reverse=reverse)
  return finish_output(jnp.swapaxes(y, 0, 1), u, D, z), (
      final if return_final_state else None)
