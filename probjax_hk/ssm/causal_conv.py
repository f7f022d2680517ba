"""The short causal depthwise convolution of Mamba, Mamba-2 and Gated DeltaNet.

    y_t = b + sum_k w[k] x_{t - (W-1) + k}            # per channel, width W

Its decode state is the last W - 1 inputs, `[B, W - 1, C]` float32:
`causal_conv` returns it after a sequence (or after each sequence's own last
step) and `causal_conv_step` carries it one input at a time.

Glossary of shapes: B batch, T time, C channels, W width.
"""

import math

import haiku as hk
import jax
import jax.numpy as jnp

_F32 = jnp.float32


def conv_params(width: int, channels: int, name: str = "conv"):
  """Depthwise causal convolution weights [W, C] and bias [C], float32."""
  bound = 1 / math.sqrt(width)
  w = hk.get_parameter(f"{name}_w", [width, channels], _F32,
                       init=hk.initializers.RandomUniform(-bound, bound))
  b = hk.get_parameter(f"{name}_b", [channels], _F32, init=jnp.zeros)
  return w, b


def causal_conv(x: jax.Array, w: jax.Array, b: jax.Array,
                conv_state: jax.Array | None = None, valid: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """`y_t = b + sum_k w[k] x_{t - (W-1) + k}`, the inputs before x read from
  `conv_state` [B, W - 1, C] (zeros when None).

  Returns:
    (y [B, T, C] in x's dtype, the last W - 1 inputs [B, W - 1, C] float32:
    the conv_state that `causal_conv_step` continues from; with `valid`
    [B, T] (right-padded sequences), the last W - 1 before each sequence's
    end).
  """
  width, time = w.shape[0], x.shape[1]
  if conv_state is None:
    xp = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
  else:
    xp = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)   # [B, W - 1 + T, C]
  w = w.astype(x.dtype)
  y = b.astype(x.dtype) + sum(w[k] * xp[:, k:k + time] for k in range(width))
  if valid is None:
    return y, xp[:, time:].astype(_F32)
  # Sequence b's window ends at its length: xp[b, L_b : L_b + W - 1].
  rows = valid.sum(axis=1)[:, None] + jnp.arange(width - 1)           # [B, W - 1]
  return y, jnp.take_along_axis(xp, rows[..., None], axis=1).astype(_F32)


def causal_conv_step(x_t: jax.Array, conv_state: jax.Array, w: jax.Array,
                     b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One step: x_t [B, C], conv_state [B, W - 1, C] f32 (the last inputs)
  -> (y_t [B, C] in x_t's dtype, new conv_state)."""
  window = jnp.concatenate([conv_state.astype(x_t.dtype), x_t[:, None]], axis=1)
  y = b.astype(x_t.dtype) + jnp.sum(window * w.astype(x_t.dtype), axis=1)
  return y, window[:, 1:].astype(_F32)
