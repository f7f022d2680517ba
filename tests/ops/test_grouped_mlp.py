"""ops.grouped_mlp: Pallas (interpret on CPU) and XLA against the reference."""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import tolerances
import ops
from ops.grouped_matmul import TritonConfig
from ops.grouped_matmul.reference import group_bounds
from ops.grouped_mlp import grouped_mlp_reference
from ops.grouped_mlp import pallas

# Absolute tolerances relative to the largest reference magnitude, by x dtype.
TOLERANCE = tolerances.GROUPED_MLP

# M = 70 is not a tile multiple, D = 40 and D' = 36 not block multiples, and
# F = 20 pads to 32 (each SwiGLU half separately).
M, D, F, D_OUT, G = 70, 40, 20, 36, 4
SMALL_BLOCKS = TritonConfig(block_m=16, block_k=16, block_n=16, tgmm_block_m=16,
                            tgmm_block_k=16, tgmm_block_n=16)
GROUPS = {
    "mixed_with_empty": [5, 0, 50, 15],
    "short_tail_rows_zero": [3, 4, 0, 10],
    "all_in_first": [70, 0, 0, 0],
}


def _normal(rng, *shape, dtype=jnp.float32, scale=1.0):
  """A NumPy draw as a device array (an eager `jax.random` call compiles a
  program per shape)."""
  return jnp.asarray((scale * rng.standard_normal(shape, np.float32)).astype(dtype))


def _inputs(activation, x_dtype, w_dtype, seed=0):
  rng = np.random.default_rng(seed)
  f_in = 2 * F if activation == "swiglu" else F
  x = _normal(rng, M, D, dtype=x_dtype)
  w_in = _normal(rng, G, D, f_in, dtype=w_dtype, scale=1 / np.sqrt(D))
  w_out = _normal(rng, G, F, D_OUT, dtype=w_dtype, scale=1 / np.sqrt(F))
  cotangent = _normal(rng, M, D_OUT, dtype=x_dtype)
  return x, w_in, w_out, cotangent


def _small_blocks(x, w_in, w_out, group_sizes, *, activation):
  starts, ends = group_bounds(group_sizes, x.shape[0])
  return pallas.grouped_mlp_pallas(x, w_in, w_out, starts, ends, activation=activation,
                                   block_sizes=SMALL_BLOCKS)


IMPLS = {
    "reference": grouped_mlp_reference,
    "pallas_small_blocks": _small_blocks,
    "pallas": functools.partial(ops.grouped_mlp, implementation="pallas"),
    "xla": functools.partial(ops.grouped_mlp, implementation="xla"),
}


@functools.cache
def _value_and_grads(impl, activation):
  """Jitted (y, dx, dw_in, dw_out) for a given cotangent; group sizes traced."""
  fn = functools.partial(IMPLS[impl], activation=activation)

  @jax.jit
  def run(x, w_in, w_out, group_sizes, cotangent):
    y, vjp = jax.vjp(lambda *a: fn(*a, group_sizes), x, w_in, w_out)
    return (y, *vjp(cotangent))
  return run


def _assert_close(actual, expected, dtype, what=""):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  scale = max(1.0, float(np.abs(expected).max()))
  np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE[dtype] * scale,
                             err_msg=what)


def _check(impl, activation, groups, x_dtype=jnp.float32, w_dtype=jnp.float32):
  args = _inputs(activation, x_dtype, w_dtype)
  sizes = jnp.asarray(GROUPS[groups], jnp.int32)
  got = _value_and_grads(impl, activation)(*args[:3], sizes, args[3])
  want = _value_and_grads("reference", activation)(*args[:3], sizes, args[3])
  for g, w, what, dtype in zip(got, want, ("y", "dx", "dw_in", "dw_out"),
                               (x_dtype, x_dtype, w_dtype, w_dtype)):
    assert g.dtype == dtype, what
    assert g.shape == w.shape, what
    _assert_close(g, w, x_dtype, what)
  return got


@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_kernel_float32_values_and_grads(activation, groups):
  y, dx, _, _ = _check("pallas_small_blocks", activation, groups)
  total = sum(GROUPS[groups])
  if total < M:  # Rows after the last group: zero output, zero gradient.
    assert not np.asarray(y[total:]).any()
    assert not np.asarray(dx[total:]).any()


# Each implementation with one activation, the small-block kernels with both:
# the casts of bfloat16 rows and float32 weights do not depend on the activation.
@pytest.mark.parametrize("impl, activation", [
    ("pallas_small_blocks", "gelu"), ("pallas_small_blocks", "swiglu"),
    ("pallas", "swiglu"), ("xla", "gelu")])
def test_bfloat16_input_float32_weights(impl, activation):
  # The MoE layer's case: weight gradients come back in float32.
  _check(impl, activation, "mixed_with_empty", jnp.bfloat16, jnp.float32)


def test_bfloat16_input_bfloat16_weights():
  _check("pallas_small_blocks", "gelu", "short_tail_rows_zero", jnp.bfloat16,
         jnp.bfloat16)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_xla_float32_values_and_grads(activation):
  _check("xla", activation, "mixed_with_empty")


def test_empty_group_has_zero_weight_gradients():
  _, _, dw_in, dw_out = _check("pallas_small_blocks", "swiglu", "mixed_with_empty")
  assert not np.asarray(dw_in[1]).any() and not np.asarray(dw_out[1]).any()
  assert np.asarray(dw_in[2]).any() and np.asarray(dw_out[2]).any()


@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(st.lists(st.integers(0, 30), min_size=G, max_size=G),
                  st.sampled_from(["gelu", "swiglu"]))
