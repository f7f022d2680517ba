"""MoELayer: every dispatch path computes the 'dense' reference's function.

The dispatch op's own pieces (routing, sorting, capacity slots, the 'auto'
rule) are tested in tests/ops/test_moe_dispatch.py."""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax_hk import MoELayer

E, TOP_K, D, F = 4, 2, 16, 32
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 5e-2}  # times max(1, |reference|)


def _transform(**kwargs):
  kwargs = {"dropless_impl": "dense", **kwargs}
  return hk.transform_with_state(lambda x: MoELayer(E, TOP_K, F, **kwargs)(x))


def _inputs(dtype=jnp.float32):
  return jax.random.normal(jax.random.PRNGKey(0), (2, 24, D), jnp.float32).astype(dtype)


@functools.cache
def _params(activation="gelu", routing="random"):
  params, _ = _transform(activation=activation).init(jax.random.PRNGKey(1), _inputs())
  if routing == "collapsed":
    # A zero router ties every expert: top-k picks experts 0 and 1 for every
    # token, experts 2 and 3 get nothing.
    params = jax.tree.map(lambda x: x, params)
    params["moe_layer"]["router"] = jnp.zeros_like(params["moe_layer"]["router"])
  return params


@functools.cache
def _loss_and_grads(**kwargs):
  """Jitted (loss, (y, state), (dparams, dx)) of a fixed nonlinear loss."""
  fn = _transform(**kwargs)

  def loss(params, x):
    y, state = fn.apply(params, {}, None, x)
    value = jnp.sum(jnp.sin(y.astype(jnp.float32))) + state["moe_layer"]["aux_loss"]
    return value, (y, state["moe_layer"])
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _run(params, x, **kwargs):
  (value, (y, state)), grads = _loss_and_grads(**kwargs)(params, x)
  return value, y, state, grads


def _assert_tree_close(actual, expected, dtype):
  def close(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE[dtype] * scale)
  jax.tree.map(close, actual, expected)


@pytest.mark.parametrize("routing", ["random", "collapsed"])
@pytest.mark.parametrize("impl", ["ragged_dot", "sort", "gmm", "auto"])
def test_dropless_impls_match_dense(impl, routing):
  params, x = _params(routing=routing), _inputs()
  want = _run(params, x)
  got = _run(params, x, dropless_impl=impl)
  _assert_tree_close(got, want, jnp.float32)
  if routing == "collapsed":
    np.testing.assert_array_equal(got[2]["tokens_per_expert"], [48, 48, 0, 0])
    assert not np.asarray(got[3][0]["moe_layer"]["w_in"][2:]).any()  # unused experts


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_gmm_with_pallas_kernel_matches_dense(activation):
  params, x = _params(activation), _inputs()
  want = _run(params, x, activation=activation)
  got = _run(params, x, activation=activation, dropless_impl="gmm",
             grouped_matmul_implementation="pallas")
  _assert_tree_close(got, want, jnp.float32)


def test_swiglu_ragged_dot_matches_dense():
  params, x = _params("swiglu"), _inputs()
  assert params["moe_layer"]["w_in"].shape == (E, D, 2 * F)
  want = _run(params, x, activation="swiglu")
  got = _run(params, x, activation="swiglu", dropless_impl="ragged_dot")
  _assert_tree_close(got, want, jnp.float32)


@pytest.mark.parametrize("impl", ["dense", "gmm"])
def test_bfloat16_in_bfloat16_out(impl):
  params = _params()
  _, y, state, (dparams, dx) = _run(params, _inputs(jnp.bfloat16), dropless_impl=impl)
  assert y.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16
  assert dparams["moe_layer"]["w_in"].dtype == jnp.float32
  assert state["aux_loss"].dtype == jnp.float32  # router math stays float32
  _, y32, _, _ = _run(params, _inputs(), dropless_impl=impl)
  _assert_tree_close(y, y32, jnp.bfloat16)


def test_aux_losses_and_statistics():
  params, x = _params(), _inputs()
  _, _, state, _ = _run(params, x)
  logits = np.asarray(x.reshape(-1, D), np.float64) @ np.asarray(params["moe_layer"]["router"])
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1)[:, :TOP_K]
  counts = np.bincount(top.reshape(-1), minlength=E)
  np.testing.assert_array_equal(state["tokens_per_expert"], counts)
  balance = E * np.sum(counts / top.size * probs.mean(0))
  z = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
  np.testing.assert_allclose(state["load_balance_loss"], balance, rtol=1e-5)
  np.testing.assert_allclose(state["router_z_loss"], z, rtol=1e-5)
  np.testing.assert_allclose(state["aux_loss"], 1e-2 * balance + 1e-3 * z, rtol=1e-5)
  assert int(state["dropped_tokens"]) == 0


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0])
def test_capacity_drops_and_counts(capacity_factor):
  params, x = _params(), _inputs()
  dense = _run(params, x, capacity_factor=capacity_factor)
  buffers = _run(params, x, capacity_factor=capacity_factor, dropless_impl="gmm")
  _assert_tree_close(buffers, dense, jnp.float32)
  # Expected drops: choice-major priority, C = ceil(cf * T * k / E) per expert.
  capacity = int(np.ceil(capacity_factor * 48 * TOP_K / E))
  counts = np.asarray(dense[2]["tokens_per_expert"])
  assert int(dense[2]["dropped_tokens"]) == int(np.maximum(counts - capacity, 0).sum()) > 0
  dropless = _run(params, x)
  assert not np.allclose(dense[1], dropless[1])


def test_capacity_large_enough_drops_nothing():
  params, x = _params(), _inputs()
  got = _run(params, x, capacity_factor=float(E), dropless_impl="sort")
  _assert_tree_close(got, _run(params, x), jnp.float32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=5), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(dropless_impl="fast"), "dropless_impl"),
    (dict(activation="relu"), "activation"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(capacity_factor=1.0, expert_axis="expert"), "expert_axis"),
])
def test_bad_arguments_raise(kwargs, match):
  args = {"top_k": TOP_K, **kwargs}
  with pytest.raises(ValueError, match=match):
    hk.transform_with_state(lambda x: MoELayer(E, d_hidden=F, **args)(x)).init(
        jax.random.PRNGKey(0), _inputs())


def test_mismatched_width_raises():
  with pytest.raises(ValueError):
    _transform().apply(_params(), {}, None, jnp.zeros((4, D + 1)))


def test_expert_axis_without_mesh_raises():
  with pytest.raises(ValueError, match="mesh"):
    _transform(expert_axis="expert").init(jax.random.PRNGKey(0), _inputs())
