"""Transformer and DiffusionTransformer: stacking, remat, dtypes, masking, errors.

Compilation dominates on a CPU, so parameters are drawn on the host
(tests/models/random_params.py), and the plain model with every scanned and
remat variant of one kind is differentiated in one compiled program, shared
by the tests that compare them.
"""

import functools

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pk
from probjax_hk import stacking
from tests.models.random_params import random_params

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


def _inputs(dtype=np.float32, seed=0):
  """x [B, T, D_IN] and t [B], as NumPy arrays (nothing to compile)."""
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(B, T, D_IN)).astype(dtype),
          rng.uniform(0, 1000, size=(B,)).astype(np.float32))


@functools.cache
def _params(kind):
  """Random parameters of the plain model of `kind` (the causal, dropout
  and remat variants hold the same tree)."""
  return random_params(_model_fn(kind), *_inputs())


KINDS = ["transformer", "dit"]
# scan_unroll is hk.layer_stack's, the same for both kinds; 2 of L = 3 leaves
# a remainder.
_SCAN_UNROLLS = {"transformer": (1, 2), "dit": (1,)}
# Every policy on the Transformer; the DiT's blocks go through the same
# stacking code, so two policies (the whole block and a jax policy) cover it.
_REMAT_POLICIES = {"transformer": pk.remat_policy_names(), "dit": ("full", "dots_saveable")}


def _computed_policy(kind, policy):
  """The first of `kind`'s policies that resolves to the same function as
  `policy`: jax.checkpoint_policies holds aliases ('checkpoint_dots' is
  'dots_saveable'), whose models trace to the same program, computed once."""
  return next(name for name in _REMAT_POLICIES[kind] if stacking.resolve_remat_policy(name)
              is stacking.resolve_remat_policy(policy))


def _variants(kind):
  """{name: model keyword arguments} of the variants compared with the plain model."""
  variants = {f"scan_unroll_{unroll}": dict(scan_layers=True, scan_unroll=unroll)
              for unroll in _SCAN_UNROLLS[kind]}
  variants.update({f"remat_{policy}": dict(remat_policy=policy)
                   for policy in _REMAT_POLICIES[kind]
                   if _computed_policy(kind, policy) == policy})
  if kind == "transformer":  # a callable policy, on the scanned stack
    variants["scan_callable_remat"] = dict(
        scan_layers=True, remat_policy=jax.checkpoint_policies.dots_saveable)
  return variants


@functools.cache
def _losses_and_grads(kind):
  """{'plain' or variant name: (loss, grads)} on the same parameters, the
  scanned variants fed `stack_layer_params` and their gradients passed
  through `unstack_layer_params`: one compiled program per kind."""
  def loss_and_grad(model, params, x, t):
    loss = lambda p: jnp.mean(jnp.square(model.apply(p, None, x, t).astype(jnp.float32)))
    return jax.value_and_grad(loss)(params)

  @jax.jit
  def every_variant(params, x, t):
    out = {"plain": loss_and_grad(_model_fn(kind), params, x, t)}
    for name, kwargs in _variants(kind).items():
      model = _model_fn(kind, **kwargs)
      if kwargs.get("scan_layers"):
        loss, grads = loss_and_grad(model, pk.stack_layer_params(params), x, t)
        out[name] = loss, pk.unstack_layer_params(grads)
      else:
        out[name] = loss_and_grad(model, params, x, t)
    return out

  return every_variant(_params(kind), *_inputs())


@pytest.mark.parametrize("kind, unroll", [("transformer", 1), ("dit", 1), ("transformer", 2)])
def test_scanned_equals_unrolled(kind, unroll):
  x, t = _inputs()
  scanned = _model_fn(kind, scan_layers=True, scan_unroll=unroll)
  chex.assert_trees_all_equal_shapes(jax.eval_shape(pk.stack_layer_params, _params(kind)),
                                     jax.eval_shape(scanned.init, jax.random.key(0), x, t))
  results = _losses_and_grads(kind)
  loss_u, grad_u = results["plain"]
  loss_s, grad_s = results[f"scan_unroll_{unroll}"]
  chex.assert_trees_all_close(loss_s, loss_u, rtol=1e-5)
  chex.assert_trees_all_close(grad_s, grad_u, atol=1e-5, rtol=1e-4)
  assert float(loss_u) > 0


@pytest.mark.parametrize("kind, policy", [
    (kind, policy) for kind in KINDS for policy in _REMAT_POLICIES[kind]])
