"""UNet: shapes, conditioning, remat, dtypes, attention dispatch, train step, errors.

Compilation dominates on a CPU, so shape checks run under `jax.eval_shape`,
inputs come from NumPy and parameters are drawn on the host
(tests/models/random_params.py), a test's several cases run in one compiled
program, and the compiled functions are shared through module-scoped fixtures.
"""

import inspect

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import probjax_hk as pk
from probjax_hk import unet as unet_lib
from tests.models.random_params import random_params

B, C_IN, D_C = 2, 3, 5
SMALL = dict(norm_groups=4, num_heads=2)


def _transform(context=False, **kwargs):
  kwargs = {**SMALL, "num_res_blocks": 1, **kwargs}
  channels = kwargs.pop("channels", (8, 16))
  if context:
    return hk.transform(lambda x, t, c: pk.UNet(C_IN, channels, context_dim=D_C, **kwargs)(
        x, t, c))
  return hk.transform(lambda x, t: pk.UNet(C_IN, channels, **kwargs)(x, t))


def _inputs(size=8, dtype=np.float32, seed=0, channels=C_IN):
  """x [B, H, W, C], t [B] and context [B, D_C], as NumPy arrays."""
  rng = np.random.default_rng(seed)
  height, width = (size, size) if isinstance(size, int) else size
  return (rng.normal(size=(B, height, width, channels)).astype(dtype),
          rng.uniform(0, 1000, size=(B,)).astype(np.float32),
          rng.normal(size=(B, D_C)).astype(np.float32))


@pytest.fixture(scope="module")
def context_model():
  """(model, params, jitted apply) of a context-conditioned 2-level UNet."""
  model = _transform(context=True)
  params = random_params(model, *_inputs())
  return model, params, jax.jit(model.apply)


# --- shapes (traced, not compiled) -------------------------------------------


@pytest.mark.parametrize("size, channels, kwargs", [
    (8, (8, 16), {}),
    (16, (8, 16, 16), {}),
    ((8, 16), (8, 16), {"out_channels": 5}),
    (16, (8, 16, 16), {"attention_levels": (0, 2), "num_res_blocks": 2}),
    (4, (8,), {"attention_levels": ()}),
])
def test_output_shapes(size, channels, kwargs):
  model = _transform(channels=channels, **kwargs)
  x, t, _ = _inputs(size)
  params = jax.eval_shape(model.init, jax.random.key(0), x, t)
  y = jax.eval_shape(model.apply, params, None, x, t)
  assert y.shape == x.shape[:-1] + (kwargs.get("out_channels", C_IN),)
  assert y.dtype == x.dtype
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  attention_modules = {m for m in params if "attention" in m}
  levels = kwargs.get("attention_levels", (len(channels) - 1,))
  if not levels:
    assert not attention_modules


def test_parameter_names_and_counts():
  model = _transform(channels=(8, 16), num_res_blocks=2)
  x, t, _ = _inputs()
  params = jax.eval_shape(model.init, jax.random.key(0), x, t)
  res_blocks = sorted({m.split("/")[1] for m in params if "_res_" in m})
  # 2 per level down, 2 middle, 3 per level up.
  assert len(res_blocks) == 2 * 2 + 2 + 3 * 2, res_blocks
  attention_blocks = sorted({m.split("/")[1] for m in params
                             if "attention" in m.split("/")[1]})
  assert attention_blocks == ["down_1_attention_0", "down_1_attention_1", "middle_attention",
                              "up_1_attention_0", "up_1_attention_1", "up_1_attention_2"]
  assert params["unet/conv_in"]["w"].shape == (3, 3, C_IN, 8)
  assert params["unet/down_0_downsample"]["w"].shape == (3, 3, 8, 8)
  # The first up block at level 0 sees level 1's 16 upsampled channels plus an
  # 8-channel skip.
  assert params["unet/up_0_res_0/norm_1"]["scale"].shape == (24,)
  assert params["unet/up_0_res_0/skip"]["w"].shape == (1, 1, 24, 8)


