"""ops.gated_delta_rule's Mosaic GPU key gradients (mosaic_key_grads.py):
against the Triton key-gradient kernel in Mosaic GPU interpret mode, with the
value-gradient kernel's [2L, 2L] blocks, inside the op (every gradient against
the reference), its lowering for Hopper, and its limits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.gated_delta_rule import gated_delta_rule_reference
from ops.gated_delta_rule import mosaic_key_grads
from ops.gated_delta_rule import pallas as gdr_pallas

_SIZE = 128  # the kernel's K = V


def _inputs(batch, time, heads, groups, chunk, seed):
  """Random operands of the key-gradient step, rounded as the op stores them:
  the adjoints dS~ (lower triangular) and dA~ (strictly lower) [B, N, T, L]."""
  ks = jax.random.split(jax.random.key(seed), 11)
  bf16 = lambda x: x.astype(jnp.bfloat16)
  rows = lambda key, n, s=1.0: bf16(s * jax.random.normal(key, (batch, time, n, _SIZE)))
  q, k = rows(ks[0], groups, _SIZE ** -0.5), rows(ks[1], groups, _SIZE ** -0.5)
  u, dru, dy = rows(ks[2], heads), rows(ks[3], heads), rows(ks[4], heads)
  chunks = (batch, heads, time // chunk)
  b = jnp.cumsum(-0.2 * jax.random.uniform(ks[5], chunks + (chunk,)), -1)
  beta = jax.random.uniform(ks[6], (batch, heads, time))
  squares = chunks + (chunk, chunk)
  dsd = bf16(jnp.tril(jax.random.normal(ks[7], squares)))
  dkk = bf16(jnp.tril(jax.random.normal(ks[8], squares), -1))
  states = chunks + (_SIZE, _SIZE)
  m0 = bf16(jax.random.normal(ks[9], states))
  dm1 = bf16(jax.random.normal(ks[10], states))
  return q, k, u, dru, dy, b.reshape(batch, heads, time), beta, dsd, dkk, m0, dm1


def _pairs(dsd, dkk):
  """[[0, dS~], [dS~^T, dA~ + dA~^T]] per chunk, as the value-gradient kernel
  writes it."""
  f32 = lambda x: x.astype(jnp.float32)
  t = lambda x: jnp.swapaxes(x, -1, -2)
  top = jnp.concatenate([jnp.zeros_like(f32(dsd)), f32(dsd)], -1)
  below = jnp.concatenate([t(f32(dsd)), f32(dkk) + t(f32(dkk))], -1)
  return jnp.concatenate([top, below], -2).astype(dsd.dtype)


@pytest.mark.parametrize("chunk, heads, groups, splits, slots", [
    (32, 2, 2, 2, 3),   # bf16 outputs, two runs of chunks per head
    (16, 2, 1, 2, 2),   # chunks of 16 (padding rows), heads sharing keys: f32
    (32, 4, 2, 3, 2),   # three runs, a ring of two units
])
def test_matches_the_triton_key_gradients(chunk, heads, groups, splits, slots):
  """dQ, dK and the d log-decay and d beta shares, against the Triton kernel
  on the same operands (the same bf16 products; the sums differ in order)."""
  time = 3 * splits * chunk
  q, k, u, dru, dy, b, beta, dsd, dkk, m0, dm1 = _inputs(1, time, heads, groups, chunk,
                                                          seed=chunk + heads)
  blocks = gdr_pallas.GatedDeltaBlocks(chunk=chunk, block_v=64, grad_block_k=_SIZE)
  flat = lambda x: x.reshape(x.shape[:2] + (time, chunk))
  want = gdr_pallas._key_grads(q, k, u, dru, dy, b, beta, flat(dsd), flat(dkk), m0, dm1,
                               0.25, blocks)
  got = mosaic_key_grads.key_grads(q, k, u, dru, dy, b, beta, _pairs(dsd, dkk), m0, dm1,
                                   chunk=chunk, scale=0.25, splits=splits, slots=slots,
                                   interpret=True)
  for name, x, y in zip(("dq", "dk", "db", "dbeta"), got, want):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.abs(x - y).max() <= 2e-3 * np.abs(y).max(), name


def test_op_with_the_mosaic_key_gradients_matches_reference():
  """The whole op's gradients with the Mosaic key gradients forced on (and the
  Triton walks): T 70 pads to three chunks, V 100 to 128, two heads."""
  ks = jax.random.split(jax.random.key(3), 6)
  shape = (1, 70, 2)
  q = jax.random.normal(ks[0], shape + (_SIZE,))
  k = jax.random.normal(ks[1], shape + (_SIZE,))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(ks[2], shape + (100,))
  g = -jax.nn.softplus(jax.random.normal(ks[3], shape) - 1.0)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], shape))
  h0 = jax.random.normal(ks[5], (1, 2, _SIZE, 100))
  args = tuple(x.astype(jnp.bfloat16) for x in (q, k, v)) + (g, beta, h0)
  blocks = dataclasses.replace(gdr_pallas.GatedDeltaBlocks.get_default(70, _SIZE, _SIZE),
                               mosaic_key_grads=True)
  kernel = lambda *a: gdr_pallas.gated_delta_rule_pallas(*a[:5], initial_state=a[5],
                                                         blocks=blocks)
  reference = lambda *a: gated_delta_rule_reference(*a[:5], initial_state=a[5])
  loss = lambda fn: lambda *a: sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in fn(*a))
  rel = lambda x, ref: (np.abs(np.asarray(x, np.float32) - np.asarray(ref, np.float32)).max()
                        / max(1.0, np.abs(np.asarray(ref, np.float32)).max()))
  grads = jax.jit(jax.grad(loss(kernel), argnums=range(6)))(*args)
  for a, b in zip(grads, jax.grad(loss(reference), argnums=range(6))(*args)):
    assert a.shape == b.shape and rel(a, b) < 6e-2


def test_lowers_to_mosaic_gpu_for_hopper(hopper_lowering):
  """Mosaic GPU's checks (TMA boxes, swizzles, wgmma shapes) without a GPU,
  inside the op's gradient, heads sharing keys and not."""
  del hopper_lowering
  blocks = gdr_pallas.GatedDeltaBlocks.get_default(256, _SIZE, _SIZE)
  blocks = dataclasses.replace(blocks, mosaic_walk=True, mosaic_key_grads=True)
  def loss(q, k, v, g, beta):
    y, final = gdr_pallas.gated_delta_rule_pallas(q, k, v, g, beta, blocks=blocks)
    return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)
  spec = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
  for groups in (4, 2):
    specs = (spec(2, 256, groups, _SIZE), spec(2, 256, groups, _SIZE), spec(2, 256, 4, _SIZE),
             spec(2, 256, 4, dtype=jnp.float32), spec(2, 256, 4, dtype=jnp.float32))
    text = jax.jit(jax.grad(loss, argnums=range(5))).trace(*specs).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "gated_delta_key_grads_mosaic" in text


def test_outside_its_limits_raises():
  blocks = gdr_pallas.GatedDeltaBlocks(chunk=32, mosaic_key_grads=True)
  x = jnp.zeros((1, 32, 1, 64), jnp.bfloat16)
  g = jnp.zeros((1, 32, 1), jnp.float32)
  with pytest.raises(ValueError, match="blocks.mosaic_key_grads.*K = V = 128"):
    gdr_pallas.gated_delta_rule_pallas(x, x, x, g, g, blocks=blocks)
  q = jnp.zeros((1, 64, 1, _SIZE), jnp.bfloat16)
  with pytest.raises(ValueError, match="`splits` 3 must divide the 2 chunks"):
    mosaic_key_grads.key_grads(q, q, q, q, q, g, g, None, None, None, chunk=32,
                               scale=1.0, splits=3)
