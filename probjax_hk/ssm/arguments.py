"""The argument checks the SSM cells and model share.

The constructor checks (`probjax_hk.arguments`, shared with the other models,
and the chunked cells' here) run at construction, before any parameter
exists; the step checks at the start of `step`, from static shapes only. Each
raises an error naming the argument and its value.
"""

import jax
import jax.numpy as jnp

from ops import registry
from probjax_hk import arguments
from probjax_hk import layers


def check_chunked_cell_args(name: str | None, *, model_dim: int | None,
                            chunk_size: int | None, implementation: registry.Choice,
                            implementations: registry.Registry,
                            num_heads: int | None = None, head_dim: int | None = None) -> None:
  """The constructor checks the cells on the chunked ops share (`num_heads`
  and `head_dim` for the multi-head cells, which split the model width);
  `implementations` is the op's registry, which knows its names."""
  arguments.check_name(name)
  arguments.check_positive_ints_or_none(model_dim=model_dim, chunk_size=chunk_size)
  implementations.check(implementation)
  if num_heads is None:
    return
  arguments.check_positive_ints(num_heads=num_heads)
  arguments.check_positive_ints_or_none(head_dim=head_dim)
  if head_dim is None and model_dim is not None and model_dim % num_heads:
    raise ValueError(f"`num_heads` must divide `model_dim` when `head_dim` is None, "
                     f"got {num_heads=} {model_dim=}")


def check_step(name: str, x_t: jax.Array, state, state_shapes) -> None:
  """A decoding step's input must be [B, H] and `state` must have the arrays
  and shapes of `state_shapes(B, H)` (the cell's `jax.ShapeDtypeStruct`s,
  which `initial_state(B)` also builds from)."""
  if x_t.ndim != 2:
    raise ValueError(f"`{name}` must be [B, H], got shape {x_t.shape}")
  check_state(x_t, state, state_shapes)


def check_prefill(name: str, x: jax.Array, state, state_shapes, lengths=None
                  ) -> tuple[jax.Array, jax.Array | None]:
  """A prefill's input must be [B, T, H] and `state` None or shaped like
  `state_shapes(B, H)` (as for `check_step`).

  Returns:
    (x, None) without `lengths`; with [B] `lengths` (checked by
    `layers.sequence_mask`), (x zeroed past each sequence's length, the
    [B, T] mask of its valid steps), so that padding, even NaN, never
    reaches a state.
  """
  if x.ndim != 3:
    raise ValueError(f"`{name}` must be [B, T, H], got shape {x.shape}")
  if state is not None:
    check_state(x, state, state_shapes)
  if lengths is None:
    return x, None
  _, valid = layers.sequence_mask(lengths, x)
  return jnp.where(valid[..., None], x, jnp.zeros((), x.dtype)), valid


def past_the_end(valid: jax.Array | None, x: jax.Array, value) -> jax.Array:
  """x [B, T, ...] with `value` at the steps past each sequence's end (where
  `valid` [B, T] is False): a decay of 1 or an input of 0 leaves a state as it
  was. x itself without a mask."""
  if valid is None:
    return x
  valid = valid.reshape(valid.shape + (1,) * (x.ndim - 2))
  return jnp.where(valid, x, jnp.asarray(value, x.dtype))


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