# --- conditioning, dtypes, remat ---------------------------------------------


def test_time_and_context_change_the_output(context_model):
  _, params, apply = context_model
  x, t, c = _inputs()
  y = np.asarray(apply(params, None, x, t, c))
  assert np.all(np.isfinite(y))
  y_t = apply(params, None, x, t + 250.0, c)
  y_c = apply(params, None, x, t, c + 1.0)
  for other in (y_t, y_c):
    assert np.max(np.abs(other - y)) > 1e-2
  # Each example's output depends on its own time only.
  t_first = t.copy()
  t_first[1] += 250.0
  y_first = apply(params, None, x, t_first, c)
  np.testing.assert_allclose(y_first[0], y[0], rtol=1e-5, atol=1e-5)


def test_bf16_in_bf16_out_with_f32_params(context_model):
  _, params, apply = context_model
  x, t, c = _inputs()
  y32 = apply(params, None, x, t, c)
  y16 = apply(params, None, x.astype(jnp.bfloat16), t, c)
  assert y16.dtype == jnp.bfloat16
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  scale = np.max(np.abs(y32))
  assert np.max(np.abs(np.asarray(y16, np.float32) - y32)) < 0.1 * scale


def test_remat_equals_no_remat_and_every_parameter_gets_a_gradient():
  model, remat = _transform(), _transform(remat_policy="full")
  x, t, _ = _inputs()
  params = random_params(model, x, t)
  chex.assert_trees_all_equal_shapes(
      params, jax.eval_shape(remat.init, jax.random.key(0), x, t))

  @jax.jit  # One compiled program for both models.
  def losses_and_grads(p, x, t):
    return [jax.value_and_grad(lambda p: jnp.mean(jnp.square(
        m.apply(p, None, x, t).astype(jnp.float32))))(p) for m in (model, remat)]

  (loss_p, grad_p), (loss_r, grad_r) = losses_and_grads(params, x, t)
  chex.assert_trees_all_close(loss_r, loss_p, rtol=1e-6)
  chex.assert_trees_all_close(grad_r, grad_p, atol=1e-6, rtol=1e-5)
  # jit + grad reach every parameter.
  for name, leaves in grad_p.items():
    for leaf_name, g in leaves.items():
      g = np.asarray(g)
      assert np.all(np.isfinite(g)), (name, leaf_name)
      assert np.max(np.abs(g)) > 0, (name, leaf_name)


def test_remat_wraps_blocks_in_checkpoints():
  x, t, _ = _inputs()
  def count(m):
    text = str(jax.make_jaxpr(lambda p: m.apply(p, None, x, t))(
        jax.eval_shape(m.init, jax.random.key(0), x, t)))
    return text.count("remat2[") + text.count("checkpoint[")
  assert count(_transform()) == 0
  # 1 + 1 down, 2 middle, 2 + 2 up residual blocks; 3 attention blocks at level 1.
  assert count(_transform(remat_policy="dots_saveable")) == 8 + 4


def test_dropout_only_when_training_with_an_rng():
  def unet(x, t, is_training=False):
    return pk.UNet(C_IN, (8,), attention_levels=(), num_res_blocks=1, dropout_rate=0.5,
                   **SMALL)(x, t, is_training=is_training)

  model = hk.transform(unet)
  x, t, _ = _inputs(4)
  params = random_params(model, x, t)

  @jax.jit  # One compiled program for the five cases.
  def outputs(p):
    key_a, key_b = jax.random.key(0), jax.random.key(1)
    return (model.apply(p, None, x, t), model.apply(p, key_a, x, t),
            model.apply(p, None, x, t, is_training=True),
            model.apply(p, key_a, x, t, is_training=True),
            model.apply(p, key_b, x, t, is_training=True))

  y_eval, y_eval_rng, y_train_no_rng, y_a, y_b = outputs(params)
  np.testing.assert_array_equal(y_eval_rng, y_eval)
  np.testing.assert_array_equal(y_train_no_rng, y_eval)
  assert np.max(np.abs(y_a - y_eval)) > 1e-3
  assert np.max(np.abs(y_a - y_b)) > 1e-3


