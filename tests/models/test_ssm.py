"""SSMModel, LRUCell and MambaCell: decoding equals the sequence path,
bidirectional, dtypes, remat, scanned stacks, jit/grad/vmap, bad arguments.

Compilation dominates on a CPU, so inputs come from NumPy, parameters are
drawn on the host (tests/models/random_params.py), and the paths a test
compares run in one compiled program.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pj
from tests.models.random_params import random_params

B, T, D_IN, D, D_OUT, L = 2, 6, 3, 8, 5, 2
_CELLS = {"lru": (pj.LRUCell, {}),
          "mamba": (pj.MambaCell, {"state_dim": 4, "conv_width": 3})}


def _x(dtype=np.float32, time=T, seed=0, dim=D_IN):
  """[B, time, dim] as a NumPy array."""
  return np.random.default_rng(seed).normal(size=(B, time, dim)).astype(dtype)


def _model(cell, **kwargs):
  cls, cell_kwargs = _CELLS[cell]
  return pj.SSMModel(D_IN, D, D_OUT, L, cell=cls, cell_kwargs=cell_kwargs, **kwargs)


def _forward(cell, **kwargs):
  return hk.without_apply_rng(hk.transform(lambda x: _model(cell, **kwargs)(x)))


@functools.cache
def _params(cell):
  """Parameters of `_model(cell)`; its remat and dropout variants hold the same tree."""
  return random_params(_forward(cell), _x())


@functools.cache
def _apply(cell):
  """`_model(cell)`'s jitted apply, shared by the tests that run it as is."""
  return jax.jit(_forward(cell).apply)


def _decode(cell, **kwargs):
  """The transformed step-by-step decoding of `_model(cell, **kwargs)`."""
  def decode(x):
    model = _model(cell, **kwargs)
    state = model.initial_state(x.shape[0])
    ys = []
    for t in range(x.shape[1]):
      y, state = model.step(x[:, t], state)
      ys.append(y)
    return jnp.stack(ys, axis=1)
  return hk.without_apply_rng(hk.transform(decode))


@pytest.mark.parametrize("cell", ["lru", "mamba"])
def test_cell_decode_matches_sequence(cell):
  cls, cell_kwargs = _CELLS[cell]

  def both(x):
    module = cls(**cell_kwargs, model_dim=D)
    y = module(x)
    state = module.initial_state(x.shape[0])
    steps = []
    for t in range(x.shape[1]):
      y_t, state = module.step(x[:, t], state)
      steps.append(y_t)
    return y, jnp.stack(steps, axis=1)

  f = hk.transform(both)
  x = _x(dim=D)
  y, y_steps = jax.jit(f.apply)(random_params(f, x), None, x)
  assert y.shape == (B, T, D)
  np.testing.assert_allclose(y_steps, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cell,scan_layers", [("lru", True), ("mamba", False)])
def test_model_decode_matches_sequence(cell, scan_layers):
  sequence, decode = _forward(cell, scan_layers=scan_layers), _decode(cell, scan_layers=scan_layers)
  x = _x()
  params = random_params(sequence, x)

  @jax.jit  # One compiled program for both paths.
  def both(params, x):
    return sequence.apply(params, x), decode.apply(params, x)

  y, y_decoded = both(params, x)
  assert y.shape == (B, T, D_OUT)
  np.testing.assert_allclose(y_decoded, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cell", ["lru", "mamba"])
def test_bidirectional_sees_the_future_and_cannot_decode(cell):
  x = _x()
  changed = x.copy()
  changed[:, -1] += 1.0
  for bidirectional in (False, True):
    f = _forward(cell, bidirectional=bidirectional)
    params = random_params(f, x)
    assert any("cell_reverse" in name for name in params) == bidirectional
    apply = jax.jit(f.apply) if bidirectional else _apply(cell)
    first_step_moved = np.abs(apply(params, changed)[:, 0] - apply(params, x)[:, 0]).max() > 1e-4
    assert first_step_moved == bidirectional
  decode = hk.transform(lambda: _model(cell, bidirectional=True).initial_state(B))
  with pytest.raises(ValueError, match="bidirectional"):
    decode.init(jax.random.key(0))


@pytest.mark.parametrize("cell", ["lru", "mamba"])
def test_bf16_in_bf16_out(cell):
  x = _x()
  shapes = jax.eval_shape(_forward(cell).init, jax.random.key(1), x)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(shapes))
  params = _params(cell)
  y16 = _apply(cell)(params, x.astype(jnp.bfloat16))
  assert y16.dtype == jnp.bfloat16
  y32 = _apply(cell)(params, x)
  np.testing.assert_allclose(np.asarray(y16, np.float32), y32, atol=0.1, rtol=0.1)


def _loss(f):
  return lambda params, x: jnp.sum(jnp.sin(f.apply(params, x)))


def test_remat_matches_no_remat():
  x = _x()
  plain, remat = _forward("mamba"), _forward("mamba", remat_policy="full")
  params = _params("mamba")
  assert (jax.tree.structure(jax.eval_shape(remat.init, jax.random.key(1), x))
          == jax.tree.structure(params))

  @jax.jit  # One compiled program for both models.
  def both(params, x):
    return [jax.value_and_grad(_loss(f))(params, x) for f in (plain, remat)]

  (value, grads), (value_r, grads_r) = both(params, x)
  np.testing.assert_allclose(value_r, value, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5),
               grads_r, grads)


