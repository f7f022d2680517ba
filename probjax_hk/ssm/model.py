"""SSMModel: a stack of residual blocks around a sequence-mixing SSM cell.

    x -> Linear(model_dim) -> num_layers x [x += cell(RMSNorm(x));
                                           x += MLP_swiglu(RMSNorm(x))]
      -> RMSNorm -> Linear(output_dim)

The cell is a `probjax_hk.ssm.SSMCell` (`probjax_hk/ssm/base.py`), whose
docstring is the contract the model relies on: how the model constructs it,
the sequence path `[B, T, H] -> [B, T, H]`, `initial_state`, `step` and
`prefill`.

The model decodes through the interface every sequence model of the library
shares (the Transformer's too): `initial_state(batch_size, max_length=None)`,
`prefill(x, state=None, *, max_length=None, lengths=None) -> (y, state)` and
`step(x_t, state) -> (y_t, state)`.

Glossary of shapes: B batch, T time, I input width, H model width, O output width.
"""

import functools
import inspect
from typing import Any, Callable, Mapping

import haiku as hk
import jax
import jax.numpy as jnp

from probjax_hk import stacking
from probjax_hk.arguments import check_bools
from probjax_hk.arguments import check_callables
from probjax_hk.arguments import check_name
from probjax_hk.arguments import check_positive_ints
from probjax_hk.arguments import check_rates
from probjax_hk.layers import Linear
from probjax_hk.layers import check_tokens
from probjax_hk.layers import MLP
from probjax_hk.layers import RMSNorm
from probjax_hk.layers import sequence_mask
from probjax_hk.ssm.lru import LRUCell

_MLP_RATIO = 2  # swiglu hidden width / model width
_PASSED_BY_MODEL = ("model_dim", "name")


def _check_max_length(max_length: int | None, time: int) -> None:
  """`max_length`, when given, must be an int that holds `time` tokens (the
  Transformer's contract, so that either body takes the same calls)."""
  if max_length is not None:
    check_positive_ints(max_length=max_length)
    if max_length < time:
      raise ValueError(f"`max_length` must be >= the prompt's T={time}, got {max_length=}")


def _check_cell_kwargs(cell: Callable[..., hk.Module], cell_kwargs: dict[str, Any]) -> None:
  """ValueError naming `cell_kwargs` for an argument that the cell's
  constructor requires and `cell_kwargs` lacks, or one it does not take."""
  try:
    params = inspect.signature(cell).parameters
  except (TypeError, ValueError):  # no readable signature: the cell's own errors stand
    return
  cell_name = getattr(cell, "__name__", repr(cell))
  if any(p.kind == p.VAR_KEYWORD for p in params.values()):
    named = None  # takes any keyword
  else:
    named = [n for n, p in params.items() if p.kind != p.POSITIONAL_ONLY]
    for needed in _PASSED_BY_MODEL:
      if needed not in named:
        raise ValueError(f"`cell` must take `{needed}` (the cell contract of "
                         f"probjax_hk.ssm.SSMCell); {cell_name} does not")
  missing = [n for n, p in params.items()
             if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
             and n not in cell_kwargs and n not in _PASSED_BY_MODEL]
  if missing:
    example = ", ".join(f"{n!r}: ..." for n in missing)
    raise ValueError(f"`cell_kwargs` must give {cell_name}'s required argument(s) "
                     f"{', '.join(f'`{n}`' for n in missing)}: for example "
                     f"cell_kwargs={{{example}}}; got cell_kwargs={cell_kwargs}")
  unknown = [] if named is None else [n for n in cell_kwargs if n not in named]
  if unknown:
    raise ValueError(f"`cell_kwargs` holds {unknown}, which {cell_name} does not take; "
                     f"it takes {[n for n in named if n not in _PASSED_BY_MODEL]}")


