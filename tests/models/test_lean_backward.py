"""The norms and GELU whose backward keeps only their inputs
(`probjax_hk/lean_backward.py`): values and gradients equal autodiff of the
plain formulas, what they keep for the backward, forward mode."""

import jax
from jax import lax
from jax._src.ad_checkpoint import saved_residuals
import jax.numpy as jnp
import numpy as np
import pytest

from probjax_hk import lean_backward

_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _plain_layer_norm(x, scale, offset, eps):
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  y = (xf - mean) * lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True) + eps)
  y = y if scale is None else y * scale
  y = y if offset is None else y + offset
  return y.astype(x.dtype)


def _plain_rms_norm(x, scale, eps):
  xf = x.astype(jnp.float32)
  y = xf * lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
  return (y if scale is None else y * scale).astype(x.dtype)


def _inputs(dtype, shape=(2, 5, 24)):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  x = (3.0 * jax.random.normal(keys[0], shape) + 1.0).astype(dtype)
  scale = 1.0 + 0.1 * jax.random.normal(keys[1], shape[-1:])
  offset = 0.1 * jax.random.normal(keys[2], shape[-1:])
  w = jax.random.normal(keys[3], shape)  # output cotangent
  return x, scale, offset, w


def _assert_close(got, want, dtype, name):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
  assert err < _TOL[dtype], (name, err)


def _check(fn, plain, args, dtype):
  """Values and the gradients of every array argument against `plain`."""
  x, w = args[0], args[-1]
  arrays = [i for i, a in enumerate(args[:-1]) if a is not None]
  def loss(f, *a):
    return jnp.sum(f(*a).astype(jnp.float32) * w)
  got = fn(*args[:-1])
  assert got.dtype == x.dtype and got.shape == x.shape
  _assert_close(got, plain(*args[:-1]), dtype, "value")
  grads = jax.grad(lambda *a: loss(fn, *a), argnums=arrays)(*args[:-1])
  grads_plain = jax.grad(lambda *a: loss(plain, *a), argnums=arrays)(*args[:-1])
  for i, g, g_plain in zip(arrays, grads, grads_plain):
    assert g.dtype == args[i].dtype, i
    _assert_close(g, g_plain, dtype, f"grad {i}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_scale, with_offset", [(True, True), (False, False),
                                                     (True, False)])
def test_layer_norm_matches_autodiff(dtype, with_scale, with_offset):
  x, scale, offset, w = _inputs(dtype)
  scale = scale if with_scale else None
  offset = offset if with_offset else None
  _check(lambda x, s, o: lean_backward.layer_norm(x, s, o, 1e-6),
         lambda x, s, o: _plain_layer_norm(x, s, o, 1e-6), (x, scale, offset, w), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_scale", [True, False])
def test_rms_norm_matches_autodiff(dtype, with_scale):
  x, scale, _, w = _inputs(dtype)
  scale = scale if with_scale else None
  _check(lambda x, s: lean_backward.rms_norm(x, s, 1e-6),
         lambda x, s: _plain_rms_norm(x, s, 1e-6), (x, scale, w), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gelu_matches_autodiff(dtype):
  x, _, _, w = _inputs(dtype)
  _check(lean_backward.gelu, lambda x: jax.nn.gelu(x, approximate=True), (x, w), dtype)


def test_backward_keeps_only_inputs_and_row_statistics():
  """bf16 [B, T, D] in: no float32 [B, T, D] residual, and at most the input
  plus [B, T, 1] statistics (autodiff of the plain layer norm keeps three
  float32 [B, T, D] arrays)."""
  x, scale, offset, _ = _inputs(jnp.bfloat16, (2, 64, 128))
  def residuals(fn):
    res = saved_residuals(lambda x, s, o: jnp.sum(fn(x, s, o).astype(jnp.float32)),
                          x, scale, offset)
    return [(aval.shape, aval.dtype) for aval, _ in res]
  for shape, dtype in residuals(lambda x, s, o: lean_backward.layer_norm(x, s, o, 1e-6)):
    assert not (shape == x.shape and dtype == jnp.float32), (shape, dtype)
  plain = residuals(lambda x, s, o: _plain_layer_norm(x, s, o, 1e-6))
  assert sum(shape == x.shape and dtype == jnp.float32 for shape, dtype in plain) >= 2
  for shape, dtype in residuals(lambda x, s, o: lean_backward.gelu(x)):
    assert not (shape == x.shape and dtype == jnp.float32), (shape, dtype)


def test_forward_mode():
  """Rematerialization, not a custom VJP: jax.jvp works through them (e.g. a
  consistency model's JVP through a DiffusionTransformer)."""
  x, scale, offset, _ = _inputs(jnp.float32)
  tangent = jnp.ones_like(x)
  for fn, plain in [
      (lambda x: lean_backward.layer_norm(x, scale, offset, 1e-6),
       lambda x: _plain_layer_norm(x, scale, offset, 1e-6)),
      (lambda x: lean_backward.rms_norm(x, scale, 1e-6),
       lambda x: _plain_rms_norm(x, scale, 1e-6)),
      (lean_backward.gelu, lambda x: jax.nn.gelu(x, approximate=True))]:
    _, got = jax.jvp(fn, (x,), (tangent,))
    _, want = jax.jvp(plain, (x,), (tangent,))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_vmap_and_jit():
  x, scale, offset, w = _inputs(jnp.float32)
  fn = lambda x: jnp.sum(lean_backward.layer_norm(x, scale, offset, 1e-6) * w[0])
  batched = jax.jit(jax.vmap(jax.grad(fn)))(x)
  for i in range(x.shape[0]):
    np.testing.assert_allclose(batched[i], jax.grad(fn)(x[i]), rtol=1e-5, atol=1e-6)
