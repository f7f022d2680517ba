"""SSMModel checks `cell_kwargs` against the cell's constructor before building:
a missing required argument or an unknown one is a ValueError naming
`cell_kwargs`, not a TypeError from inside Haiku."""

import functools
import inspect

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

import probjax_hk as pk

_CELLS = [getattr(pk, n) for n in pk.__all__ if n.endswith("Cell")]


def _build(**kwargs):
  """Traces the init of a one-layer model on a [1, 4, 3] input: its params'
  shapes (the checks run at trace time)."""
  model = hk.transform(lambda x: pk.SSMModel(3, 8, 2, 1, **kwargs)(x))
  return jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 4, 3)))


def _required(cell):
  return [n for n, p in inspect.signature(cell).parameters.items()
          if p.default is p.empty and n not in ("model_dim", "name")]


def test_every_cell_is_checked():
  assert len(_CELLS) == 5
  assert {c.__name__: _required(c) for c in _CELLS if _required(c)} == {
      "SSDCell": ["num_heads"], "GatedDeltaNetCell": ["num_heads"]}


@pytest.mark.parametrize("cell", _CELLS, ids=lambda c: c.__name__)
def test_a_missing_required_argument_names_cell_kwargs(cell):
  if not _required(cell):  # nothing to give: the default cell_kwargs build
    assert _build(cell=cell, cell_kwargs={"state_dim": 4} if cell is not pk.Mamba2Cell
                  else {"head_dim": 4, "state_dim": 4})
    return
  with pytest.raises(ValueError, match=r"`cell_kwargs` must give " + cell.__name__
                     + r"'s required argument\(s\) `num_heads`: for example "
                     r"cell_kwargs=\{'num_heads': \.\.\.\}"):
    _build(cell=cell, cell_kwargs={"head_dim": 4})
  with pytest.raises(ValueError, match="`cell_kwargs` must give"):
    _build(cell=cell)  # no cell_kwargs at all
  assert _build(cell=cell, cell_kwargs={"num_heads": 2})


@pytest.mark.parametrize("cell", _CELLS, ids=lambda c: c.__name__)
def test_an_unknown_argument_names_cell_kwargs(cell):
  kwargs = {"num_heads": 2} if _required(cell) else {}
  with pytest.raises(ValueError, match=r"`cell_kwargs` holds \['num_head'\], which "
                     + cell.__name__ + " does not take; it takes"):
    _build(cell=cell, cell_kwargs={**kwargs, "num_head": 2})


@pytest.mark.parametrize("passed", ["model_dim", "name"])
def test_what_the_model_passes_is_refused(passed):
  with pytest.raises(ValueError, match=f"`cell_kwargs` must not set `{passed}`"):
    _build(cell=pk.LRUCell, cell_kwargs={passed: 8 if passed == "model_dim" else "c"})


def test_a_partial_and_a_cell_without_the_interface():
  assert _build(cell=functools.partial(pk.SSDCell, num_heads=2))

  class NoModelDim(hk.Module):
    def __init__(self, width, name=None):
      super().__init__(name=name)

  with pytest.raises(ValueError, match="`cell` must take `model_dim`"):
    _build(cell=NoModelDim, cell_kwargs={"width": 3})
