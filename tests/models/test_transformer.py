"""Transformer and DiffusionTransformer: stacking, remat, dtypes, masking, errors."""

import functools

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pk

B, T, D_IN, D, N, L = 2, 6, 5, 16, 4, 3


def _model_fn(kind, **kwargs):
  """A transformed model taking (x, t) for both kinds (t unused by the Transformer)."""
  if kind == "transformer":
    def f(x, t):
      del t
      return pk.Transformer(D, N, L, **kwargs)(x)
  else:
    def f(x, t):
      return pk.DiffusionTransformer(D, N, L, **kwargs)(x, t)
  return hk.transform(f)


def _inputs(dtype=jnp.float32, seed=0):
  kx, kt = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(kx, (B, T, D_IN), dtype),
          jax.random.uniform(kt, (B,), minval=0, maxval=1000))


def _randomize(params, seed=1):
  """adaLN-Zero starts at zero (the model is then trivially the identity):
  perturb every parameter so that comparisons test real computation."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [
      p + 0.1 * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys)])


def _loss_and_grad(model, params, x, t):
  loss = lambda p: jnp.mean(jnp.square(model.apply(p, None, x, t).astype(jnp.float32)))
  return jax.jit(jax.value_and_grad(loss))(params)


@functools.cache
def _plain(kind):
  """(params, loss, grads) of the plain model: the baseline every scan and
  remat case compares with, compiled once per kind and test process."""
  x, t = _inputs()
  model = _model_fn(kind)
  params = _randomize(model.init(jax.random.key(0), x, t))
  return (params, *_loss_and_grad(model, params, x, t))


KINDS = ["transformer", "dit"]


# scan_unroll is hk.layer_stack's, the same for both kinds.
@pytest.mark.parametrize("kind, unroll", [("transformer", 1), ("dit", 1), ("transformer", 2)])
def test_scanned_equals_unrolled(kind, unroll):
  x, t = _inputs()
  scanned = _model_fn(kind, scan_layers=True, scan_unroll=unroll)
  params, loss_u, grad_u = _plain(kind)
  stacked = pk.stack_layer_params(params)
  chex.assert_trees_all_equal_shapes(stacked, scanned.init(jax.random.key(0), x, t))
  loss_s, grad_s = _loss_and_grad(scanned, stacked, x, t)
  chex.assert_trees_all_close(loss_s, loss_u, rtol=1e-5)
  chex.assert_trees_all_close(pk.unstack_layer_params(grad_s), grad_u, atol=1e-5, rtol=1e-4)
  assert float(loss_u) > 0


# Every policy on the Transformer; the DiT's blocks go through the same
# stacking code, so two policies (the whole block and a jax policy) cover it.
@pytest.mark.parametrize("kind, policy", [
    *(("transformer", policy) for policy in pk.remat_policy_names()),
    ("dit", "full"), ("dit", "dots_saveable")])
def test_remat_equals_no_remat(kind, policy):
  x, t = _inputs()
  remat = _model_fn(kind, remat_policy=policy)
  params, loss_p, grad_p = _plain(kind)
  loss_r, grad_r = _loss_and_grad(remat, params, x, t)
  chex.assert_trees_all_close(loss_r, loss_p, rtol=1e-6)
  chex.assert_trees_all_close(grad_r, grad_p, atol=1e-6, rtol=1e-5)


def test_callable_remat_policy_and_scan_together():
  x, t = _inputs()
  plain = _model_fn("transformer")
  both = _model_fn("transformer", scan_layers=True,
                   remat_policy=jax.checkpoint_policies.dots_saveable)
  params = _randomize(plain.init(jax.random.key(0), x, t))
  loss_p, grad_p = _loss_and_grad(plain, params, x, t)
  loss_b, grad_b = _loss_and_grad(both, pk.stack_layer_params(params), x, t)
  chex.assert_trees_all_close(loss_b, loss_p, rtol=1e-5)
  chex.assert_trees_all_close(pk.unstack_layer_params(grad_b), grad_p, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_parameter_tree_names_the_conversion(kind):
  x, t = _inputs()
  unrolled, scanned = _model_fn(kind), _model_fn(kind, scan_layers=True)
  params = unrolled.init(jax.random.key(0), x, t)
  with pytest.raises(ValueError, match="stack_layer_params"):
    scanned.apply(params, None, x, t)
  with pytest.raises(ValueError, match="unstack_layer_params"):
    unrolled.apply(pk.stack_layer_params(params), None, x, t)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_in_bf16_out_with_float32_params(kind):
  x, t = _inputs(jnp.bfloat16)
  model = _model_fn(kind)
  params = model.init(jax.random.key(0), x, t)
  assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  out = jax.jit(model.apply)(_randomize(params), None, x, t)
  assert out.dtype == jnp.bfloat16
  expected_dim = D if kind == "transformer" else D_IN
  assert out.shape == (B, T, expected_dim)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))


def test_causal_masking_really_masks():
  x, t = _inputs()
  model = _model_fn("transformer", is_causal=True)
  params = _randomize(model.init(jax.random.key(0), x, t))
  changed = x.at[:, 4:].set(100.0)
  out, out_changed = model.apply(params, None, x, t), model.apply(params, None, changed, t)
  chex.assert_trees_all_close(out[:, :4], out_changed[:, :4], atol=1e-5)
  assert not np.allclose(out[:, 4:], out_changed[:, 4:])


def test_key_lengths_hide_padding():
  x, _ = _inputs()
  model = hk.transform(lambda x, lengths: pk.Transformer(D, N, L, num_kv_heads=2)(
      x, key_value_seq_lengths=lengths))
  lengths = jnp.array([4, 6])
  params = _randomize(model.init(jax.random.key(0), x, lengths))
  garbage = x.at[0, 4:].set(-50.0)
  out, out_garbage = (model.apply(params, None, a, lengths) for a in (x, garbage))
  chex.assert_trees_all_close(out[0, :4], out_garbage[0, :4], atol=1e-5)


def test_dropout_only_when_training_with_rng():
  x, _ = _inputs()
  model = hk.transform(lambda x, is_training: pk.Transformer(D, N, L, dropout_rate=0.5)(
      x, is_training=is_training))
  params = model.init(jax.random.key(0), x, True)
  ref = model.apply(params, None, x, False)
  chex.assert_trees_all_close(model.apply(params, jax.random.key(1), x, False), ref)
  chex.assert_trees_all_close(model.apply(params, None, x, True), ref)  # no RNG: no dropout
  assert not np.allclose(model.apply(params, jax.random.key(1), x, True), ref)


def test_dit_time_and_context_condition_the_output():
  x, t = _inputs()
  model = hk.transform(lambda x, t, c: pk.DiffusionTransformer(D, N, L)(x, t, c))
  context = jnp.ones((B, 3))
  params = _randomize(model.init(jax.random.key(0), x, t, context))
  out = model.apply(params, None, x, t, context)
  assert not np.allclose(out, model.apply(params, None, x, t + 100.0, context))
  assert not np.allclose(out, model.apply(params, None, x, t, 2 * context))


def test_dit_starts_as_zero_prediction():
  x, t = _inputs()
  model = _model_fn("dit")
  out = model.apply(model.init(jax.random.key(0), x, t), None, x, t)
  np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("make, match", [
    (lambda: pk.Transformer(30, 4, 2), "num_heads"),
    (lambda: pk.DiffusionTransformer(30, 4, 2), "num_heads"),
    (lambda: pk.Transformer(32, 4, 2, num_kv_heads=3), "num_kv_heads"),
    (lambda: pk.Transformer(32, 4, 2, remat_policy="everything"), "remat_policy"),
    (lambda: pk.DiffusionTransformer(32, 4, 2, remat_policy="dots"), "remat_policy"),
    (lambda: pk.Transformer(32, 4, 2, dropout_rate=1.0), "dropout_rate"),
])
def test_bad_constructor_arguments_raise(make, match):
  with pytest.raises(ValueError, match=match):
    hk.transform(make).init(None)  # Modules can only be built inside a transform.


def test_bad_call_arguments_raise():
  x, t = _inputs()
  transformer = hk.transform(lambda x: pk.Transformer(D, N, L)(x))
  with pytest.raises(ValueError, match="`x` must be \\[B, T, D\\]"):
    transformer.init(jax.random.key(0), x[0])
  dit = hk.transform(lambda x, t: pk.DiffusionTransformer(D, N, L)(x, t))
  with pytest.raises(ValueError, match="`t`"):
    dit.init(jax.random.key(0), x, jnp.ones((B + 1,)))
  with pytest.raises(ValueError, match="`x`"):
    dit.init(jax.random.key(0), x[..., 0], t)
