"""SSMModel, LRUCell and MambaCell: decoding equals the sequence path,
bidirectional, dtypes, remat, scanned stacks, jit/grad/vmap, bad arguments."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pj

B, T, D_IN, D, D_OUT, L = 2, 6, 3, 8, 5, 2
_CELLS = {"lru": (pj.LRUCell, {}),
          "mamba": (pj.MambaCell, {"state_dim": 4, "conv_width": 3})}


def _x(dtype=jnp.float32, time=T, seed=0):
  return jax.random.normal(jax.random.key(seed), (B, time, D_IN), dtype)


def _model(cell, **kwargs):
  cls, cell_kwargs = _CELLS[cell]
  return pj.SSMModel(D_IN, D, D_OUT, L, cell=cls, cell_kwargs=cell_kwargs, **kwargs)


def _sequence_and_decode(cell, **kwargs):
  """Transformed (sequence, decode) functions over the same parameters."""
  def sequence(x):
    return _model(cell, **kwargs)(x)

  def decode(x):
    model = _model(cell, **kwargs)
    state = model.initial_state(x.shape[0])
    ys = []
    for t in range(x.shape[1]):
      y, state = model.step(x[:, t], state)
      ys.append(y)
    return jnp.stack(ys, axis=1)
  return (hk.without_apply_rng(hk.transform(sequence)),
          hk.without_apply_rng(hk.transform(decode)))


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
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  y, y_steps = f.apply(f.init(jax.random.key(1), x), None, x)
  assert y.shape == (B, T, D)
  np.testing.assert_allclose(y_steps, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cell,scan_layers", [("lru", True), ("mamba", False)])
def test_model_decode_matches_sequence(cell, scan_layers):
  sequence, decode = _sequence_and_decode(cell, scan_layers=scan_layers)
  x = _x()
  params = sequence.init(jax.random.key(1), x)
  y = sequence.apply(params, x)
  assert y.shape == (B, T, D_OUT)
  np.testing.assert_allclose(decode.apply(params, x), y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cell", ["lru", "mamba"])
def test_bidirectional_sees_the_future_and_cannot_decode(cell):
  for bidirectional in (False, True):
    f = hk.without_apply_rng(hk.transform(
        lambda x: _model(cell, bidirectional=bidirectional)(x)))
    x = _x()
    params = f.init(jax.random.key(1), x)
    assert any("cell_reverse" in name for name in params) == bidirectional
    changed = f.apply(params, x.at[:, -1].add(1.0))
    first_step_moved = np.abs(changed[:, 0] - f.apply(params, x)[:, 0]).max() > 1e-4
    assert first_step_moved == bidirectional
  decode = hk.transform(lambda: _model(cell, bidirectional=True).initial_state(B))
  with pytest.raises(ValueError, match="bidirectional"):
    decode.init(jax.random.key(0))


@pytest.mark.parametrize("cell", ["lru", "mamba"])
def test_bf16_in_bf16_out(cell):
  f = hk.without_apply_rng(hk.transform(lambda x: _model(cell)(x)))
  x = _x()
  params = f.init(jax.random.key(1), x)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  y16 = f.apply(params, x.astype(jnp.bfloat16))
  assert y16.dtype == jnp.bfloat16
  y32 = f.apply(params, x)
  np.testing.assert_allclose(np.asarray(y16, np.float32), y32, atol=0.1, rtol=0.1)


def _loss(f):
  return lambda params, x: jnp.sum(jnp.sin(f.apply(params, x)))


def test_remat_matches_no_remat():
  x = _x()
  plain = hk.without_apply_rng(hk.transform(lambda x: _model("mamba")(x)))
  remat = hk.without_apply_rng(hk.transform(
      lambda x: _model("mamba", remat_policy="full")(x)))
  params = plain.init(jax.random.key(1), x)
  assert jax.tree.structure(remat.init(jax.random.key(1), x)) == jax.tree.structure(params)
  value, grads = jax.value_and_grad(_loss(plain))(params, x)
  value_r, grads_r = jax.value_and_grad(_loss(remat))(params, x)
  np.testing.assert_allclose(value_r, value, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5),
               grads_r, grads)


def test_scanned_matches_unrolled():
  x = _x()
  unrolled = hk.without_apply_rng(hk.transform(lambda x: _model("lru")(x)))
  scanned = hk.without_apply_rng(hk.transform(lambda x: _model("lru", scan_layers=True)(x)))
  params = unrolled.init(jax.random.key(1), x)
  stacked = pj.stack_layer_params(params)
  assert (jax.tree.structure(stacked)
          == jax.tree.structure(scanned.init(jax.random.key(1), x)))
  np.testing.assert_allclose(scanned.apply(stacked, x), unrolled.apply(params, x),
                             atol=1e-6, rtol=1e-6)
  with pytest.raises(ValueError, match="stack_layer_params"):
    scanned.apply(params, x)


def test_jit_grad_vmap_and_dropout():
  f = hk.transform(lambda x, is_training: _model("lru", dropout_rate=0.5)(
      x, is_training=is_training))
  x = _x()
  params = f.init(jax.random.key(1), x, False)
  apply = jax.jit(f.apply, static_argnums=3)
  y = apply(params, None, x, False)
  np.testing.assert_allclose(apply(params, None, x, False), y)
  assert np.abs(apply(params, jax.random.key(2), x, True) - y).max() > 1e-3
  grads = jax.jit(jax.grad(lambda p: jnp.sum(f.apply(p, None, x, False) ** 2)))(params)
  assert all(np.isfinite(g).all() and np.abs(g).max() > 0 for g in jax.tree.leaves(grads))
  per_example = jax.vmap(lambda xi: f.apply(params, None, xi[None], False)[0])(x)
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
  outputs = []
  for implementation in ("xla", "pallas"):
    kwargs = {**cell_kwargs, "implementation": implementation}
    f = hk.without_apply_rng(hk.transform(lambda x: pj.SSMModel(
        D_IN, D, D_OUT, 1, cell=cls, cell_kwargs=kwargs, bidirectional=True)(x)))
    x = _x()
    outputs.append(f.apply(f.init(jax.random.key(1), x), x))
  np.testing.assert_allclose(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
