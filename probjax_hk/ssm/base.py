"""SSMCell: the base class of SSMModel's sequence-mixing cells.

Its docstring is the cell contract that SSMModel (and through it
`TokenModel` and `generate`) relies on.

Glossary of shapes: B batch, T time, H model width.
"""

import abc

import haiku as hk
import jax

from probjax_hk import arguments
from probjax_hk.layers import check_tokens
from probjax_hk.ssm.arguments import check_prefill
from probjax_hk.ssm.arguments import zeros


class SSMCell(hk.Module):
  """A sequence-mixing cell: `[B, T, H] -> [B, T, H]`, or one step at a time.

  The contract, kept by every cell of `probjax_hk.ssm`:

  * Construction: `cell(**cell_kwargs, model_dim=H, name=...)` (what
    SSMModel calls). Outside a model `model_dim` may be None: the sequence
    path reads H from its input, but `initial_state` needs it.
  * `cell(x, *, reverse=False) -> y`: the sequence path, x [B, T, H] -> y
    [B, T, H] in x's dtype. `reverse=True` runs it from the last step to the
    first (the second cell of a `bidirectional` block).
  * `initial_state(batch_size) -> state`: the state before the first step, a
    pytree of arrays whose size does not grow with T.
  * `step(x_t, state) -> (y_t, state)`: one step, x_t and y_t [B, H].
    Decoding a sequence step by step gives the sequence path's output.
  * `prefill(x, state=None, *, lengths=None) -> (y, state)`: the sequence
    path forward in time from `state` (None: x starts the sequences),
    returning the state after x's last step, so that `step` or another
    `prefill` continues where x ends. With `lengths` [B] ints in [0, T]
    (right-padded sequences), the state after each sequence's own
    `lengths[b]` steps; the outputs past them are unspecified.

  `initial_state`, `step` and `prefill` use the parameters of the sequence
  path: they are named like `__call__` (`hk.name_like`).

  Adding a cell is subclassing this class and writing one test file. The
  subclass writes four things and inherits `__call__`, `initial_state` and
  `prefill`:

  * `__init__(..., *, model_dim=None, name=None)`, its own arguments checked
    there, calling `super().__init__(model_dim=model_dim, name=name)`;
  * `_sequence(x, state=None, valid=None) -> (y, state)`, decorated with
    `hk.transparent`: the sequence path forward in time from `state` (None:
    zeros), returning the final state. `valid` [B, T] (None: all steps) is
    True before each sequence's length: past it the cell leaves the state as
    it was (decay 1 and input 0, `probjax_hk.ssm.arguments.past_the_end`)
    and a convolution's window ends at the last valid step
    (`probjax_hk.ssm.causal_conv.causal_conv`);
  * `_state_shapes(batch_size, model_dim=None)`: the state as a pytree of
    `jax.ShapeDtypeStruct`s (`model_dim` None: the constructor's), from which
    `initial_state` builds zeros and `prefill` and `step` check a given state;
  * `step(x_t, state)`, decorated with `hk.name_like("__call__")`, first
    checking its arguments with `probjax_hk.ssm.arguments.check_step`.

  `reverse` flips the time axis around `_sequence`, unless the subclass sets
  `_sequence_takes_reverse = True` and its `_sequence` takes `reverse=True`
  (an op that runs backwards itself, without the flipped copies).

  The test file checks that step-by-step decoding and a ragged `prefill`
  give the sequence path and that SSMModel takes the cell:
  `tests/models/test_ssm_base.py` does so for the smallest cell.
  """

  _sequence_takes_reverse = False  # `_sequence(x, reverse=True)` runs backwards

  def __init__(self, *, model_dim: int | None = None, name: str | None = None):
    """Constructs the cell's shared part (a subclass calls it first).

    Args:
      model_dim: H, or None (read from the input; `initial_state` needs it).
      name: module name.

    Raises:
      TypeError: a `model_dim` that is not an integer, or a `name` that is
        not a string.
      ValueError: a `model_dim` below 1.
    """
    arguments.check_name(name)
    super().__init__(name=name)
    arguments.check_positive_ints_or_none(model_dim=model_dim)
    self.model_dim = model_dim

  def __call__(self, x: jax.Array, *, reverse: bool = False) -> jax.Array:
    """Sequence path.

    Args:
      x: [B, T, H].
      reverse: run the cell from the last step to the first.

    Returns:
      [B, T, H] in `x`'s dtype.
    """
    check_tokens(x)
    if not reverse:
      return self._sequence(x)[0]
    if self._sequence_takes_reverse:
      return self._sequence(x, reverse=True)[0]
    return self._sequence(x[:, ::-1])[0][:, ::-1]

  @hk.name_like("__call__")
  def initial_state(self, batch_size: int):
    """The state before the first step: zeros in the shapes of `_state_shapes`.

    Args:
      batch_size: B.

    Returns:
      A pytree of arrays, each with a leading B axis.
    """
    return zeros(self._state_shapes(batch_size))

  @hk.name_like("__call__")
  def prefill(self, x: jax.Array, state=None, *, lengths: jax.Array | None = None):
    """The sequence path that also returns its final state.

    Args:
      x: [B, T, H].
      state: None (x starts the sequences) or the state to continue from
        (`initial_state`, `prefill` or `step`).
      lengths: None, or [B] ints in [0, T] for right-padded sequences: the
        steps past a sequence's length leave its state as it was; its outputs
        there are unspecified.

    Returns:
      (y [B, T, H] in x's dtype, the state after x's last step, or after
      each sequence's `lengths[b]` steps).
    """
    x, valid = check_prefill("x", x, state, self._state_shapes, lengths)
    return self._sequence(x, state, valid)

  @abc.abstractmethod
  def step(self, x_t: jax.Array, state):
    """One step.

    Args:
      x_t: [B, H], the input at this step.
      state: `initial_state(B)`, or the state of `prefill` or `step`.

    Returns:
      (y_t [B, H] in x_t's dtype, the next state).
    """

  @abc.abstractmethod
  def _sequence(self, x: jax.Array, state=None, valid: jax.Array | None = None):
    """Forward in time: x [B, T, H], state or None, valid [B, T] or None ->
    (y [B, T, H] in x's dtype, the final state)."""

  @abc.abstractmethod
  def _state_shapes(self, batch_size: int, model_dim: int | None = None):
    """The state's pytree of `jax.ShapeDtypeStruct`s for B = `batch_size`
    and H = `model_dim` (None: the constructor's)."""