# --- attention dispatch ------------------------------------------------------


def test_attention_blocks_use_the_dispatching_attention():
  assert inspect.signature(pk.UNet).parameters["attention_fn"].default is (
      pk.dot_product_attention)
  seen = []

  def recording_attention(q, k, v, *args, **kwargs):
    seen.append((q.shape, pk.choose_attention_implementation(
        q, k, v, is_causal=kwargs.get("is_causal", False))))
    return pk.dot_product_attention(q, k, v, *args, **kwargs)

  model = _transform(channels=(8, 16, 16), attention_fn=recording_attention)
  x, t, _ = _inputs(16)
  params = jax.eval_shape(model.init, jax.random.key(0), x, t)
  seen.clear()
  jax.eval_shape(model.apply, params, None, x, t)
  # Lowest level (2) of 16x16: 4x4 = 16 positions, 2 heads of 16 // 2; one
  # block down, one in the middle, two up.
  assert seen == [((B, 16, 2, 8), "xla")] * 4


# --- building blocks ----------------------------------------------------------


def _conv_reference(x, w, b, stride):
  """Direct sum over kernel offsets of a zero-padded input (numpy)."""
  k = w.shape[0]
  pad = k // 2
  xp = np.pad(np.asarray(x, np.float64), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  height, width = x.shape[1], x.shape[2]
  out_h, out_w = -(-height // stride), -(-width // stride)
  out = np.zeros((x.shape[0], out_h, out_w, w.shape[-1]))
  for i in range(out_h):
    for j in range(out_w):
      patch = xp[:, i * stride:i * stride + k, j * stride:j * stride + k, :]
      out[:, i, j] = np.einsum("bhwc,hwco->bo", patch, np.asarray(w, np.float64))
  return out + np.asarray(b)


@pytest.mark.parametrize("kernel_size, stride", [(3, 1), (3, 2), (1, 1)])
def test_conv2d_matches_direct_sum(kernel_size, stride):
  conv = hk.transform(lambda x: unet_lib.Conv2D(4, kernel_size, stride=stride)(x))
  x = np.random.default_rng(0).normal(size=(2, 6, 8, 3)).astype(np.float32)
  params = random_params(conv, x)
  params = {"conv2_d": {"w": params["conv2_d"]["w"], "b": np.arange(4.0, dtype=np.float32)}}
  apply = jax.jit(conv.apply)
  y = apply(params, None, x)
  np.testing.assert_allclose(y, _conv_reference(x, params["conv2_d"]["w"],
                                                params["conv2_d"]["b"], stride),
                             rtol=1e-5, atol=1e-5)
  y16 = apply(params, None, x.astype(jnp.bfloat16))
  assert y16.dtype == jnp.bfloat16
  assert params["conv2_d"]["w"].dtype == jnp.float32


def test_group_norm_matches_numpy():
  norm = hk.transform(lambda x: unet_lib.GroupNorm(2)(x))
  x = (np.random.default_rng(0).normal(size=(2, 3, 5, 6)) * 3 + 1).astype(np.float32)
  params = {"group_norm": {"scale": np.linspace(0.5, 1.5, 6, dtype=np.float32),
                           "offset": np.arange(6.0, dtype=np.float32)}}
  apply = jax.jit(norm.apply)
  y = apply(params, None, x)
  xn = np.asarray(x, np.float64).reshape(2, 3, 5, 2, 3)
  mean = xn.mean(axis=(1, 2, 4), keepdims=True)
  var = xn.var(axis=(1, 2, 4), keepdims=True)
  expected = ((xn - mean) / np.sqrt(var + 1e-5)).reshape(x.shape)
  expected = expected * np.asarray(params["group_norm"]["scale"]) + np.arange(6.0)
  np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
  y16 = apply(params, None, x.astype(jnp.bfloat16))
  assert y16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y16, np.float32), expected, rtol=0.05, atol=0.05)


