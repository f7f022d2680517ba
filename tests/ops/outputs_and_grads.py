"""A function's outputs and the gradients of a loss of them, in one program.

Jitting the forward and `jax.grad` of a loss apart compiles the forward
twice, and compiling is most of what the CPU tests spend (interpret-mode
kernels are large programs). `jax.vjp` with the loss's derivative by the
outputs as cotangents gives the same gradients from one forward pass.
"""

import jax
import jax.numpy as jnp


def outputs_and_grads(fn, cotangents, argnums=None):
  """`jax.jit` of `*args -> (fn(*args), grads)`.

  Args:
    fn: the function under test; its outputs a pytree of arrays.
    cotangents: outputs -> the derivative of the loss by each output, in the
      output's dtype (`sin_loss`, `fixed_weights_loss`).
    argnums: the positions of `args` differentiated (every one if None); the
      others pass through (None, integer offsets).

  Returns:
    The jitted function; its `grads` a tuple in `argnums` order.
  """
  def run(*args):
    nums = tuple(range(len(args))) if argnums is None else tuple(argnums)

    def of_differentiated(*diff):
      full = list(args)
      for i, x in zip(nums, diff):
        full[i] = x
      return fn(*full)
    outputs, pullback = jax.vjp(of_differentiated, *(args[i] for i in nums))
    return outputs, pullback(cotangents(outputs))
  return jax.jit(run)


def sin_loss(outputs):
  """The cotangents of `sum(sin(x.astype(float32)))` over every output x."""
  return jax.tree.map(lambda x: jnp.cos(x.astype(jnp.float32)).astype(x.dtype), outputs)


def fixed_weights_loss(outputs):
  """The cotangents of a loss linear in (y, final state) with fixed weights
  (`cos(i)` for y's i-th element, `sin(i)` for the state's): exact in every dtype."""
  y, final = outputs
  wy = jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
  wf = jnp.sin(jnp.arange(final.size, dtype=jnp.float32).reshape(final.shape))
  return wy.astype(y.dtype), wf.astype(final.dtype)
