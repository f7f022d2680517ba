"""One time step of the selective scan (Mamba-1's S6 recurrence): the decode step.

Gu & Dao 2023, https://arxiv.org/abs/2312.00752. The recurrence that
`ops.selective_scan` computes for a whole sequence, for one step:

    h_t = exp(delta_t A) * h_{t-1} + (delta_t u_t) B_t      # [D, S]
    y_t = h_t C_t + D u_t,   y_t *= silu(z_t) when z is given

`selective_scan_reference` is this step in a `lax.scan`; MambaCell decodes
with it. The step sizes' bias and softplus (`prepare_delta`) and the skip and
gate (`finish_output`) are elementwise, shared by every tier.

Glossary of shapes: B batch, D channels, S state size, G groups of B or C.
"""

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def prepare_delta(delta: jax.Array, delta_bias: jax.Array | None,
                  delta_softplus: bool) -> jax.Array:
  """float32 `softplus(delta + delta_bias)` (each part optional): [B, (T,) D]."""
  delta = delta.astype(_F32)
  if delta_bias is not None:
    delta = delta + delta_bias.astype(_F32)
  if delta_softplus:
    delta = jax.nn.softplus(delta)
  return delta


def finish_output(y: jax.Array, u: jax.Array, D: jax.Array | None,
                  z: jax.Array | None) -> jax.Array:
  """Adds the skip `D u`, gates by `silu(z)`, casts to `u`'s dtype: [B, (T,) D]."""
  y = y.astype(_F32)
  if D is not None:
    y = y + u.astype(_F32) * D.astype(_F32)
  if z is not None:
    y = y * jax.nn.silu(z.astype(_F32))
  return y.astype(u.dtype)


def _per_channel(x: jax.Array, width: int) -> jax.Array:
  """This step's B or C, [B, S] or [B, G, S], broadcastable to [B, D, S]
  (channel d reads group d // (D / G))."""
  x = x.astype(_F32)
  if x.ndim == 3:
    return jnp.repeat(x, width // x.shape[1], axis=1)
  return x[:, None, :]


def selective_scan_step(state: jax.Array, u: jax.Array, delta: jax.Array, A: jax.Array,
                        B: jax.Array, C: jax.Array, *, D: jax.Array | None = None,
                        z: jax.Array | None = None, delta_bias: jax.Array | None = None,
                        delta_softplus: bool = False) -> tuple[jax.Array, jax.Array]:
  """One time step of `ops.selective_scan`, in float32.

  Args:
    state: [B, D, S] float32, the state before this step.
    u: [B, D] input.
    delta: [B, D] step sizes (before `delta_bias` and softplus).
    A: [D, S] state matrix (negative for decay).
    B: [B, S] input projection, or per group [B, G, S] (D % G == 0).
    C: [B, S] output projection, or per group [B, G', S] (its own G').
    D: [D] skip, or None.
    z: [B, D] gate, or None.
    delta_bias: [D], or None.
    delta_softplus: apply softplus to `delta + delta_bias`.

  Returns:
    (y [B, D] in `u`'s dtype, the state after this step [B, D, S] float32).
  """
  width = u.shape[-1]
  delta = prepare_delta(delta, delta_bias, delta_softplus)                # [B, D]
  decay = jnp.exp(delta[:, :, None] * A.astype(_F32))                    # [B, D, S]
  state = decay * state + (delta * u.astype(_F32))[:, :, None] * _per_channel(B, width)
  y = jnp.sum(state * _per_channel(C, width), axis=-1)                   # [B, D]
  return finish_output(y, u, D, z), state