class SSMBlock(hk.Module):
  """Pre-norm residual block: the cell (both directions when bidirectional),
  then a SwiGLU MLP."""

  def __init__(self, model_dim: int, cell: Callable[..., hk.Module],
               cell_kwargs: dict[str, Any], *, bidirectional: bool = False,
               dropout_rate: float = 0.0, name: str | None = None):
    super().__init__(name=name)
    self.model_dim = model_dim
    self.cell = cell
    self.cell_kwargs = cell_kwargs
    self.bidirectional = bidirectional
    self.dropout_rate = dropout_rate

  @hk.transparent
  def _cells(self):
    make = lambda name: self.cell(**self.cell_kwargs, model_dim=self.model_dim, name=name)
    return make("cell"), (make("cell_reverse") if self.bidirectional else None)

  @hk.transparent
  def _dropout(self, x, is_training):
    if is_training and self.dropout_rate > 0:
      return hk.dropout(hk.next_rng_key(), self.dropout_rate, x)
    return x

  @hk.transparent
  def _mlp(self, x, is_training):
    y = MLP(_MLP_RATIO * self.model_dim, activation="swiglu", name="mlp")(
        RMSNorm(name="mlp_norm")(x))
    return x + self._dropout(y, is_training)

  def __call__(self, x: jax.Array, *, is_training: bool = False) -> jax.Array:
    """[B, T, H] -> [B, T, H]."""
    forward, backward = self._cells()
    h = RMSNorm(name="cell_norm")(x)
    y = forward(h)
    if backward is not None:
      y = y + backward(h, reverse=True)
    return self._mlp(x + self._dropout(y, is_training), is_training)

  @hk.name_like("__call__")
  def initial_state(self, batch_size: int):
    forward, _ = self._cells()
    return forward.initial_state(batch_size)

  @hk.name_like("__call__")
  def step(self, x_t: jax.Array, state):
    """[B, H], state -> ([B, H], state)."""
    forward, _ = self._cells()
    y, state = forward.step(RMSNorm(name="cell_norm")(x_t), state)
    return self._mlp(x_t + y, False), state

  @hk.name_like("__call__")
  def prefill(self, x: jax.Array, state=None, lengths=None):
    """[B, T, H], state or None, lengths [B] or None -> ([B, T, H], the state
    after x, or after each sequence's `lengths[b]` steps)."""
    forward, _ = self._cells()
    # Only given when set: a cell of the interface without ragged prefill still decodes.
    ragged = {} if lengths is None else {"lengths": lengths}
    y, state = forward.prefill(RMSNorm(name="cell_norm")(x), state, **ragged)
    return self._mlp(x + y, False), state


