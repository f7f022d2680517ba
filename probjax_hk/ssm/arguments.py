"""The argument checks the SSM cells and model share.

The constructor checks (`probjax_hk.arguments`, shared with the other models)
run at construction, before any parameter exists; the step checks here at the
start of `step`, from static shapes only. Each raises an error naming the
argument and its value.
"""

import jax
import jax.numpy as jnp

from probjax_hk.arguments import check_positive_ints  # pylint: disable=unused-import
from probjax_hk.arguments import check_positive_or_none  # pylint: disable=unused-import


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
