"""Norms and the GELU whose backward keeps only their inputs.

Autodiff of a norm computed in float32 keeps its float32 intermediates for
the backward: for a layer norm `x - mean`, its square and the normalized
value, three [..., D] float32 arrays per norm, and for the tanh GELU its
[..., F] intermediates. Inside one program XLA can recompute such cheap
values instead of keeping them; across `hk.layer_stack`'s scan it cannot,
because the scan saves every layer's residuals as stacked buffers. The two
layer norms' and the GELU's intermediates are about half of what a Transformer
layer keeps (`jax.ad_checkpoint`'s `saved_residuals`); with these functions
the backward keeps only their inputs (sizes: BUILD_NOTES.md, "Transformer and
DiffusionTransformer").

Each function is rematerialized on its own (`jax.checkpoint` saving nothing
inside it): the backward keeps its inputs and recomputes the rest. Unlike a
custom VJP this keeps forward-mode differentiation (`jax.jvp`, `jax.jacfwd`)
working through the models. The values are those of the plain formulas.
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp

# Save nothing inside: the residuals are the function's inputs.
_inputs_only = functools.partial(
    jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)


def _scale_and_shift(y, scale, offset):
  if scale is not None:
    y = y * scale
  if offset is not None:
    y = y + offset
  return y


@functools.partial(_inputs_only, static_argnums=(3,))
def layer_norm(x: jax.Array, scale: jax.Array | None, offset: jax.Array | None,
               eps: float) -> jax.Array:
  """Layer norm over the last axis in float32: [..., D] -> [..., D] in x's dtype.

  scale, offset: [D] float32, or None.
  """
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  centered = xf - mean
  var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
  return _scale_and_shift(centered * lax.rsqrt(var + eps), scale, offset).astype(x.dtype)


@functools.partial(_inputs_only, static_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float) -> jax.Array:
  """Root-mean-square norm over the last axis in float32: [..., D] -> [..., D]
  in x's dtype; scale: [D] float32 or None."""
  xf = x.astype(jnp.float32)
  y = xf * lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
  return _scale_and_shift(y, scale, None).astype(x.dtype)


@_inputs_only
def gelu(x: jax.Array) -> jax.Array:
  """`jax.nn.gelu(x)` (the tanh form), any shape."""
  return jax.nn.gelu(x, approximate=True)
