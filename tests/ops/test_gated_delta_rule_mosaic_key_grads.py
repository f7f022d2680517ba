"""ops.gated_delta_rule's Mosaic GPU key gradients (mosaic_key_grads.py):
against the Triton key-gradient kernel in Mosaic GPU interpret mode, with the
value-gradient kernel's [2L, 2L] blocks, inside the op (every gradient against
the reference), its lowering for Hopper, and its limits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.gated_delta_rule import configs as gdr_configs
from ops.gated_delta_rule import mosaic_key_grads
from ops.gated_delta_rule import pallas as gdr_pallas
from ops.gated_delta_rule import triton as gdr_triton
from tests.ops.test_gated_delta_rule_mosaic import assert_op_matches_reference
from tests.ops.test_gated_delta_rule_mosaic import lowered_gradient

_SIZE = 128  # the kernel's K = V


def _inputs(batch, time, heads, groups, chunk, seed):
  """Random operands of the key-gradient step, rounded as the op stores them:
  the adjoints dS~ (lower triangular) and dA~ (strictly lower) [B, N, T, L]."""
  ks = jax.random.split(jax.random.key(seed), 11)
  bf16 = lambda x: x.astype(jnp.bfloat16)
  rows = lambda key, n, s=1.0: bf16(s * jax.random.normal(key, (batch, time, n, _SIZE)))
  q, k = rows(ks[0], groups, _SIZE ** -0.5), rows(ks[1], groups, _SIZE ** -0.5)
  u, du, dy = rows(ks[2], heads), rows(ks[3], heads), rows(ks[4], heads)
  chunks = (batch, heads, time // chunk)
  b = jnp.cumsum(-0.2 * jax.random.uniform(ks[5], chunks + (chunk,)), -1)
  beta = jax.random.uniform(ks[6], (batch, heads, time))
  squares = chunks + (chunk, chunk)
  # T^T: T is unit lower triangular, so T^T unit upper.
  tt = bf16(jnp.eye(chunk) + 0.3 * jnp.triu(jax.random.normal(ks[3], squares), 1))
  dsd = bf16(jnp.tril(jax.random.normal(ks[7], squares)))
  dkk = bf16(jnp.tril(jax.random.normal(ks[8], squares), -1))
  states = chunks + (_SIZE, _SIZE)
  m0 = bf16(jax.random.normal(ks[9], states))
  dm1 = bf16(jax.random.normal(ks[10], states))
  return q, k, u, du, tt, dy, b.reshape(batch, heads, time), beta, dsd, dkk, m0, dm1


def _t_transposed_times(tt, du, chunk):
  """T^T dU [B, T, N, V] per chunk, rounded to bf16 (as the value-gradient
  kernel stores it for the Triton key gradients)."""
  batch, time, heads, value = du.shape
  duc = du.astype(jnp.float32).reshape(batch, time // chunk, chunk, heads, value)
  dru = jnp.einsum("bncij,bcjnv->bcinv", tt.astype(jnp.float32), duc)
  return dru.reshape(du.shape).astype(du.dtype)


def _pairs(dsd, dkk):
  """[[0, dS~], [dS~^T, dA~ + dA~^T]] per chunk, as the value-gradient kernel
  writes it."""
  f32 = lambda x: x.astype(jnp.float32)
  t = lambda x: jnp.swapaxes(x, -1, -2)
  top = jnp.concatenate([jnp.zeros_like(f32(dsd)), f32(dsd)], -1)
  below = jnp.concatenate([t(f32(dsd)), f32(dkk) + t(f32(dkk))], -1)
  return jnp.concatenate([top, below], -2).astype(dsd.dtype)


@pytest.mark.parametrize("chunk, heads, groups, splits, slots", [
    (32, 2, 2, 2, 2),   # bf16 outputs, two runs of chunks per head
    (16, 2, 1, 2, 2),   # chunks of 16 (padding rows), heads sharing keys: f32
])
def test_matches_the_triton_key_gradients(chunk, heads, groups, splits, slots):
  """dQ, dK and the d log-decay and d beta shares, against the Triton kernel
  on the same operands (the same bf16 products; the sums differ in order)."""
  time = 3 * splits * chunk
  q, k, u, du, tt, dy, b, beta, dsd, dkk, m0, dm1 = _inputs(1, time, heads, groups, chunk,
                                                             seed=chunk + heads)
  dru = _t_transposed_times(tt, du, chunk)
  blocks = gdr_configs.TritonConfig(chunk=chunk, block_v=64, grad_block_k=_SIZE)
  flat = lambda x: x.reshape(x.shape[:2] + (time, chunk))
  want = gdr_triton.key_grads(q, k, u, dru, dy, b, beta, flat(dsd), flat(dkk), m0, dm1,
                              0.25, blocks)
  flat_tt = tt.reshape(tt.shape[:2] + (time, chunk))
  got = mosaic_key_grads.key_grads(q, k, u, du, flat_tt, dy, b, beta, _pairs(dsd, dkk), m0,
                                   dm1, chunk=chunk, scale=0.25, splits=splits, slots=slots,
                                   interpret=True)
  for name, x, y in zip(("dq", "dk", "db", "dbeta"), got, want):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.abs(x - y).max() <= 2e-3 * np.abs(y).max(), name


def test_op_with_the_mosaic_key_gradients_matches_reference():
  """The whole op's gradients with the Mosaic key gradients forced on (and the
  Triton walks)."""
  assert_op_matches_reference(seed=3, check_outputs=False, mosaic_key_grads=True)


def test_lowers_to_mosaic_gpu_for_hopper(hopper_lowering):
  """Mosaic GPU's checks (TMA boxes, swizzles, wgmma shapes) without a GPU,
  inside the op's gradient, heads sharing keys and not."""
  del hopper_lowering
  for groups in (4, 2):
    text = lowered_gradient(groups, mosaic_walk=True, mosaic_key_grads=True)
    assert "gated_delta_key_grads_mosaic" in text


def test_outside_its_limits_raises():
  blocks = gdr_configs.TritonConfig(chunk=32, mosaic_key_grads=True)
  x = jnp.zeros((1, 32, 1, 64), jnp.bfloat16)
  g = jnp.zeros((1, 32, 1), jnp.float32)
  with pytest.raises(ValueError, match="blocks.mosaic_key_grads.*K = V = 128"):
    gdr_pallas.gated_delta_rule_pallas(x, x, x, g, g, blocks=blocks)
  q = jnp.zeros((1, 64, 1, _SIZE), jnp.bfloat16)
  with pytest.raises(ValueError, match="`splits` 3 must divide the 2 chunks"):
    mosaic_key_grads.key_grads(q, q, q, q, None, q, g, g, None, None, None, chunk=32,
                               scale=1.0, splits=3)
  with pytest.raises(ValueError, match="`slots` 3 needs .* bytes of shared memory"):
    mosaic_key_grads.key_grads(q, q, q, q, None, q, g, g, None, None, None, chunk=32,
                               scale=1.0, slots=3)
