"""ops.decode_attention: the split-K kernel (interpret mode on CPU) and the XLA
path against reference.py, the reference against jax.nn's masked attention,
validation, jit/vmap, gradients, the Hopper lowering and the per-shard run.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import tolerances
from ops import _backend
from ops.decode_attention import TritonConfig
from ops.decode_attention import decode_attention
from ops.decode_attention import decode_attention_reference
from ops.decode_attention import api
from ops.decode_attention import configs
from ops.decode_attention import pallas
from ops.decode_attention import reference
from tests import simulated_devices

# Relative L2 error bounds, by input dtype.
_TOL = tolerances.DECODE_ATTENTION


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(b, t, s, n, kh, h, dtype, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (b, s, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, s, kh, h), jnp.float32).astype(dtype)
  return q, k, v


def _reference(q, k, v, lengths, **options):
  f32 = lambda x: x.astype(jnp.float32)
  return jax.jit(lambda q, k, v, lengths: decode_attention_reference(
      f32(q), f32(k), f32(v), lengths, **options))(q, k, v, lengths)


# b, t, s, n, kh, h, dtype, lengths, options, config: T in {1, 4, 16}, GQA 8:2,
# MHA and MQA, H in {32, 64, 80 (padded)}, windows (an int and a pair), lengths
# that are not multiples of the chunk (and == T, == S), one chunk and several,
# a cache shorter than the tile (as S < 64 runs on a GPU).
_CASES = {
    "t1_gqa_bf16": (3, 1, 100, 8, 2, 32, jnp.bfloat16, [100, 37, 1], {}, None),
    "t4_mha_f32_splits": (2, 4, 77, 4, 4, 32, jnp.float32, [77, 21], {},
                          TritonConfig(block_k=16, num_splits=3, num_warps=4, num_stages=1)),
    "t4_gqa_window_f16": (2, 4, 96, 8, 2, 64, jnp.float16, [90, 4],
                          dict(local_window_size=10), None),
    "t1_mqa_window_pair_h80_f32": (2, 1, 50, 4, 1, 80, jnp.float32, [50, 29],
                                   dict(local_window_size=(7, 0), scale=0.3), None),
    "t4_gqa_window_bf16_one_chunk": (2, 4, 64, 8, 2, 32, jnp.bfloat16, [61, 40],
                                     dict(local_window_size=(20, 3)),
                                     TritonConfig(block_k=32, num_splits=1, num_warps=4,
                                                  num_stages=1)),
    "t16_prefill_f32": (1, 16, 16, 2, 1, 32, jnp.float32, [16], {}, None),
    "t2_cache_below_tile_f32": (2, 2, 20, 4, 2, 32, jnp.float32, [20, 7],
                                dict(local_window_size=4),
                                TritonConfig(block_k=32, num_splits=1, num_warps=4,
                                             num_stages=1)),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_kernel_matches_reference(name):
  b, t, s, n, kh, h, dtype, lengths, options, config = _CASES[name]
  q, k, v = _inputs(b, t, s, n, kh, h, dtype)
  lengths = jnp.asarray(lengths, jnp.int32)
  out = jax.jit(lambda q, k, v, lengths: pallas.decode_attention_pallas(
      q, k, v, lengths, scale=options.get("scale", h ** -0.5),
      local_window_size=options.get("local_window_size"), interpret=True,
      config=config))(q, k, v, lengths)
  ref = _reference(q, k, v, lengths, **options)
  assert out.dtype == dtype and out.shape == (b, t, n, h)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert _rel(out, ref) < _TOL[dtype], _rel(out, ref)


def test_default_config_splits_the_cache():
  """The tests' default tiling (interpret mode) runs several chunks, so the
  cases above without a config exercise the combine."""
  config = TritonConfig.get_default(batch=3, kv_heads=2, seq_kv=100, rows=16, head_dim=32,
                                    interpret=True)
  assert pallas.chunking(100, config)[1] > 1
  # A GPU's: enough programs for the multiprocessors, chunks of >= 4 tiles.
  gpu = TritonConfig.get_default(batch=1, kv_heads=8, seq_kv=32768, rows=16, head_dim=128,
                                 interpret=False)
  chunk, splits = pallas.chunking(32768, gpu)
  assert 8 * splits >= 2 * configs.DEFAULT_MULTIPROCESSORS and chunk >= 4 * gpu.block_k
  short = TritonConfig.get_default(batch=64, kv_heads=8, seq_kv=1024, rows=16, head_dim=128,
                                   interpret=False)
  assert short.num_splits == 2


def test_a_config_without_a_split_count_splits_per_call():
  """Fields left None take the tuned values, but the split count is the call's."""
  config = TritonConfig(block_k=16)
  assert config.num_splits is None and config.num_warps is not None
  # 1,024 keys in chunks of at least `min_tiles_per_split` 16-key tiles.
  split = config.split_for(batch=1, kv_heads=1, seq_kv=1024)
  assert split.num_splits == 1024 // (16 * config.min_tiles_per_split)
  assert TritonConfig(num_splits=3).split_for(batch=1, kv_heads=1, seq_kv=1024).num_splits == 3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_xla_path_matches_reference(dtype):
  q, k, v = _inputs(3, 4, 64, 8, 2, 32, dtype)
  lengths = jnp.array([64, 9, 4], jnp.int32)
  for options in ({}, dict(local_window_size=5)):
    out = jax.jit(functools.partial(decode_attention, implementation="xla", **options))(
        q, k, v, lengths)
    assert out.dtype == dtype
    assert _rel(out, _reference(q, k, v, lengths, **options)) < _TOL[dtype]


