"""ops.gated_delta_rule's Mosaic GPU chunk gradients (mosaic_grads.py): against
the Triton value- and key-gradient kernels in Mosaic GPU interpret mode, inside
the op (every gradient against the reference), its lowering for Hopper, and its
limits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.gated_delta_rule import configs as gdr_configs
from ops.gated_delta_rule import mosaic_grads
from ops.gated_delta_rule import pallas as gdr_pallas
from ops.gated_delta_rule import triton as gdr_triton
from tests.ops.test_gated_delta_rule_mosaic import assert_op_matches_reference
from tests.ops.test_gated_delta_rule_mosaic import lowered_gradient
from tests.ops.test_gated_delta_rule_mosaic import traced_gradient

_SIZE = 128  # the kernel's K = V
_L = mosaic_grads.CHUNK


@functools.partial(jax.jit, static_argnums=range(5))
def _inputs(batch, time, heads, groups, seed):
  """Random operands of the chunk gradients, rounded as the op stores them
  (drawn in one program: eager `jax.random` calls compile one each)."""
  ks = jax.random.split(jax.random.key(seed), 11)
  bf16 = lambda x: x.astype(jnp.bfloat16)
  rows = lambda key, n, s=1.0: bf16(s * jax.random.normal(key, (batch, time, n, _SIZE)))
  q, k = rows(ks[0], groups, _SIZE ** -0.5), rows(ks[1], groups, _SIZE ** -0.5)
  v, u, du, dy = (rows(key, heads) for key in ks[2:6])
  chunks = (batch, heads, time // _L)
  b = jnp.cumsum(-0.2 * jax.random.uniform(ks[6], chunks + (_L,)), -1)
  beta = jax.random.uniform(ks[7], (batch, heads, time))
  # T^T: T is unit lower triangular, so T^T unit upper.
  tt = bf16(jnp.eye(_L) + 0.3 * jnp.triu(jax.random.normal(ks[8], chunks + (_L, _L)), 1))
  states = chunks + (_SIZE, _SIZE)
  m0, dm1 = bf16(jax.random.normal(ks[9], states)), bf16(jax.random.normal(ks[10], states))
  return (q, k, v, u, du, dy, tt.reshape(batch, heads, time, _L),
          b.reshape(batch, heads, time), beta, m0, dm1)


@pytest.mark.parametrize("heads, groups, splits, chunks", [
    (2, 2, 2, 3),  # bf16 outputs, two runs of chunks per head, the 4-unit row ring wrapping
    (2, 1, 1, 2),  # heads sharing keys: float32 dQ, dK (a 2-unit row ring)
])
def test_matches_the_triton_gradient_kernels(heads, groups, splits, chunks):
  """dQ, dK, dV, d log-decay and d beta against the Triton value- and
  key-gradient kernels on the same operands (the same bf16 products; the sums
  differ in order)."""
  time = chunks * splits * _L
  q, k, v, u, du, dy, tt, b, beta, m0, dm1 = _inputs(1, time, heads, groups,
                                                      seed=heads + groups)
  blocks = gdr_configs.TritonConfig(chunk=_L, block_v=64, grad_block_k=_SIZE)

  @jax.jit
  def triton_grads(q, k, v, u, du, dy, tt, b, beta, m0, dm1):
    dv, dru, dsd, dkk, db, dbeta = gdr_triton.value_grads(q, k, v, u, du, dy, b, beta, tt,
                                                          0.25, blocks)
    dq, dk, db_keys, dbeta_keys = gdr_triton.key_grads(q, k, u, dru, dy, b, beta, dsd, dkk,
                                                       m0, dm1, 0.25, blocks)
    return dq, dk, dv, db + db_keys.sum(0), dbeta + dbeta_keys.sum(0)
  want = triton_grads(q, k, v, u, du, dy, tt, b, beta, m0, dm1)
  got = mosaic_grads.chunk_grads(q, k, v, u, du, dy, tt, b, beta, m0, dm1, scale=0.25,
                                 splits=splits, interpret=True)
  for name, x, y in zip(("dq", "dk", "dv", "db", "dbeta"), got, want):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.abs(x - y).max() <= 2e-3 * np.abs(y).max(), name


def test_op_with_the_mosaic_gradients_matches_reference():
  """The whole op's gradients with the Mosaic chunk gradients forced on (and the
  Triton walks)."""
  assert_op_matches_reference(seed=3, check_outputs=False, mosaic_grads=True)


def test_lowers_to_mosaic_gpu_for_hopper(hopper_lowering):
  """Mosaic GPU's checks (TMA boxes, swizzles, wgmma shapes) without a GPU,
  inside the op's gradient, heads sharing keys and not."""
  del hopper_lowering
  for groups in (4, 2):
    text = lowered_gradient(groups, mosaic_walk=True, mosaic_grads=True)
    assert "gated_delta_chunk_grads_mosaic" in text
    assert "gated_delta_value_grads" not in text and "gated_delta_key_grads" not in text


def test_chosen_by_default_where_every_head_has_its_keys(hopper_lowering):
  """With the Mosaic walks and otherwise default blocks (as on Hopper) the fused
  kernel runs when N = G, and the value- and key-gradient kernels when heads
  share keys (where they were measured faster). Traced, not lowered: the op
  picks its kernels while tracing, and the tests above and in
  test_gated_delta_rule_mosaic_key_grads.py lower both choices."""
  del hopper_lowering
  own_keys, shared_keys = (str(traced_gradient(g, mosaic_walk=True).jaxpr) for g in (4, 2))
  assert "gated_delta_chunk_grads_mosaic" in own_keys
  assert "gated_delta_key_grads_mosaic" not in own_keys
  assert "gated_delta_chunk_grads_mosaic" not in shared_keys
  assert "gated_delta_key_grads_mosaic" in shared_keys


@pytest.mark.parametrize("key, chunk, match", [(64, 32, "K = V = 128"),
                                               (_SIZE, 16, "chunks of 32 tokens")])
def test_forced_outside_its_limits_raises(key, chunk, match):
  blocks = gdr_configs.TritonConfig(chunk=chunk, mosaic_grads=True)
  x = jnp.zeros((1, 32, 1, key), jnp.bfloat16)
  g = jnp.zeros((1, 32, 1), jnp.float32)
  with pytest.raises(ValueError, match=f"blocks.mosaic_grads.*{match}"):
    gdr_pallas.gated_delta_rule_pallas(x, x, x, g, g, blocks=blocks)


def test_bad_runs_and_slots_raise():
  q = jnp.zeros((1, 64, 1, _SIZE), jnp.bfloat16)
  g = jnp.zeros((1, 1, 64), jnp.float32)
  call = lambda **kw: mosaic_grads.chunk_grads(q, q, q, q, q, q, None, g, g, None, None,
                                               scale=1.0, **kw)
  with pytest.raises(ValueError, match="`splits` 3 must divide the 2 chunks"):
    call(splits=3)
  with pytest.raises(ValueError, match="`slots` 5 needs .* bytes of shared memory"):
    call(slots=5)
  with pytest.raises(ValueError, match="`slots` must be >= 2"):
    call(slots=1)
