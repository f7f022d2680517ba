"""ops.moe_dispatch: every dispatch path against the dense reference, and the
routing and sorting pieces it is built from."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
from ops.moe_dispatch import capacity_positions
from ops.moe_dispatch import choose_dropless_impl
from ops.moe_dispatch import moe_dispatch_reference
from ops.moe_dispatch import router_logits
from ops.moe_dispatch import sort_by_expert
from ops.moe_dispatch import top_k_experts
from tests.ops import test_measured

T, E, TOP_K, D, F = 24, 4, 2, 16, 32
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 5e-2}  # times max(1, |reference|)


def _inputs(activation="gelu", routing="random"):
  """x [T, D], expert_ids and gates [T, k], w_in [E, D, F'], w_out [E, F, D]."""
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  f_in = 2 * F if activation == "swiglu" else F
  x = jax.random.normal(keys[0], (T, D))
  if routing == "collapsed":  # experts 2 and 3 get nothing
    expert_ids = jnp.tile(jnp.arange(TOP_K, dtype=jnp.int32), (T, 1))
  else:
    expert_ids = jnp.argsort(jax.random.uniform(keys[1], (T, E)), axis=1)[:, :TOP_K]
    expert_ids = expert_ids.astype(jnp.int32)
  gates = jax.nn.softmax(jax.random.normal(keys[2], (T, TOP_K)), axis=-1)
  w_in = jax.random.normal(keys[3], (E, D, f_in)) / np.sqrt(D)
  w_out = jax.random.normal(keys[4], (E, F, D)) / np.sqrt(F)
  return x, expert_ids, gates, w_in, w_out


@functools.cache
def _value_and_grads(fn, **kwargs):
  """Jitted (y, keep, dx, dgates, dw_in, dw_out) of a fixed nonlinear loss."""
  def loss(x, gates, w_in, w_out, expert_ids):
    y, keep = fn(x, expert_ids, gates, w_in, w_out, **kwargs)
    return jnp.sum(jnp.sin(y.astype(jnp.float32))), (y, keep)

  @jax.jit
  def run(x, expert_ids, gates, w_in, w_out):
    (_, (y, keep)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        x, gates, w_in, w_out, expert_ids)
    return (y, keep, *grads)
  return run


def _assert_close(actual, expected, dtype=jnp.float32):
  for a, b in zip(actual, expected):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE[dtype] * scale)


@pytest.mark.parametrize("routing", ["random", "collapsed"])
@pytest.mark.parametrize("impl", ["dense", "ragged_dot", "sort", "gmm", "auto"])
def test_dropless_impls_match_reference(impl, routing):
  args = _inputs(routing=routing)
  want = _value_and_grads(moe_dispatch_reference)(*args)
  got = _value_and_grads(ops.moe_dispatch, dropless_impl=impl)(*args)
  _assert_close(got, want)
  assert np.asarray(got[1]).all()  # dropless: every assignment kept
  if routing == "collapsed":
    assert not np.asarray(got[4][2:]).any()  # unused experts: no weight gradient


def test_swiglu_matches_reference():
  args = _inputs("swiglu")
  want = _value_and_grads(moe_dispatch_reference, activation="swiglu")(*args)
  got = _value_and_grads(ops.moe_dispatch, activation="swiglu",
                         dropless_impl="ragged_dot")(*args)
  _assert_close(got, want)


@pytest.mark.parametrize("impl", ["dense", "sort"])
def test_capacity_matches_reference(impl):
  args = _inputs()
  want = _value_and_grads(moe_dispatch_reference, capacity_factor=0.5)(*args)
  got = _value_and_grads(ops.moe_dispatch, capacity_factor=0.5, dropless_impl=impl)(*args)
  _assert_close(got, want)
  np.testing.assert_array_equal(got[1], want[1])
  capacity = int(np.ceil(0.5 * T * TOP_K / E))
  counts = np.bincount(np.asarray(args[1]).reshape(-1), minlength=E)
  assert int((~np.asarray(got[1])).sum()) == int(np.maximum(counts - capacity, 0).sum()) > 0


def test_bfloat16_in_bfloat16_out():
  x, expert_ids, gates, w_in, w_out = _inputs()
  y, _ = ops.moe_dispatch(x.astype(jnp.bfloat16), expert_ids, gates, w_in, w_out,
                          dropless_impl="gmm")
  assert y.dtype == jnp.bfloat16
  want, _ = moe_dispatch_reference(x, expert_ids, gates, w_in, w_out)
  _assert_close([y], [want], jnp.bfloat16)


