"""SSDCell, Mamba2Cell and GatedDeltaNetCell: the sequence path agrees with
step-by-step decoding, on their own and inside SSMModel (scanned == unrolled)."""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk
from probjax_hk.ssm import GatedDeltaNetCell
from probjax_hk.ssm import Mamba2Cell
from probjax_hk.ssm import SSDCell
from probjax_hk.ssm import SSMModel

_WIDTH = 16
_CELLS = {
    "ssd": (SSDCell, dict(num_heads=2, state_dim=16, chunk_size=8)),
    "mamba2": (Mamba2Cell, dict(head_dim=8, state_dim=16, ngroups=2, chunk_size=8)),
    "gdn": (GatedDeltaNetCell, dict(num_heads=2, chunk_size=8)),
}


def _decode(cell, x):
  """Runs `cell.step` over the time axis of x [B, T, H]."""
  state = cell.initial_state(x.shape[0])
  def body(state, x_t):
    y, state = cell.step(x_t, state)
    return state, y
  _, ys = hk.scan(body, state, jnp.swapaxes(x, 0, 1))
  return jnp.swapaxes(ys, 0, 1)


@functools.lru_cache(maxsize=None)
def _cell_fns(name):
  cls, kwargs = _CELLS[name]
  make = lambda: cls(**kwargs, model_dim=_WIDTH, name="cell")
  seq = hk.transform(lambda x: make()(x))
  rev = hk.transform(lambda x: make()(x, reverse=True))
  dec = hk.transform(lambda x: _decode(make(), x))
  return seq, rev, dec


def _apply(fn):
  return jax.jit(functools.partial(fn.apply, rng=None))


@pytest.mark.parametrize("name", sorted(_CELLS))
def test_sequence_equals_decoding_and_reverse(name):
  seq, rev, dec = _cell_fns(name)
  x = jax.random.normal(jax.random.key(1), (2, 21, _WIDTH))
  params = jax.jit(seq.init)(jax.random.key(0), x)
  assert jax.tree.structure(params) == jax.tree.structure(
      jax.eval_shape(dec.init, jax.random.key(0), x))
  seq_apply = _apply(seq)
  y = seq_apply(params, x=x)
  y_dec = _apply(dec)(params, x=x)
  assert y.shape == x.shape
  np.testing.assert_allclose(y, y_dec, atol=1e-4, rtol=1e-4)
  # Reverse == the forward path on the time-flipped input, flipped back.
  np.testing.assert_allclose(_apply(rev)(params, x=x),
                             seq_apply(params, x=x[:, ::-1])[:, ::-1], atol=1e-5)
  # Causality: changing a later input leaves earlier outputs unchanged.
  y2 = seq_apply(params, x=x.at[:, 15:].set(0.0))
  np.testing.assert_allclose(y2[:, :15], y[:, :15], atol=1e-5)
  assert np.abs(np.asarray(y2[:, 15:] - y[:, 15:])).max() > 1e-3
  # bf16 in -> bf16 out, close to float32.
  y_bf16 = seq_apply(params, x=x.astype(jnp.bfloat16))
  assert y_bf16.dtype == jnp.bfloat16
  assert np.abs(np.asarray(y_bf16, np.float32) - np.asarray(y)).max() < 0.1 * max(
      1.0, float(jnp.abs(y).max()))


@pytest.mark.parametrize("name", ["mamba2", "gdn"])
def test_model_scanned_equals_unrolled_and_decodes(name):
  cls, kwargs = _CELLS[name]
  def model(scan):
    return SSMModel(3, _WIDTH, 5, 2, cell=cls, cell_kwargs=kwargs, scan_layers=scan)
  x = jax.random.normal(jax.random.key(2), (2, 12, 3))
  unrolled = hk.transform(lambda x: model(False)(x))
  scanned = hk.transform(lambda x: model(True)(x))
  params = jax.jit(unrolled.init)(jax.random.key(0), x)
  y = _apply(unrolled)(params, x=x)
  stacked = probjax_hk.stack_layer_params(params)
  np.testing.assert_allclose(_apply(scanned)(stacked, x=x), y, atol=1e-5, rtol=1e-5)

  def decode(x):
    m = model(False)
    state = m.initial_state(x.shape[0])
    ys = []
    for t in range(x.shape[1]):
      y_t, state = m.step(x[:, t], state)
      ys.append(y_t)
    return jnp.stack(ys, axis=1)
  y_dec = _apply(hk.transform(decode))(params, x=x)
  np.testing.assert_allclose(y_dec, y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("make, match", [
    (lambda: Mamba2Cell(head_dim=7, model_dim=16), "`head_dim` must divide"),
    (lambda: Mamba2Cell(ngroups=3, head_dim=8, model_dim=16), "`ngroups` must divide"),
    (lambda: SSDCell(3, model_dim=16), "`num_heads` must divide"),
    (lambda: GatedDeltaNetCell(0), "`num_heads` must be a positive"),
    (lambda: SSDCell(2, state_dim=0), "`state_dim` must be a positive"),
])
def test_bad_arguments_raise(make, match):
  with pytest.raises(ValueError, match=match):
    hk.transform(make).init(None)
