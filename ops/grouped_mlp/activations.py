"""The grouped MLP's activations: their names, `activate` on whole arrays, and
their values and derivatives on float32 tiles.

`activate` is the plain form the reference, the XLA path and the MoE dispatch
apply. The tile forms are shared by the Triton and Mosaic GPU kernels, which
differ only in how they compute `tanh` (an approximate instruction when the
result is 16-bit), so it is an argument. SwiGLU's gate and value are two tiles
of the same rows and hidden columns (`col_offsets`).
"""

import math
from typing import Callable, Literal, Sequence

import jax
import jax.numpy as jnp

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715  # jax.nn.gelu's tanh form

Activation = Literal["gelu", "swiglu"]
ACTIVATIONS = ("gelu", "swiglu")
Tanh = Callable[[jax.Array], jax.Array]


def activate(h: jax.Array, activation: Activation) -> jax.Array:
  """The hidden activation: [..., F] -> [..., F] ('gelu', tanh form as
  `jax.nn.gelu`), or [..., 2F] -> [..., F] ('swiglu': `silu(gate) * value`
  with the gate the first half of the columns)."""
  if activation == "swiglu":
    gate, value = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate) * value
  return jax.nn.gelu(h)


def gelu(h: jax.Array, tanh: Tanh) -> tuple[jax.Array, jax.Array]:
  """`jax.nn.gelu(h)` (tanh form) and its derivative."""
  inner = _SQRT_2_OVER_PI * (h + _GELU_CUBIC * h * h * h)
  t = tanh(inner)
  value = 0.5 * h * (1.0 + t)
  grad = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _SQRT_2_OVER_PI * (
      1.0 + 3.0 * _GELU_CUBIC * h * h)
  return value, grad


def sigmoid(g: jax.Array, tanh: Tanh) -> jax.Array:
  return 0.5 + 0.5 * tanh(0.5 * g)  # no exp, no division


def activation_value(pre: Sequence[jax.Array], activation: str, tanh: Tanh) -> jax.Array:
  """act of the pre-activation tile(s) ([gate, value] for SwiGLU)."""
  if activation == "swiglu":
    gate, value = pre
    return gate * sigmoid(gate, tanh) * value
  return gelu(pre[0], tanh)[0]


def activation_grads(da: jax.Array, pre: Sequence[jax.Array], activation: str,
                     tanh: Tanh) -> list[jax.Array]:
  """Gradients of the pre-activation tile(s) given d act."""
  if activation == "swiglu":
    gate, value = pre
    s = sigmoid(gate, tanh)
    return [da * value * s * (1.0 + gate * (1.0 - s)), da * gate * s]
  return [da * gelu(pre[0], tanh)[1]]


def approximate_tanh(dtype, interpret: bool) -> bool:
  """Whether a kernel may use the approximate tanh: compiled, 16-bit results.

  `tanh.approx.f32` is one instruction (relative error ~2^-11, below the
  rounding of a 16-bit result); the exact tanh is a long sequence, and the
  epilogue is not overlapped with any matmul. Interpret mode computes exactly.
  """
  return not interpret and jnp.dtype(dtype) != jnp.dtype(jnp.float32)


def halves(activation: str) -> int:
  """How many F-wide blocks of columns w_in has."""
  return 2 if activation == "swiglu" else 1


def col_offsets(activation: str, hidden: int) -> tuple[int, ...]:
  """First column of each F-wide block of w_in (padded F = `hidden`)."""
  return tuple(i * hidden for i in range(halves(activation)))