def test_reference_is_jax_nn_attention_with_the_decode_mask():
  """The semantics in other words: jax.nn's attention with the boolean mask
  of reference.py, and causal self-attention when T == S == lengths."""
  q, k, v = _inputs(2, 4, 24, 4, 2, 16, jnp.float32)
  lengths = jnp.array([24, 11], jnp.int32)
  @functools.partial(jax.jit, static_argnums=4)
  def both(q, k, v, lengths, window):
    mask = reference.allowed_mask(lengths, q.shape[1], k.shape[1], window)[:, None]
    return (decode_attention_reference(q, k, v, lengths, local_window_size=window),
            jax.nn.dot_product_attention(q, k, v, mask=mask))  # mask: [B, 1, T, S]
  for window in (None, 3):
    np.testing.assert_allclose(*both(q, k, v, lengths, window), rtol=1e-5, atol=1e-5)
  q, k, v = _inputs(1, 24, 24, 4, 2, 16, jnp.float32)
  causal = jax.jit(lambda q, k, v: (decode_attention_reference(q, k, v, jnp.array([24])),
                                    jax.nn.dot_product_attention(q, k, v, is_causal=True)))
  np.testing.assert_allclose(*causal(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_cache_padding_is_never_used(implementation):
  """Entries at s >= lengths (an unwritten cache) may hold anything, NaN too."""
  q, k, v = _inputs(2, 2, 48, 4, 2, 32, jnp.float32)
  lengths = jnp.array([48, 19], jnp.int32)
  beyond = (jnp.arange(48)[None, :] >= lengths[:, None])[:, :, None, None]
  nan_k, nan_v = jnp.where(beyond, jnp.nan, k), jnp.where(beyond, jnp.inf, v)
  out = jax.jit(functools.partial(decode_attention, implementation=implementation))(
      q, nan_k, nan_v, lengths)
  assert np.isfinite(np.asarray(out)).all()
  assert _rel(out, _reference(q, k, v, lengths)) < _TOL[jnp.float32]


def test_default_implementation_on_cpu_is_xla():
  q, k, v = _inputs(2, 1, 32, 4, 2, 32, jnp.float32)
  lengths = jnp.array([32, 5], jnp.int32)
  call = dict(q=q, k_cache=k, v_cache=v, lengths=lengths, scale=1.0, local_window_size=None)
  if not _backend.on_nvidia_gpu():
    assert api.IMPLEMENTATIONS.choose(None, call).name == "xla"
  out = jax.jit(decode_attention)(q, k, v, lengths)
  xla = jax.jit(functools.partial(decode_attention, implementation="xla"))(q, k, v, lengths)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(xla))


def test_jit_with_traced_lengths_and_vmap():
  q, k, v = _inputs(4, 2, 40, 4, 2, 32, jnp.float32)
  lengths = jnp.array([40, 3, 17, 33], jnp.int32)
  fn = lambda q, k, v, lengths: decode_attention(q, k, v, lengths, local_window_size=6,
                                                 implementation="pallas")
  ref = _reference(q, k, v, lengths, local_window_size=6)
  assert _rel(jax.jit(fn)(q, k, v, lengths), ref) < _TOL[jnp.float32]
  # vmap over a leading axis of two groups of two sequences.
  split = lambda x: x.reshape(2, 2, *x.shape[1:])
  out = jax.vmap(fn)(split(q), split(k), split(v), split(lengths))
  assert _rel(out.reshape(ref.shape), ref) < _TOL[jnp.float32]


def test_gradients_are_the_references():
  """The kernel is forward-only; its gradients are the reference's."""
  q, k, v = _inputs(2, 2, 40, 4, 2, 32, jnp.bfloat16)
  lengths = jnp.array([40, 21], jnp.int32)
  w = jax.random.normal(jax.random.PRNGKey(5), q.shape, jnp.float32)
  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v, lengths).astype(jnp.float32) * w)
  kernel = lambda *a: decode_attention(*a, implementation="pallas")
  grads = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(decode_attention_reference), argnums=(0, 1, 2)))(q, k, v)
  for g, g_ref in zip(grads, want):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(g_ref, np.float32))