def test_kernel_matches_reference_on_drawn_group_sizes(sizes, activation):
  # Sizes summing past M are cut at row M, on both sides (traced sizes).
  x, w_in, w_out, cotangent = _inputs(activation, jnp.float32, jnp.float32, seed=1)
  sizes = jnp.asarray(sizes, jnp.int32)
  got = _value_and_grads("pallas_small_blocks", activation)(x, w_in, w_out, sizes, cotangent)
  want = _value_and_grads("reference", activation)(x, w_in, w_out, sizes, cotangent)
  for g, w, what in zip(got, want, ("y", "dx", "dw_in", "dw_out")):
    _assert_close(g, w, jnp.float32, what)


def test_kernel_activation_matches_jax_nn_at_large_inputs():
  # Saturated GELU tails and SwiGLU gates (exp overflow in the sigmoid).
  x = jnp.asarray(np.linspace(-30.0, 30.0, 16 * 16, dtype=np.float32).reshape(16, 16))
  eye = np.eye(16, dtype=np.float32)[None].repeat(2, axis=0)
  w_in = jnp.asarray(eye)
  sizes = jnp.asarray(np.array([10, 6], np.int32))
  cotangent = _normal(np.random.default_rng(0), 16, 16)

  @functools.partial(jax.jit, static_argnums=(0, 1))
  def values_and_grads(fn, activation, w_in_act):
    y, vjp = jax.vjp(lambda x: fn(x, w_in_act, w_in, sizes, activation=activation), x)
    return (y, *vjp(cotangent))
  for activation, w_in_act in (("gelu", w_in), ("swiglu", jnp.asarray(np.concatenate(
      [eye, np.ones_like(eye) / 16], axis=2)))):
    got, want = (values_and_grads(fn, activation, w_in_act)
                 for fn in (_small_blocks, grouped_mlp_reference))
    for g, w, what in zip(got, want, ("y", "dx")):
      assert np.isfinite(np.asarray(g)).all(), (activation, what)
      _assert_close(g, w, jnp.float32, f"{activation} {what}")


def test_vmap_over_batches_of_groupings():
  rng = np.random.default_rng(0)
  x = _normal(rng, 3, 40, 16)
  w_in = _normal(rng, 3, G, 16, 32, scale=1 / 4)
  w_out = _normal(rng, 3, G, 16, 16, scale=1 / 4)
  sizes = jnp.asarray(np.array([[10, 0, 20, 10], [40, 0, 0, 0], [1, 2, 3, 4]], np.int32))

  def loss(fn):
    return lambda *a: jnp.sum(jnp.sin(jax.vmap(fn)(*a, sizes)))
  fn = functools.partial(ops.grouped_mlp, activation="swiglu", implementation="pallas")
  ref = functools.partial(grouped_mlp_reference, activation="swiglu")
  got = jax.jit(jax.value_and_grad(loss(fn), argnums=(0, 1, 2)))(x, w_in, w_out)
  want = jax.jit(jax.value_and_grad(loss(ref), argnums=(0, 1, 2)))(x, w_in, w_out)
  jax.tree.map(lambda g, w: _assert_close(g, w, jnp.float32), got, want)


def test_default_implementation_on_cpu_is_ragged_dot():
  x, w_in, w_out, _ = _inputs("gelu", jnp.float32, jnp.float32)
  sizes = jnp.asarray([10, 20, 30, 10])
  jaxpr = str(jax.make_jaxpr(ops.grouped_mlp)(x, w_in, w_out, sizes))
  assert "ragged_dot" in jaxpr and "pallas_call" not in jaxpr
  jaxpr = str(jax.make_jaxpr(functools.partial(ops.grouped_mlp, implementation="pallas"))(
      x, w_in, w_out, sizes))
  assert jaxpr.count("pallas_call") == 2  # the fused first matmul, then gmm
  jaxpr = str(jax.make_jaxpr(functools.partial(ops.grouped_mlp, implementation="triton"))(
      x, w_in, w_out, sizes))
  assert jaxpr.count("pallas_call") == 2
  with pytest.raises(ValueError, match=r"implementation='mosaic'\): .*Hopper GPU"):
    ops.grouped_mlp(x, w_in, w_out, sizes, implementation="mosaic")


@pytest.mark.parametrize("change, match", [
    (dict(x=jnp.zeros((M,))), "`x` must be"),
    (dict(w_in=jnp.zeros((D, F))), "`w_in` and `w_out` must be"),
    (dict(w_in=jnp.zeros((G, D + 1, F))), "D = 40 columns"),
    (dict(w_out=jnp.zeros((G + 1, F, D_OUT))), "same number of groups"),
    (dict(w_in=jnp.zeros((G, D, F + 1))), "needs Fi = 20"),
    (dict(activation="swiglu"), "needs Fi = 40"),
    (dict(activation="relu"), "`activation` must be"),
    (dict(x=jnp.zeros((M, D), jnp.float16)), "`x` must be float32 or bfloat16"),
    (dict(x=jnp.zeros((M, D), jnp.bfloat16), w_out=jnp.zeros((G, F, D_OUT), jnp.float16)),
     "`w_out` must be float32 or x's dtype"),
    (dict(sizes=[1] * (G + 1)), "`group_sizes` must be"),
    (dict(sizes=[40, 40, 0, 0]), "more than"),
    (dict(sizes=[-1, 2, 0, 0]), "non-negative"),
])
def test_bad_arguments_raise(change, match):
  args = dict(x=jnp.zeros((M, D)), w_in=jnp.zeros((G, D, F)),
              w_out=jnp.zeros((G, F, D_OUT)), sizes=[1] * G, activation="gelu")
  args.update(change)
  with pytest.raises(ValueError, match=match):
    ops.grouped_mlp(args["x"], args["w_in"], args["w_out"],
                    jnp.asarray(args["sizes"], jnp.int32), activation=args["activation"],
                    implementation="xla")
