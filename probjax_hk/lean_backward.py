"""Norms and the GELU with backward passes that keep only their inputs.

Autodiff of a norm computed in float32 keeps its float32 intermediates for
the backward: for a layer norm `x - mean`, its square and the normalized
value, three [..., D] float32 arrays per norm, and for the tanh GELU its
[..., F] intermediates. Inside one program XLA can recompute such cheap
values instead of keeping them; across `hk.layer_stack`'s scan it cannot,
because the scan saves every layer's residuals as stacked buffers. Measured
with `jax.ad_checkpoint`'s `saved_residuals` (BUILD_NOTES.md, "scan_layers x
remat_policy"): a width-512 Transformer layer at B 2, T 4096 kept 334 MB, of
which 101 MB were the two layer norms' intermediates and 67 MB the GELU's;
with these it keeps 149 MB. On XLA:CPU the unrolled 24-layer stack's step
went from 15.9 to 3.3 s (not measured on a GPU).

These custom VJPs keep the input (in its own dtype) and, for the norms, the
per-row statistics ([..., 1] float32), and recompute the rest in the backward.
The forward values are those of the plain formulas.
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp

_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715


def _sum_to_last_axis(x):
  return jnp.sum(x.reshape(-1, x.shape[-1]), axis=0)


def _layer_norm_stats(xf, eps):
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
  return mean, lax.rsqrt(var + eps)


def _scale_and_shift(y, scale, offset):
  if scale is not None:
    y = y * scale
  if offset is not None:
    y = y + offset
  return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x: jax.Array, scale: jax.Array | None, offset: jax.Array | None,
               eps: float) -> jax.Array:
  """Layer norm over the last axis in float32: [..., D] -> [..., D] in x's dtype.

  scale, offset: [D] float32, or None.
  """
  return _layer_norm_fwd(x, scale, offset, eps)[0]


def _layer_norm_fwd(x, scale, offset, eps):
  xf = x.astype(jnp.float32)
  mean, rstd = _layer_norm_stats(xf, eps)
  y = _scale_and_shift((xf - mean) * rstd, scale, offset).astype(x.dtype)
  return y, (x, mean, rstd, scale, offset)


def _layer_norm_bwd(eps, residuals, g):
  del eps
  x, mean, rstd, scale, offset = residuals
  gf = g.astype(jnp.float32)
  x_hat = (x.astype(jnp.float32) - mean) * rstd
  g_hat = gf if scale is None else gf * scale
  dx = rstd * (g_hat - jnp.mean(g_hat, axis=-1, keepdims=True)
               - x_hat * jnp.mean(g_hat * x_hat, axis=-1, keepdims=True))
  dscale = None if scale is None else _sum_to_last_axis(gf * x_hat)
  doffset = None if offset is None else _sum_to_last_axis(gf)
  return dx.astype(x.dtype), dscale, doffset


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float) -> jax.Array:
  """Root-mean-square norm over the last axis in float32: [..., D] -> [..., D]
  in x's dtype; scale: [D] float32 or None."""
  return _rms_norm_fwd(x, scale, eps)[0]


def _rms_norm_fwd(x, scale, eps):
  xf = x.astype(jnp.float32)
  rstd = lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
  y = _scale_and_shift(xf * rstd, scale, None).astype(x.dtype)
  return y, (x, rstd, scale)


def _rms_norm_bwd(eps, residuals, g):
  del eps
  x, rstd, scale = residuals
  gf = g.astype(jnp.float32)
  x_hat = x.astype(jnp.float32) * rstd
  g_hat = gf if scale is None else gf * scale
  dx = rstd * (g_hat - x_hat * jnp.mean(g_hat * x_hat, axis=-1, keepdims=True))
  dscale = None if scale is None else _sum_to_last_axis(gf * x_hat)
  return dx.astype(x.dtype), dscale


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
  """`jax.nn.gelu(x)` (the tanh form), any shape; the backward recomputes
  its derivative from x in float32."""
  return jax.nn.gelu(x, approximate=True)


def _gelu_fwd(x):
  return jax.nn.gelu(x, approximate=True), x


def _gelu_bwd(x, g):
  xf = x.astype(jnp.float32)
  t = jnp.tanh(_SQRT_2_OVER_PI * (xf + _GELU_CUBIC * xf * xf * xf))
  slope = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * _SQRT_2_OVER_PI * (
      1.0 + 3.0 * _GELU_CUBIC * xf * xf)
  return ((g.astype(jnp.float32) * slope).astype(x.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)