def test_cache_shorter_than_a_tile():
  """S = 5 slots, below the default key tile (16 in interpret mode): the op
  pads the cache to one tile inside; outputs and gradients are the
  reference's, the gradients shaped like the caller's cache."""
  q, k, v = _inputs(2, 2, 5, 4, 2, 32, jnp.float32)
  lengths = jnp.array([5, 2], jnp.int32)
  w = jax.random.normal(jax.random.PRNGKey(5), q.shape, jnp.float32)
  def out_and_grads(fn):
    def run(q, k, v):
      out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, lengths), q, k, v)
      return out, pullback(w)
    return jax.jit(run)(q, k, v)
  out, grads = out_and_grads(functools.partial(decode_attention, implementation="pallas"))
  ref, want = out_and_grads(decode_attention_reference)
  assert _rel(out, ref) < _TOL[jnp.float32], _rel(out, ref)
  for g, g_ref in zip(grads, want):
    assert g.shape == g_ref.shape
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g_ref))


_SHAPES = dict(q=(2, 4, 8, 32), k_cache=(2, 16, 2, 32), v_cache=(2, 16, 2, 32))


@pytest.mark.parametrize("changes, match", [
    (dict(q=(2, 4, 8)), "`q` must have rank 4"),
    (dict(k_cache=(2, 16, 3, 32), v_cache=(2, 16, 3, 32)), r"multiple of `k_cache` heads"),
    (dict(k_cache=(2, 16, 2, 16), v_cache=(2, 16, 2, 16)), "`k_cache` head size"),
    (dict(v_cache=(2, 17, 2, 32)), "must have the same shape"),
    (dict(k_cache=(3, 16, 2, 32), v_cache=(3, 16, 2, 32)), "`k_cache` batch 3"),
    (dict(q=(2, 17, 8, 32)), "T must be <= S"),
    (dict(q=(2, 0, 8, 32)), "non-empty"),
    (dict(lengths=np.array([16, 3])), r"`lengths` must lie in \[T=4, S=16\]"),
    (dict(lengths=np.array([17, 16])), r"`lengths` must lie in \[T=4, S=16\]"),
    (dict(lengths=np.array([16])), r"`lengths` must have shape \(2,\)"),
    (dict(lengths=np.array([16.0, 16.0])), "`lengths` must be integers"),
    (dict(local_window_size=-1), "`local_window_size`"),
    (dict(local_window_size=(2, 3, 4)), "`local_window_size`"),
    (dict(scale=jnp.float32(0.5)), "`scale` must be a Python number"),
    (dict(implementation="cuda"), "`implementation`"),
    (dict(q=(2, 4, 8, 512), k_cache=(2, 16, 2, 512), v_cache=(2, 16, 2, 512),
          implementation="pallas"), "head size must be <= 256"),
    (dict(q=(2, 16, 64, 128), k_cache=(2, 16, 2, 128), v_cache=(2, 16, 2, 128),
          lengths=np.array([16, 16]), implementation="pallas"), "G \\* T = 32 \\* 16 query rows"),
])
def test_bad_inputs_raise(changes, match):
  args = {name: jnp.zeros(changes.pop(name, shape), jnp.float32)
          for name, shape in _SHAPES.items()}
  lengths = jnp.asarray(changes.pop("lengths", np.array([16, 9], np.int32)))
  with pytest.raises(ValueError, match=match):
    decode_attention(args["q"], args["k_cache"], args["v_cache"], lengths, **changes)


