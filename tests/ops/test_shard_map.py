"""The kernels under `jax.shard_map` with its default `check_vma=True`.

There every value is typed with the mesh axes it varies over, and a Pallas
call's output types must say theirs (`ops/_pallas.py` sets them from the
inputs). The check is static, so a one-device mesh exercises it: each op's
kernel path (Pallas interpret mode) is differentiated inside shard_map, batch
sharded and parameters replicated, and must give the unsharded gradients. The
Mosaic GPU attention kernels are lowered for Hopper the same way.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import ops

_B = P("batch")  # sharded over the batch
_R = P()  # replicated


def _normal(key, shape, dtype=jnp.float32):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _cases():
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  b, t, n, h = 2, 40, 2, 16
  qkv = [_normal(keys[i], (b, t, n, h)) for i in range(3)]
  decay = -jax.nn.softplus(_normal(keys[3], (b, t, n)))
  beta = jax.nn.sigmoid(_normal(keys[4], (b, t, n)))
  d, s = 8, 4
  return {
      "flex_attention": (lambda q, k, v: ops.flex_attention(
          q, k, v, is_causal=True, implementation="pallas"), qkv, (_B,) * 3),
      "ssd": (lambda q, k, v, g: ops.ssd(q, k, v, g, implementation="pallas")[0],
              [*qkv, decay], (_B,) * 4),
      "gated_delta_rule": (lambda q, k, v, g, beta: ops.gated_delta_rule(
          q, k, v, g, beta, implementation="pallas")[0], [*qkv, decay, beta], (_B,) * 5),
      "selective_scan": (lambda u, dt, a, bb, c: ops.selective_scan(
          u, dt, a, bb, c, delta_softplus=True, implementation="pallas")[0],
          [_normal(keys[0], (b, t, d)), _normal(keys[1], (b, t, d)),
           -jnp.exp(_normal(keys[2], (d, s))), _normal(keys[3], (b, t, s)),
           _normal(keys[4], (b, t, s))], (_B, _B, _R, _B, _B)),
      "linear_scan": (lambda a, x: ops.linear_scan(a, x, implementation="pallas")[0],
                      [jax.nn.sigmoid(_normal(keys[0], (b, t, d))), _normal(keys[1], (b, t, d))],
                      (_B, _B)),
      # Rows sharded (data parallel), the experts' weights replicated.
      "grouped_matmul": (lambda x, w: ops.grouped_matmul(
          x, w, jnp.array([10, 0, 22], jnp.int32), implementation="pallas"),
          [_normal(keys[0], (64, 16)), _normal(keys[1], (3, 16, 24))], (_B, _R)),
      "grouped_mlp": (lambda x, w1, w2: ops.grouped_mlp(
          x, w1, w2, jnp.array([10, 0, 22], jnp.int32), implementation="pallas"),
          [_normal(keys[0], (64, 16)), _normal(keys[1], (3, 16, 24)),
           _normal(keys[2], (3, 24, 16))], (_B, _R, _R)),
  }


def _mesh():
  return Mesh(np.asarray(jax.devices()[:1]), ("batch",))


def _sharded_grad(name):
  fn, args, specs = _cases()[name]
  grad = jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float32))),
                  argnums=tuple(range(len(args))))
  # With check_vma, the gradient of a replicated input comes out summed over
  # the devices (not varying), as its out_spec P() requires: the custom VJPs
  # type it so (`_pallas.typed_like`).
  return jax.shard_map(grad, mesh=_mesh(), in_specs=specs, out_specs=specs), grad, args


def test_attention_gradients_under_shard_map_match():
  """flex attention's Triton kernels in interpret mode, run. (Pallas interpret
  mode of jax 0.11.2 mixes varying and non-varying values inside some of the
  other kernels under shard_map, "Primitive mul requires varying manual axes
  to match", so those are checked by lowering, below.)"""
  sharded, grad, args = _sharded_grad("flex_attention")
  for g, w in zip(jax.jit(sharded)(*args), jax.jit(grad)(*args)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["ssd", "gated_delta_rule", "selective_scan", "linear_scan",
                                  "grouped_matmul", "grouped_mlp"])
def test_gradients_lower_under_shard_map(name, hopper_lowering):
  """The output types of every kernel and the custom VJPs' gradient types
  (`ops/_pallas.py`) pass shard_map's checks when traced and lowered."""
  del hopper_lowering
  sharded, _, args = _sharded_grad(name)
  text = jax.jit(sharded).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("head_dim", [64, 128])
def test_mosaic_attention_lowers_under_shard_map(head_dim, hopper_lowering):
  """The Mosaic forward and backward (the table's, for Hopper) under
  shard_map: their output types, and the backward's gradients, which come
  back typed as not varying (its dQ buffer is a Ref operand) and are typed
  as q, k and v by the custom VJP."""
  del hopper_lowering
  from ops.flex_attention import configs
  from ops.flex_attention import pallas
  config = configs.get_config(head_dim, jnp.bfloat16, interpret=False, generation="sm90")
  def loss(q, k, v):
    out = pallas.flex_attention_pallas(
        q, k, v, scale=0.1, is_causal=True, window=None, q_segment_ids=None,
        kv_segment_ids=None, key_value_seq_lengths=None, interpret=False, config=config)
    return jnp.sum(out.astype(jnp.float32))
  grads = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=_mesh(),
                        in_specs=(_B,) * 3, out_specs=(_B,) * 3)
  spec_q = jax.ShapeDtypeStruct((2, 512, 4, head_dim), jnp.bfloat16)
  spec_kv = jax.ShapeDtypeStruct((2, 512, 2, head_dim), jnp.bfloat16)
  text = jax.jit(grads).trace(spec_q, spec_kv, spec_kv).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "flex_attention_mosaic_bwd" in text
