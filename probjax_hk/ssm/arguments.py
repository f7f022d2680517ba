"""The argument checks the SSM cells and model share.

The constructor checks (`probjax_hk.arguments`, shared with the other models)
run at construction, before any parameter exists; the step checks here at the
start of `step`, from static shapes only. Each raises an error naming the
argument and its value.
"""

import jax
import jax.numpy as jnp


def check_step(name: str, x_t: jax.Array, state, state_shapes) -> None:
  """A decoding step's input must be [B, H] and `state` must have the arrays
  and shapes of `state_shapes(B, H)` (the cell's `jax.ShapeDtypeStruct`s,
  which `initial_state(B)` also builds from)."""
  if x_t.ndim != 2:
    raise ValueError(f"`{name}` must be [B, H], got shape {x_t.shape}")
  check_state(x_t, state, state_shapes)


def check_prefill(name: str, x: jax.Array, state, state_shapes) -> None:
  """A prefill's input must be [B, T, H] and `state` None or shaped like
  `state_shapes(B, H)` (as for `check_step`)."""
  if x.ndim != 3:
    raise ValueError(f"`{name}` must be [B, T, H], got shape {x.shape}")
  if state is not None:
    check_state(x, state, state_shapes)


def check_state(x: jax.Array, state, state_shapes) -> None:
  """`state` must have the arrays and shapes of `state_shapes(B, H)` for x
  [B, ..., H]."""
  expected = state_shapes(x.shape[0], x.shape[-1])
  want = [tuple(s.shape) for s in jax.tree.leaves(expected)]
  got = [tuple(jnp.shape(a)) for a in jax.tree.leaves(state)]
  if got != want:
    raise ValueError(f"`state` must have the shapes of `initial_state(batch_size)` "
                     f"{want}, got {got}")


def zeros(shapes):
  """Zeros for a pytree of `jax.ShapeDtypeStruct`s."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