def test_mixed_dtypes_raise():
  q, k, v = _inputs(1, 1, 8, 2, 1, 16, jnp.float32)
  with pytest.raises(ValueError, match="share a dtype"):
    decode_attention(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), jnp.array([8]))


def _spec(shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.usefixtures("hopper_lowering")
@pytest.mark.parametrize("mode", ["forward", "gradient"])
@pytest.mark.parametrize("case", [
    (2, 1, 32, 8, 128, 1000, jnp.bfloat16, None),
    (2, 4, 8, 2, 80, 300, jnp.float32, 16),
    (1, 16, 8, 8, 256, 64, jnp.float16, (5, 0)),
], ids=["t1_gqa_h128_bf16", "t4_h80_window_f32", "t16_h256_f16"])
def test_lowers_to_triton_for_hopper(case, mode):
  b, t, n, kh, h, s, dtype, window = case
  attend = lambda q, k, v, lengths: decode_attention(
      q, k, v, lengths, local_window_size=window, implementation="pallas")
  fn = attend
  if mode == "gradient":  # the forward kernel, then the reference's backward
    fn = jax.value_and_grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32)),
                            argnums=(0, 1, 2))
  specs = (_spec((b, t, n, h), dtype), _spec((b, s, kh, h), dtype), _spec((b, s, kh, h), dtype),
           _spec((b,), jnp.int32))
  text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text


_SHARDED_SCRIPT = r'''
import functools
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from ops.decode_attention import decode_attention

assert jax.device_count() == 8, jax.devices()
out = {}
keys = jax.random.split(jax.random.PRNGKey(0), 3)
q = jax.random.normal(keys[0], (8, 2, 8, 16))
k = jax.random.normal(keys[1], (8, 40, 2, 16))
v = jax.random.normal(keys[2], (8, 40, 2, 16))
lengths = jnp.array([40, 2, 17, 33, 8, 39, 25, 3], jnp.int32)
fn = jax.jit(lambda q, k, v, lengths: decode_attention(q, k, v, lengths, local_window_size=9,
                                                         implementation="pallas"))
want = np.asarray(fn(q, k, v, lengths))

def run(mesh, specs):
  placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((q, k, v, lengths), specs)]
  with jax.set_mesh(mesh):
    compiled = fn.lower(*placed).compile()  # run as read: one compile
    text, got = compiled.as_text(), np.asarray(compiled(*placed))
  gathers = sum(line.count(" all-gather") for line in text.splitlines())
  return {"gathers": gathers, "err": float(np.max(np.abs(got - want)))}

auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
out["auto_batch"] = run(auto, [P("data")] * 4)
explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
heads = P("data", None, "model")
out["explicit_batch_heads"] = run(explicit, [heads, heads, heads, P("data")])
try:
  run(explicit, [P("data"), P("data", "model"), P("data", "model"), P("data")])
  out["sequence_error"] = "no error"
except ValueError as e:
  out["sequence_error"] = str(e)
print("RESULT" + json.dumps(out))
'''


def test_runs_per_shard_on_a_mesh():
  """On 8 CPU devices: batch over an Auto mesh, batch and heads (query and
  key/value heads together) over Explicit axes; the compiled program holds no
  all-gather and gives one device's values; a sharded cache axis raises."""
  results = simulated_devices.run(_SHARDED_SCRIPT)
  for case in ("auto_batch", "explicit_batch_heads"):
    assert results[case]["gathers"] == 0, results
    assert results[case]["err"] < 1e-5, results
  message = results["sequence_error"]
  assert "`k_cache`" in message and "sequence axis" in message, message