def test_upsample_nearest():
  x = np.arange(2 * 2 * 3 * 2.0, dtype=np.float32).reshape(2, 2, 3, 2)
  y = unet_lib.upsample_nearest(x)
  np.testing.assert_array_equal(y, np.repeat(np.repeat(x, 2, axis=1), 2, axis=2))


# --- train step ---------------------------------------------------------------


def test_train_step_donates_and_trains():
  model = hk.transform(lambda x, t: pk.UNet(
      1, (4,), num_res_blocks=1, attention_levels=(), norm_groups=2)(x, t))
  x0 = np.random.default_rng(0).normal(size=(2, 4, 4, 1)).astype(np.float32)
  params = random_params(model, x0, np.zeros((2,), np.float32))
  optimizer = optax.adam(1e-2)
  opt_state = jax.jit(optimizer.init)(params)
  num_buffers = len(jax.tree.leaves((params, opt_state)))
  args = (params, opt_state, jax.random.key(1), x0)
  steps = {donate: unet_lib.make_train_step(model, optimizer, donate=donate)
           for donate in (True, False)}
  for donate, step in steps.items():
    # Donation is a property of the lowered program (CPU runtimes may still
    # copy); every parameter and optimizer-state buffer is marked.
    text = step.lower(*args).as_text()
    donated = text.count("tf.aliasing_output") + text.count("jax.buffer_donor")
    assert donated == (num_buffers if donate else 0), (donate, donated, num_buffers)
  # The same batch, t and noise at every step: the loss falls.
  step = steps[False]
  losses = []
  for _ in range(5):
    params, opt_state, loss = step(params, opt_state, jax.random.key(1), x0)
    losses.append(float(loss))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


# --- errors -------------------------------------------------------------------


@pytest.mark.parametrize("size, channels, message", [
    ((30, 32), (8, 16, 16), "height 30 must be a multiple of 4"),
    ((32, 30), (8, 16, 16), "width 30 must be a multiple of 4"),
    ((12, 12), (8, 16, 16, 16), "height 12 must be a multiple of 8"),
])
def test_sizes_the_levels_cannot_halve_raise(size, channels, message):
  model = _transform(channels=channels)
  x, t, _ = _inputs(size)
  with pytest.raises(ValueError, match=message):
    model.init(jax.random.key(0), x, t)


@pytest.mark.parametrize("kwargs, argument", [
    ({"channels": (8, 12), "norm_groups": 8}, "norm_groups"),
    ({"channels": (8, 16), "norm_groups": 3}, "norm_groups"),
    ({"attention_levels": (2,)}, "attention_levels"),
    ({"num_heads": 3}, "num_heads"),
    ({"remat_policy": "sometimes"}, "remat_policy"),
    ({"num_res_blocks": 0}, "num_res_blocks"),
    ({"dropout_rate": 1.0}, "dropout_rate"),
])
def test_bad_arguments_raise(kwargs, argument):
  model = _transform(**kwargs)
  x, t, _ = _inputs()
  with pytest.raises(ValueError, match=argument):
    model.init(jax.random.key(0), x, t)


def test_bad_inputs_raise():
  x, t, c = _inputs()
  with pytest.raises(ValueError, match="C_in=3"):
    _transform().init(jax.random.key(0), x[..., :2], t)
  with pytest.raises(ValueError, match="`t` must be"):
    _transform().init(jax.random.key(0), x, t[:1])
  with pytest.raises(ValueError, match="context_dim=None"):
    hk.transform(lambda x, t, c: pk.UNet(C_IN, (8, 16), **SMALL)(x, t, c)).init(
        jax.random.key(0), x, t, c)
  with pytest.raises(ValueError, match="`context` must be"):
    _transform(context=True).init(jax.random.key(0), x, t, c[:, :2])
