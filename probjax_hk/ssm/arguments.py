"""The argument checks the SSM cells and model share.

Each raises a ValueError naming the argument and its value: the constructor
checks at construction, before any parameter exists, the step checks at the
start of `step`, from static shapes only.
"""

import jax
import jax.numpy as jnp


def check_positive_ints(**values) -> None:
  """Every value must be an int >= 1."""
  for arg, value in values.items():
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"`{arg}` must be a positive integer, got {arg}={value!r}")


def check_positive_or_none(**values) -> None:
  """Every value must be None (a default chosen later) or > 0."""
  for arg, value in values.items():
    if value is not None and value <= 0:
      raise ValueError(f"`{arg}` must be positive, got {arg}={value!r}")


def check_step_input(name: str, x_t: jax.Array) -> None:
  """A decoding step's input must be [B, H]."""
  if x_t.ndim != 2:
    raise ValueError(f"`{name}` must be [B, H], got shape {x_t.shape}")


def check_state(state, expected) -> None:
  """`state` must have the arrays and shapes of `expected` (the
  `jax.ShapeDtypeStruct`s of `initial_state(batch_size)`)."""
  want = [tuple(s.shape) for s in jax.tree.leaves(expected)]
  got = [tuple(jnp.shape(a)) for a in jax.tree.leaves(state)]
  if got != want:
    raise ValueError(f"`state` must have the shapes of `initial_state(batch_size)` "
                     f"{want}, got {got}")


def zeros(shapes):
  """Zeros for a pytree of `jax.ShapeDtypeStruct`s."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