class SSMModel(hk.Module):
  """Input projection, `num_layers` SSM blocks, output projection."""

  def __init__(self, input_dim: int, model_dim: int, output_dim: int, num_layers: int,
               *, cell: Callable[..., hk.Module] = LRUCell,
               cell_kwargs: dict[str, Any] | None = None, bidirectional: bool = False,
               dropout_rate: float = 0.0, remat_policy: stacking.RematPolicy = None,
               scan_layers: bool = False, name: str | None = None):
    """Constructs the model.

    Args:
      input_dim: I, the input feature width.
      model_dim: H, the residual width.
      output_dim: O, the output width.
      num_layers: number of blocks.
      cell: the cell class: `LRUCell`, `MambaCell`, `SSDCell`, `Mamba2Cell`,
        `GatedDeltaNetCell`, or one of your own, a subclass of
        `probjax_hk.ssm.SSMCell` (:ref:`ssm-writing-a-cell`).
      cell_kwargs: keyword arguments of the cell (e.g. `state_dim`,
        `implementation`); `model_dim` and `name` are passed by the model.
        They must include the cell's required arguments: `num_heads` for
        SSDCell and GatedDeltaNetCell.
      bidirectional: each block adds a second cell run in reverse (no decoding).
      dropout_rate: dropout on each residual branch when `is_training`.
      remat_policy: None | 'full' | a `jax.checkpoint_policies` name |
        callable, as for the Transformer (:ref:`remat-policy`).
      scan_layers: build the blocks with `hk.layer_stack`.
      name: module name.

    Raises:
      TypeError: a width or depth that is not an integer, a flag that is not
        a bool, a `cell` that is not callable or `cell_kwargs` that is not a
        dict.
      ValueError: for a width, depth or dropout rate out of range, and for
        `cell_kwargs` that lack an argument the cell requires, name one it
        does not take, or that the cell itself refuses.
    """
    check_name(name)
    super().__init__(name=name)
    check_positive_ints(input_dim=input_dim, model_dim=model_dim,
                        output_dim=output_dim, num_layers=num_layers)
    check_rates(dropout_rate=dropout_rate)
    check_bools(bidirectional=bidirectional, scan_layers=scan_layers)
    check_callables(cell=cell)
    if cell_kwargs is not None and not isinstance(cell_kwargs, Mapping):
      raise TypeError(f"`cell_kwargs` must be a dict of the cell's keyword arguments or "
                      f"None, got {cell_kwargs=}")
    cell_kwargs = dict(cell_kwargs or {})
    for passed in _PASSED_BY_MODEL:
      if passed in cell_kwargs:
        raise ValueError(f"`cell_kwargs` must not set `{passed}`; the model passes it")
    _check_cell_kwargs(cell, cell_kwargs)
    stacking.validate_remat_policy(remat_policy)
    self.input_dim, self.model_dim, self.output_dim = input_dim, model_dim, output_dim
    self.num_layers = num_layers
    self.cell = cell
    self.cell_kwargs = cell_kwargs
    self.bidirectional = bidirectional
    self.dropout_rate = dropout_rate
    self.remat_policy = remat_policy
    self.scan_layers = scan_layers
    # Construct one cell now so that bad cell arguments raise here.
    cell(**cell_kwargs, model_dim=model_dim, name="_validate")

  @hk.transparent
  def _block(self, name):
    return SSMBlock(self.model_dim, self.cell, self.cell_kwargs,
                    bidirectional=self.bidirectional, dropout_rate=self.dropout_rate,
                    name=name)

  def __call__(self, x: jax.Array, *, is_training: bool = False) -> jax.Array:
    """Sequence path.

    Args:
      x: [B, T, input_dim].
      is_training: apply dropout.

    Returns:
      [B, T, output_dim] in `x`'s dtype.
    """
    check_tokens(x)
    if x.shape[-1] != self.input_dim:
      raise ValueError(f"`x` must be [B, T, input_dim={self.input_dim}], got {x.shape}")
    h = Linear(self.model_dim, name="input_proj")(x)          # [B, T, H]

    def make_block(name):
      block = self._block(name)
      return lambda h: (block(h, is_training=is_training),)

    (h,) = stacking.apply_stack(make_block, self.num_layers, (h,),
                                scan_layers=self.scan_layers,
                                remat_policy=self.remat_policy)
    return Linear(self.output_dim, name="output_proj")(RMSNorm(name="final_norm")(h))

  @hk.name_like("__call__")
  def initial_state(self, batch_size: int, max_length: int | None = None, *,
                    dtype=None):
    """The decoding state before the first step.

    Args:
      batch_size: B, the number of sequences.
      max_length: None or a positive int, otherwise unused (the state's size
        does not grow with the sequence); taken so that every sequence model
        decodes through one interface.
      dtype: unused, taken for the same reason (the Transformer's cache
        dtype): the states are float32 (the LRU's complex64) whatever dtype
        the model computes in.

    Returns:
      Per-layer cell states, a list of num_layers or one pytree stacked on a
      leading num_layers axis when `scan_layers`.
    """
    del dtype
    _check_max_length(max_length, 1)
    self._check_decodable()
    if self.scan_layers:
      state = self._block(stacking.SCANNED_BLOCK_NAME).initial_state(batch_size)
      return jax.tree.map(lambda s: jnp.stack([s] * self.num_layers), state)
    return [self._block(stacking.UNROLLED_BLOCK_NAME.format(i)).initial_state(batch_size)
            for i in range(self.num_layers)]

  @hk.name_like("__call__")
  def prefill(self, x: jax.Array, state=None, *, max_length: int | None = None,
              lengths: jax.Array | None = None):
    """Runs a prompt (or the next chunk of one) in one parallel call.

    The output is the sequence path's (`__call__(x)` without `state`; with
    it, what T calls of `step` would give), and the state is the one `step`
    continues from.

    With `lengths`, x holds right-padded sequences of different lengths:
    every cell leaves sequence b's state as it was after its `lengths[b]`
    steps (decay 1 and input 0 past them, the convolutions' windows ending
    there), so `step` continues each from its own end; the outputs past a
    sequence's length are unspecified.

    Args:
      x: [B, T, input_dim], the next T inputs of each sequence.
      state: None (x starts the sequences) or the state of `initial_state`,
        `prefill` or `step`.
      max_length: None, or at least T and otherwise unused, as for
        `initial_state`.
      lengths: None (all T steps of every sequence) or [B] ints in [0, T],
        the valid steps of each (checked when concrete, clipped when traced).

    Returns:
      (y [B, T, output_dim] in x's dtype, the state after x's last step (or
      each sequence's `lengths[b]`), in the layout of `initial_state`).

    Raises:
      ValueError: for a bidirectional model, x that is not [B, T, input_dim],
        a `max_length` below T, `lengths` that is not [B] integers in
        [0, T], or a state that does not fit.
    """
    self._check_decodable()
    if x.ndim != 3 or x.shape[-1] != self.input_dim:
      raise ValueError(f"`x` must be [B, T, input_dim={self.input_dim}], got {x.shape}")
    _check_max_length(max_length, x.shape[1])
    if state is not None:
      self._check_layer_states(state)
    if lengths is not None:
      lengths, _ = sequence_mask(lengths, x)
    h = Linear(self.model_dim, name="input_proj")(x)                  # [B, T, H]
    h, state = stacking.apply_stack_with_states(
        lambda name: functools.partial(self._block(name).prefill, lengths=lengths),
        self.num_layers, h, state, scan_layers=self.scan_layers)
    return Linear(self.output_dim, name="output_proj")(RMSNorm(name="final_norm")(h)), state

  @hk.name_like("__call__")
  def step(self, x_t: jax.Array, state):
    """One decoding step.

    Args:
      x_t: [B, input_dim], the input at this step.
      state: `initial_state(B)`, or the state the previous step returned.

    Returns:
      (y_t [B, output_dim], the next state).
    """
    self._check_decodable()
    if x_t.ndim != 2 or x_t.shape[-1] != self.input_dim:
      raise ValueError(f"`x_t` must be [B, input_dim={self.input_dim}], got {x_t.shape}")
    self._check_layer_states(state)
    h = Linear(self.model_dim, name="input_proj")(x_t)
    h, state = stacking.apply_stack_with_states(
        lambda name: self._block(name).step, self.num_layers, h, state,
        scan_layers=self.scan_layers)
    return Linear(self.output_dim, name="output_proj")(RMSNorm(name="final_norm")(h)), state

  def _check_layer_states(self, state):
    """`state` must hold num_layers per-layer states, as `initial_state` makes
    them (each cell's `step` checks its own shapes)."""
    if self.scan_layers:
      leaves = jax.tree.leaves(state)
      if not leaves or any(jnp.ndim(a) < 1 or jnp.shape(a)[0] != self.num_layers
                           for a in leaves):
        raise ValueError(f"`state` must be `initial_state(batch_size)`: per-layer states "
                         f"stacked on a leading axis of num_layers={self.num_layers}, got "
                         f"shapes {[jnp.shape(a) for a in leaves]}")
    elif not isinstance(state, (list, tuple)) or len(state) != self.num_layers:
      got = len(state) if isinstance(state, (list, tuple)) else type(state).__name__
      raise ValueError(f"`state` must be `initial_state(batch_size)`: a list of "
                       f"num_layers={self.num_layers} per-layer states, got {got}")

  def _check_decodable(self):
    if self.bidirectional:
      raise ValueError("`bidirectional=True` models cannot decode step by step "
                       "(the reverse cell needs the future)")
