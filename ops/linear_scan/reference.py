"""Step-by-step reference for the linear recurrence `h_t = a_t * h_{t-1} + b_t`.

The specification every faster tier is tested against, and the decode path's
semantics: one `lax.scan` step per time step, accumulated in float32
(complex64 for complex inputs).

Glossary of shapes: B batch, T time, D channels.
"""

import jax
import jax.numpy as jnp


def accumulation_dtype(dtype) -> jnp.dtype:
  """float32 for real inputs, complex64 for complex ones."""
  return jnp.complex64 if jnp.issubdtype(dtype, jnp.complexfloating) else jnp.float32


def linear_scan_reference(a: jax.Array, b: jax.Array, *,
                          initial_state: jax.Array | None = None,
                          reverse: bool = False) -> tuple[jax.Array, jax.Array]:
  """`h_t = a_t * h_{t-1} + b_t` over axis 1, one step at a time.

  Args:
    a: [B, T, D] decay (real or complex), or [D] for the same decay at every
      step.
    b: [B, T, D] input.
    initial_state: [B, D] `h_{-1}` (zeros when None); with `reverse` it is
      the state after the last step, `h_T`.
    reverse: run from t = T - 1 down to 0 (`h_t = a_t * h_{t+1} + b_t`).

  Returns:
    h: [B, T, D] in the result dtype of `a` and `b`.
    final_state: [B, D], the state after the last step processed.
  """
  out_dtype = jnp.result_type(a, b)
  acc = accumulation_dtype(out_dtype)
  a = jnp.broadcast_to(a, b.shape)
  batch, _, width = b.shape
  if initial_state is None:
    h0 = jnp.zeros((batch, width), acc)
  else:
    h0 = initial_state.astype(acc)

  def step(h, ab):
    a_t, b_t = ab  # [B, D]
    h = a_t * h + b_t
    return h, h

  xs = (jnp.swapaxes(a, 0, 1).astype(acc), jnp.swapaxes(b, 0, 1).astype(acc))
  final, hs = jax.lax.scan(step, h0, xs, reverse=reverse)
  return jnp.swapaxes(hs, 0, 1).astype(out_dtype), final.astype(out_dtype)
