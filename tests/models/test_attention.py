"""dot_product_attention against a plain einsum softmax, and its dispatch on CPU."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pk


def einsum_attention(q, k, v, *, is_causal=False, kv_lengths=None):
  """The specification: softmax(q k^T / sqrt(H)) v, GQA by repeating K/V heads."""
  q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
  groups = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, groups, axis=2)
  v = jnp.repeat(v, groups, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  t, s = logits.shape[-2:]
  keep = jnp.ones((q.shape[0], 1, t, s), bool)
  if is_causal:
    keep &= jnp.tril(jnp.ones((t, s), bool))
  if kv_lengths is not None:
    keep &= (jnp.arange(s)[None, :] < kv_lengths[:, None])[:, None, None, :]
  logits = jnp.where(keep, logits, -jnp.inf)
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)


def _qkv(key, batch=2, t=7, s=7, n=4, k=2, h=16, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(key, 3)
  return (jax.random.normal(kq, (batch, t, n, h), dtype),
          jax.random.normal(kk, (batch, s, k, h), dtype),
          jax.random.normal(kv, (batch, s, k, h), dtype))


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_matches_einsum_reference_with_gqa_and_key_lengths(implementation, is_causal,
                                                           num_kv_heads):
  q, k, v = _qkv(jax.random.key(0), k=num_kv_heads)
  lengths = jnp.array([7, 4])
  out = pk.dot_product_attention(q, k, v, is_causal=is_causal,
                                 key_value_seq_lengths=lengths,
                                 implementation=implementation)
  expected = einsum_attention(q, k, v, is_causal=is_causal, kv_lengths=lengths)
  chex.assert_trees_all_close(out, expected, atol=1e-5, rtol=1e-5)


def test_gradients_match_reference():
  q, k, v = _qkv(jax.random.key(1))
  loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)))
  ours = jax.grad(loss(lambda q, k, v: pk.dot_product_attention(q, k, v, is_causal=True)),
                  argnums=(0, 1, 2))(q, k, v)
  ref = jax.grad(loss(lambda q, k, v: einsum_attention(q, k, v, is_causal=True)),
                 argnums=(0, 1, 2))(q, k, v)
  chex.assert_trees_all_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_bf16_in_bf16_out():
  q, k, v = _qkv(jax.random.key(2), dtype=jnp.bfloat16)
  out = pk.dot_product_attention(q, k, v)
  assert out.dtype == jnp.bfloat16
  chex.assert_trees_all_close(out.astype(jnp.float32), einsum_attention(q, k, v),
                              atol=3e-2, rtol=3e-2)


def test_cpu_dispatch_picks_xla_and_cudnn_fails_clearly():
  q, k, v = _qkv(jax.random.key(3), dtype=jnp.bfloat16)
  assert pk.choose_attention_implementation(q, k, v) == "xla"
  with pytest.raises(ValueError, match="cudnn.*NVIDIA GPU"):
    pk.dot_product_attention(q, k, v, implementation="cudnn")
  with pytest.raises(ValueError, match="implementation"):
    pk.dot_product_attention(q, k, v, implementation="fast")


@pytest.mark.parametrize("shapes, match", [
    (((2, 7, 4, 16), (2, 7, 2, 16), (2, 7, 2, 16)), None),
    (((2, 7, 16), (2, 7, 2, 16), (2, 7, 2, 16)), "query"),
    (((2, 7, 4, 16), (2, 7, 3, 16), (2, 7, 3, 16)), "multiple of the key/value heads"),
    (((2, 7, 4, 16), (2, 7, 2, 8), (2, 7, 2, 8)), "head size"),
])
def test_bad_shapes_raise(shapes, match):
  arrays = [jnp.zeros(s) for s in shapes]
  if match is None:
    pk.dot_product_attention(*arrays)
  else:
    with pytest.raises(ValueError, match=match):
      pk.dot_product_attention(*arrays)


def test_a_batch_of_one_split_over_a_size_one_axis():
  """jax.nn's XLA path mis-types a batch of 1 on a size-1 Explicit axis; the
  output equals the unsplit call's and keeps the query's type."""
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  q = jnp.asarray(np.random.RandomState(0).randn(1, 8, 2, 16), jnp.float32)
  attention = jax.jit(lambda q: pk.dot_product_attention(q, q, q, is_causal=True))
  placed = jax.device_put(q, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  with jax.set_mesh(mesh):
    got = attention(placed)
  assert jax.typeof(got).sharding.spec[0] == "data"
  np.testing.assert_allclose(got, attention(q), atol=1e-6)
