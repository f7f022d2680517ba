"""SSMCell: a new cell is a subclass that writes `_sequence`, `_state_shapes`
and `step`; the base gives it `__call__` (and `reverse`), `initial_state` and
`prefill` (and ragged `lengths`), and SSMModel runs and decodes it.

The smallest cell here is the template of a new cell's test file."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import probjax_hk as pk
from probjax_hk.ssm import SSMCell
from probjax_hk.ssm.arguments import check_step
from probjax_hk.ssm.arguments import past_the_end

B, T, H = 2, 7, 4
_F32 = jnp.float32


class DecayCell(SSMCell):
  """`h_t = a * h_{t-1} + W x_t`, `y_t = h_t`, with a [H] in (0, 1): state [B, H]."""

  def __init__(self, *, model_dim: int | None = None, name: str | None = None):
    """Constructs the cell.

    Args:
      model_dim: H.
      name: module name.
    """
    super().__init__(model_dim=model_dim, name=name)

  @hk.transparent
  def _params(self, width):
    a = jax.nn.sigmoid(hk.get_parameter("a_logit", [width], _F32, init=jnp.ones))
    return a, pk.Linear(width, with_bias=False, name="in_proj")

  @hk.transparent
  def _sequence(self, x, state=None, valid=None):
    a, proj = self._params(x.shape[-1])
    b = proj(x).astype(_F32)                                          # [B, T, H]
    a = past_the_end(valid, jnp.broadcast_to(a, b.shape), 1)
    h, state = ops.linear_scan(a, past_the_end(valid, b, 0), initial_state=state)
    return h.astype(x.dtype), state

  def _state_shapes(self, batch_size, model_dim=None):
    return jax.ShapeDtypeStruct((batch_size, model_dim or self.model_dim), _F32)

  @hk.name_like("__call__")
  def step(self, x_t, state):
    check_step("x_t", x_t, state, self._state_shapes)
    a, proj = self._params(x_t.shape[-1])
    state = a * state + proj(x_t).astype(_F32)                        # [B, H]
    return state.astype(x_t.dtype), state


def _x(shape=(B, T, H), seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


def test_a_cell_without_step_cannot_be_built():
  class NoStep(SSMCell):  # the sequence path without the decode step
    def _sequence(self, x, state=None, valid=None):
      return x, state

    def _state_shapes(self, batch_size, model_dim=None):
      return jax.ShapeDtypeStruct((batch_size, H), _F32)

  with pytest.raises(TypeError, match="abstract.*step"):
    hk.transform(lambda: NoStep(model_dim=H)).init(None)


def test_the_base_gives_reverse_and_prefill_that_match_the_steps():
  lengths = jnp.array([T, 3])

  def paths(x):
    cell = DecayCell(model_dim=H)
    y, y_rev = cell(x), cell(x, reverse=True)
    state, steps = cell.initial_state(B), []
    for t in range(T):
      y_t, state = cell.step(x[:, t], state)
      steps.append(y_t)
    y_head, head = cell.prefill(x[:, :4])
    y_tail, tail = cell.prefill(x[:, 4:], head)
    _, ragged = cell.prefill(x, lengths=lengths)
    y_pieces = jnp.concatenate([y_head, y_tail], axis=1)
    return y, y_rev, jnp.stack(steps, axis=1), state, y_pieces, tail, ragged

  f = hk.without_apply_rng(hk.transform(paths))
  x = _x()
  params = jax.jit(f.init)(jax.random.key(0), x)
  apply = jax.jit(f.apply)
  y, y_rev, y_steps, state, y_pieces, tail, ragged = apply(params, x)
  np.testing.assert_allclose(y_steps, y, atol=1e-5)
  np.testing.assert_allclose(y_pieces, y, atol=1e-5)
  np.testing.assert_allclose(tail, state, atol=1e-5)
  # Reverse: the time-flipped input, flipped back; not the forward path.
  y_flipped = apply(params, x[:, ::-1])[0][:, ::-1]
  np.testing.assert_allclose(y_rev, y_flipped, atol=1e-5)
  assert np.abs(np.asarray(y_rev - y)).max() > 1e-2
  # Ragged: each sequence's state after its own length (y_t is h_t here).
  np.testing.assert_allclose(ragged, y_steps[np.arange(B), lengths - 1], atol=1e-5)


def test_ssm_model_runs_the_cell_and_generates_a_step():
  def forward_and_step(x):
    model = pk.SSMModel(3, H, 5, 1, cell=DecayCell)
    _, state = model.prefill(x[:, :-1])
    y_last, _ = model.step(x[:, -1], state)
    return model(x), y_last

  f = hk.without_apply_rng(hk.transform(forward_and_step))
  x = _x((B, T, 3), seed=1)
  y, y_last = jax.jit(f.apply)(jax.jit(f.init)(jax.random.key(0), x), x)
  assert y.shape == (B, T, 5)
  np.testing.assert_allclose(y_last, y[:, -1], atol=1e-5)