@pytest.mark.parametrize("change, kwargs, error, match", [
    (dict(x=jnp.zeros((T, D, 1))), {}, ValueError, "`x` must be"),
    (dict(expert_ids=jnp.zeros((T + 1, TOP_K), jnp.int32)), {}, ValueError, "`expert_ids`"),
    (dict(expert_ids=jnp.zeros((T, TOP_K))), {}, ValueError, "`expert_ids` must be integers"),
    (dict(gates=jnp.zeros((T, TOP_K + 1))), {}, ValueError, "`gates`"),
    (dict(w_in=jnp.zeros((E, D + 1, F))), {}, ValueError, "`w_in`"),
    (dict(w_out=jnp.zeros((E + 1, F, D))), {}, ValueError, "`w_out`"),
    (dict(x=[[1.0]]), {}, TypeError, "`x` must be an array"),
    ({}, dict(activation="relu"), ValueError, "activation"),
    ({}, dict(dropless_impl="fast"), ValueError, "dropless_impl"),
    ({}, dict(capacity_factor=0.0), ValueError, "capacity_factor"),
    ({}, dict(capacity_factor="1.25"), TypeError, "capacity_factor"),
    ({}, dict(expert_axis=5), TypeError, "expert_axis"),
    ({}, dict(capacity_factor=1.0, expert_axis="expert"), ValueError, "expert_axis"),
    ({}, dict(grouped_matmul_implementation="cuda"), ValueError,
     "grouped_matmul_implementation"),
    ({}, dict(expert_axis="expert"), ValueError, "mesh"),
])
def test_bad_arguments_raise(change, kwargs, error, match):
  args = dict(zip(("x", "expert_ids", "gates", "w_in", "w_out"), _inputs()))
  args.update(change)
  with pytest.raises(error, match=match):
    ops.moe_dispatch(*args.values(), **kwargs)


def test_capacity_positions_choice_major():
  ids = jnp.asarray([[0, 1], [0, 2], [1, 0]])
  slot, keep = capacity_positions(ids, 3, capacity=2)
  # First choices: token0->0 (slot 0), token1->0 (1), token2->1 (0);
  # second choices: token0->1 (1), token1->2 (0), token2->0 (2, dropped).
  np.testing.assert_array_equal(slot, [[0, 1], [1, 0], [0, 2]])
  np.testing.assert_array_equal(keep, [[True, True], [True, True], [True, False]])


def test_top_k_matches_lax_top_k_with_ties():
  probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(4), (64, E)))
  probs = probs.at[:8].set(1.0 / E)  # ties: lowest index first, as lax.top_k
  for k in (1, TOP_K, E):
    want = jax.lax.top_k(probs, k)
    got = top_k_experts(probs, k)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=0)


def test_counting_sort_matches_argsort():
  ids = jax.random.randint(jax.random.PRNGKey(3), (300,), 0, E + 1)  # E marks empty rows
  want = sort_by_expert(ids, E, method="argsort")
  got = sort_by_expert(ids, E, method="counting")
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  np.testing.assert_array_equal(got[2], np.bincount(np.asarray(ids), minlength=E + 1)[:E])


def test_router_logits_of_bfloat16_tokens_keep_float32_accuracy():
  # The bfloat16 path splits the float32 weights into three bfloat16 parts.
  x = jax.random.normal(jax.random.PRNGKey(0), (300, 64), jnp.bfloat16)
  w = jax.random.normal(jax.random.PRNGKey(1), (64, 8)) / 8
  cotangent = jax.random.normal(jax.random.PRNGKey(2), (300, 8))

  def highest(x, w):
    return jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
  results = []
  for fn in (router_logits, highest):
    logits, vjp = jax.vjp(jax.jit(fn), x, w)
    results.append((logits, *vjp(cotangent)))
  for got, want, tol in zip(results[0], results[1], (1e-6, 1e-2, 1e-6)):
    assert got.dtype == want.dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


def test_auto_takes_the_measured_fastest_path_on_nvidia_gpus(monkeypatch):
  assert choose_dropless_impl(4096, 8, 2, 512, 1024) == "ragged_dot"  # a CPU
  test_measured.fake_gpu(monkeypatch, {})
  assert choose_dropless_impl(4096, 8, 2, 512, 1024) == "ragged_dot"  # nothing measured
  axes = ("experts", "top_k", "d_model", "d_hidden", "tokens")
  points = [dict(experts=8, top_k=2, d_model=512, d_hidden=1024, tokens=t, ms=ms)
            for t, ms in ((1024, dict(dense=1.0, gmm=2.0)),
                          (65536, dict(dense=9.0, gmm=2.0, sort=3.0)))]
  table = test_measured.measured_table(points, axes=axes, kernels=("gmm",))
  test_measured.fake_gpu(monkeypatch, {"moe": table})
  assert choose_dropless_impl(512, 8, 2, 512, 1024) == "dense"
  assert choose_dropless_impl(4096, 8, 2, 512, 1024) == "gmm"
  table["devices"][0]["checked"] = {}  # the kernels never passed their check here
  assert choose_dropless_impl(4096, 8, 2, 512, 1024) == "sort"