def test_scanned_matches_unrolled():
  x = _x()
  scanned = _forward("lru", scan_layers=True)
  params = _params("lru")
  assert (jax.tree.structure(jax.eval_shape(pj.stack_layer_params, params))
          == jax.tree.structure(jax.eval_shape(scanned.init, jax.random.key(1), x)))
  y_scanned = jax.jit(lambda p, x: scanned.apply(pj.stack_layer_params(p), x))(params, x)
  np.testing.assert_allclose(y_scanned, _apply("lru")(params, x), atol=1e-6, rtol=1e-6)
  with pytest.raises(ValueError, match="stack_layer_params"):
    jax.eval_shape(scanned.apply, params, x)


def test_jit_grad_vmap_and_dropout():
  f = hk.transform(lambda x, is_training: _model("lru", dropout_rate=0.5)(
      x, is_training=is_training))
  x = _x()

  @jax.jit  # One compiled program for every case.
  def outputs(params, x, rng):
    return (f.apply(params, None, x, False), f.apply(params, rng, x, False),
            f.apply(params, rng, x, True),
            jax.grad(lambda p: jnp.sum(f.apply(p, None, x, False) ** 2))(params),
            jax.vmap(lambda xi: f.apply(params, None, xi[None], False)[0])(x))

  y, y_eval_rng, y_train, grads, per_example = outputs(_params("lru"), x, jax.random.key(2))
  np.testing.assert_allclose(y_eval_rng, y)  # no dropout outside training
  assert np.abs(y_train - y).max() > 1e-3
  assert all(np.isfinite(g).all() and np.abs(g).max() > 0 for g in jax.tree.leaves(grads))
  np.testing.assert_allclose(per_example, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build,argument", [
    (lambda: pj.LRUCell(state_dim=0), "state_dim"),
    (lambda: pj.LRUCell(r_min=0.9, r_max=0.5), "r_min"),
    (lambda: pj.MambaCell(state_dim=-1), "state_dim"),
    (lambda: pj.MambaCell(expand=0), "expand"),
    (lambda: pj.MambaCell(conv_width=0), "conv_width"),
    (lambda: pj.MambaCell(dt_rank=0), "dt_rank"),
    (lambda: pj.SSMModel(D_IN, D, D_OUT, 0), "num_layers"),
    (lambda: pj.SSMModel(D_IN, 0, D_OUT, L), "model_dim"),
    (lambda: pj.SSMModel(D_IN, D, D_OUT, L, dropout_rate=1.0), "dropout_rate"),
    (lambda: pj.SSMModel(D_IN, D, D_OUT, L, remat_policy="sometimes"), "remat_policy"),
    (lambda: pj.SSMModel(D_IN, D, D_OUT, L, cell_kwargs={"model_dim": 4}), "model_dim"),
    (lambda: pj.SSMModel(D_IN, D, D_OUT, L, cell=pj.MambaCell,
                         cell_kwargs={"expand": 0}), "expand"),
    (lambda: pj.SSMModel(D_IN, D, D_OUT, L)(jnp.zeros((B, T, D_IN + 1))), "x"),
    (lambda: pj.SSMModel(D_IN, D, D_OUT, L).step(jnp.zeros((B, T, D_IN)), None), "x_t"),
])
def test_bad_arguments_raise(build, argument):
  with pytest.raises(ValueError, match=f"`{argument}`"):
    hk.transform(build).init(jax.random.key(0))


@pytest.mark.parametrize("cell", ["lru", "mamba"])
def test_pallas_cells_match_xla(cell):
  # The cells' sequence path on the Pallas kernels (interpret mode here),
  # both directions through a bidirectional model.
  cls, cell_kwargs = _CELLS[cell]
  models = [hk.without_apply_rng(hk.transform(lambda x, implementation=implementation: (
      pj.SSMModel(D_IN, D, D_OUT, 1, cell=cls, bidirectional=True,
                  cell_kwargs={**cell_kwargs, "implementation": implementation})(x))))
            for implementation in ("xla", "pallas")]
  x = _x()
  y_xla, y_pallas = jax.jit(lambda p, x: [m.apply(p, x) for m in models])(
      random_params(models[0], x), x)
  np.testing.assert_allclose(y_pallas, y_xla, atol=1e-5, rtol=1e-5)