def test_remat_equals_no_remat(kind, policy):
  results = _losses_and_grads(kind)
  loss_p, grad_p = results["plain"]
  loss_r, grad_r = results[f"remat_{_computed_policy(kind, policy)}"]
  chex.assert_trees_all_close(loss_r, loss_p, rtol=1e-6)
  chex.assert_trees_all_close(grad_r, grad_p, atol=1e-6, rtol=1e-5)


def test_callable_remat_policy_and_scan_together():
  results = _losses_and_grads("transformer")
  loss_p, grad_p = results["plain"]
  loss_b, grad_b = results["scan_callable_remat"]
  chex.assert_trees_all_close(loss_b, loss_p, rtol=1e-5)
  chex.assert_trees_all_close(grad_b, grad_p, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_parameter_tree_names_the_conversion(kind):
  x, t = _inputs()
  unrolled, scanned = _model_fn(kind), _model_fn(kind, scan_layers=True)
  params = jax.eval_shape(unrolled.init, jax.random.key(0), x, t)
  with pytest.raises(ValueError, match="stack_layer_params"):
    jax.eval_shape(scanned.apply, params, None, x, t)
  with pytest.raises(ValueError, match="unstack_layer_params"):
    jax.eval_shape(lambda p: unrolled.apply(pk.stack_layer_params(p), None, x, t), params)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_in_bf16_out_with_float32_params(kind):
  x, t = _inputs(jnp.bfloat16)
  model = _model_fn(kind)
  shapes = jax.eval_shape(model.init, jax.random.key(0), x, t)
  assert {p.dtype for p in jax.tree.leaves(shapes)} == {jnp.dtype(jnp.float32)}
  out = jax.jit(model.apply)(_params(kind), None, x, t)
  assert out.dtype == jnp.bfloat16
  expected_dim = D if kind == "transformer" else D_IN
  assert out.shape == (B, T, expected_dim)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))


def test_causal_masking_really_masks():
  x, t = _inputs()
  apply = jax.jit(_model_fn("transformer", is_causal=True).apply)
  params = _params("transformer")
  changed = x.copy()
  changed[:, 4:] = 100.0
  out, out_changed = apply(params, None, x, t), apply(params, None, changed, t)
  chex.assert_trees_all_close(out[:, :4], out_changed[:, :4], atol=1e-5)
  assert not np.allclose(out[:, 4:], out_changed[:, 4:])


def test_key_lengths_hide_padding():
  x, _ = _inputs()
  model = hk.transform(lambda x, lengths: pk.Transformer(D, N, L, num_kv_heads=2)(
      x, key_value_seq_lengths=lengths))
  lengths = np.array([4, 6], np.int32)
  params = random_params(model, x, lengths)
  garbage = x.copy()
  garbage[0, 4:] = -50.0
  apply = jax.jit(model.apply)
  out, out_garbage = (apply(params, None, a, lengths) for a in (x, garbage))
  chex.assert_trees_all_close(out[0, :4], out_garbage[0, :4], atol=1e-5)


def test_dropout_only_when_training_with_rng():
  x, _ = _inputs()
  model = hk.transform(lambda x, is_training: pk.Transformer(D, N, L, dropout_rate=0.5)(
      x, is_training=is_training))

  @jax.jit  # One compiled program for the four cases.
  def outputs(params, x):
    key = jax.random.key(1)
    return (model.apply(params, None, x, False), model.apply(params, key, x, False),
            model.apply(params, None, x, True), model.apply(params, key, x, True))

  ref, eval_rng, train_no_rng, train_rng = outputs(_params("transformer"), x)
  chex.assert_trees_all_close(eval_rng, ref)
  chex.assert_trees_all_close(train_no_rng, ref)  # no RNG: no dropout
  assert not np.allclose(train_rng, ref)


def test_dit_time_and_context_condition_the_output():
  x, t = _inputs()
  model = hk.transform(lambda x, t, c: pk.DiffusionTransformer(D, N, L)(x, t, c))
  context = np.ones((B, 3), np.float32)
  params = random_params(model, x, t, context)
  apply = jax.jit(model.apply)
  out = apply(params, None, x, t, context)
  assert not np.allclose(out, apply(params, None, x, t + 100.0, context))
  assert not np.allclose(out, apply(params, None, x, t, 2 * context))


def test_dit_starts_as_zero_prediction():
  x, t = _inputs()
  # The output projection starts at zero whatever the blocks do: one block.
  model = hk.transform(lambda x, t: pk.DiffusionTransformer(D, N, 1)(x, t))
  out = jax.jit(lambda x, t: model.apply(model.init(jax.random.key(0), x, t), None, x, t))(x, t)
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
