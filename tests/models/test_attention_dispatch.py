"""Which backend `dot_product_attention` picks, by platform and inputs.

`choose_attention_implementation` is the one dispatch rule; the platform is
faked by patching `ops._backend.on_nvidia_gpu` and the device kind
(`ops._measured.platform`), so every row of the BUILD_NOTES.md table runs on a
CPU. A kernel runs by default only where the measured tables of this device
kind hold a passing check of it and a time showing it faster: the `gpu`
fixture has no tables (the established path: cuDNN where it takes the call,
else XLA), `kernels_measured_faster` tables that time flex and the decode
kernel fastest, both checked.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pk
from ops import _backend
from ops import _measured
from ops import flex_attention_reference
from probjax_hk import attention
from tests.ops.test_measured import GPU
from tests.ops.test_measured import measured_table


def _qkv(dtype=jnp.bfloat16, head_dim=32, t=16, n=4, k=2, s=16):
  q = jnp.zeros((2, t, n, head_dim), dtype)
  kv = jnp.zeros((2, s, k, head_dim), dtype)
  return q, kv, kv


@pytest.fixture
def gpu(monkeypatch):
  monkeypatch.setattr(_backend, "on_nvidia_gpu", lambda: True)
  monkeypatch.setattr(_measured, "platform", lambda: GPU)
  monkeypatch.setattr(_measured, "load", lambda table: None)


@pytest.fixture
def kernels_measured_faster(gpu, monkeypatch):
  del gpu
  tables = dict(
      attention=measured_table([dict(ms=dict(flex=1.0, cudnn=2.0, xla=3.0))], kernels=["flex"]),
      decode_attention=measured_table([dict(ms=dict(pallas=1.0, cudnn=2.0, xla=3.0))],
                                      kernels=["pallas"]))
  monkeypatch.setattr(_measured, "load", tables.get)


def _table(points, keys=("dtype", "variant"), axes=("head_dim", "length")):
  return measured_table(points, keys, axes, kernels=["flex"])


# (inputs, options) -> the choice of `implementation=None` on an NVIDIA GPU
# without measured tables (cuDNN where it takes the inputs, else XLA), and
# with tables that time this library's kernels fastest and checked.
_GPU_CASES = [
    ("plain bf16", dict(), {}, "cudnn", "flex"),
    ("causal f32", dict(dtype=jnp.float32), dict(is_causal=True), "xla", "flex"),
    ("head size 256", dict(head_dim=256), {}, "xla", "flex"),
    ("head size 128 bf16, causal", dict(head_dim=128), dict(is_causal=True), "cudnn", "flex"),
    ("head size 64 f32: cuDNN cannot", dict(head_dim=64, dtype=jnp.float32), {}, "xla", "flex"),
    ("head size 64, right window: cuDNN cannot", dict(head_dim=64),
     dict(local_window_size=(4, 4)), "xla", "flex"),
    ("right-looking window", dict(), dict(local_window_size=(4, 4)), "xla", "flex"),
    ("key lengths", dict(), dict(key_value_seq_lengths=jnp.array([3, 16])), "cudnn", "flex"),
    ("dense mask, bf16", dict(), dict(mask=jnp.ones((1, 1, 16, 16), bool)), "cudnn", "cudnn"),
    ("dense bias, bf16", dict(), dict(bias=jnp.zeros((1, 1, 16, 16), jnp.bfloat16)), "cudnn",
     "cudnn"),
    ("query lengths", dict(), dict(query_seq_lengths=jnp.array([3, 16])), "cudnn", "cudnn"),
    ("dense mask, f32", dict(dtype=jnp.float32), dict(mask=jnp.ones((1, 1, 16, 16), bool)),
     "xla", "xla"),
    ("head size 512", dict(head_dim=512), {}, "xla", "xla"),
    ("one query per sequence: decode kernel where measured", dict(t=1), {}, "cudnn", "decode"),
    ("one query, key lengths", dict(t=1), dict(key_value_seq_lengths=jnp.array([3, 1])), "cudnn",
     "decode"),
    ("one query, f32: decode kernel where measured", dict(t=1, dtype=jnp.float32), {}, "xla",
     "decode"),
    ("one query, causal: not decode", dict(t=1), dict(is_causal=True), "cudnn", "flex"),
    ("one query, window: not decode", dict(t=1), dict(local_window_size=(4, 0)), "cudnn", "flex"),
    ("one query, dense mask: not decode", dict(t=1), dict(mask=jnp.ones((1, 1, 1, 16), bool)),
     "cudnn", "cudnn"),
    ("one query, a concrete key length 0: not decode", dict(t=1),
     dict(key_value_seq_lengths=jnp.array([0, 4])), "cudnn", "flex"),
    ("one query, head size 512: not decode", dict(t=1, head_dim=512), {}, "xla", "xla"),
]


def _choose(shapes, options):
  q, k, v = _qkv(**shapes)
  options = dict(options)
  bias = options.pop("bias", None)
  mask = options.pop("mask", None)
  query_seq_lengths = options.pop("query_seq_lengths", None)
  return attention.choose_attention_implementation(
      q, k, v, bias, mask, query_seq_lengths=query_seq_lengths, **options)


@pytest.mark.parametrize("name, shapes, options, without_data, measured", _GPU_CASES,
                         ids=[c[0] for c in _GPU_CASES])
def test_default_on_nvidia_gpu_without_measured_kernels(gpu, name, shapes, options,
                                                        without_data, measured):
  del gpu, name, measured
  assert _choose(shapes, options) == without_data


@pytest.mark.parametrize("name, shapes, options, without_data, measured", _GPU_CASES,
                         ids=[c[0] for c in _GPU_CASES])
def test_default_on_nvidia_gpu_with_kernels_checked_and_measured_faster(
    kernels_measured_faster, name, shapes, options, without_data, measured):
  del kernels_measured_faster, name, without_data
  assert _choose(shapes, options) == measured


def test_unchecked_kernels_or_another_device_kind_keep_the_established_path(
    kernels_measured_faster, monkeypatch):
  del kernels_measured_faster
  q, k, v = _qkv(t=1)
  assert attention.choose_attention_implementation(q, k, v) == "decode"
  monkeypatch.setattr(_measured, "platform", lambda: ("NVIDIA A100", GPU[1]))
  assert attention.choose_attention_implementation(q, k, v) == "cudnn"
  monkeypatch.setattr(_measured, "platform", lambda: GPU)
  _measured.load("decode_attention")["devices"][0]["checked"] = {}
  assert attention.choose_attention_implementation(q, k, v) == "flex"  # the attention table's
  _measured.load("attention")["devices"][0]["checked"] = {}
  assert attention.choose_attention_implementation(q, k, v) == "cudnn"


def test_explicit_decode_is_the_opt_in(gpu):
  del gpu
  q, k, v = _qkv(t=1)
  assert attention.choose_attention_implementation(q, k, v) == "cudnn"
  assert attention.choose_attention_implementation(q, k, v, implementation="decode") == "decode"
  q, k, v = _qkv(t=2)
  with pytest.raises(ValueError, match=r"implementation='decode'\): .*T=2"):
    attention.choose_attention_implementation(q, k, v, implementation="decode")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_query_runs_the_decode_kernel_and_matches_xla(gpu, monkeypatch, dtype):
  """The decode kernel (interpret mode on a CPU) computes what XLA does for
  one query per sequence against a padded cache, jitted, GQA, and its
  gradients are XLA's."""
  del gpu
  monkeypatch.setattr(_backend, "pallas_interpret", lambda: True)
  keys = jax.random.split(jax.random.PRNGKey(1), 3)
  q = jax.random.normal(keys[0], (3, 1, 8, 32), dtype)
  k = jax.random.normal(keys[1], (3, 40, 2, 32), dtype)
  v = jax.random.normal(keys[2], (3, 40, 2, 32), dtype)
  lengths = jnp.array([40, 17, 1])
  assert attention.choose_attention_implementation(
      q, k, v, key_value_seq_lengths=lengths, implementation="decode") == "decode"
  loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)
  ours = lambda q, k, v: pk.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                                  implementation="decode")
  xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                                     implementation="xla")
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(jax.jit(ours)(q, k, v), np.float32),
                             np.asarray(xla(q, k, v), np.float32), rtol=tol, atol=tol)
  grads = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
  expected = jax.grad(loss(xla), argnums=(0, 1, 2))(q, k, v)
  for got, want in zip(grads, expected):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=5 * tol, atol=5 * tol)


def test_traced_scale_on_nvidia_gpu_is_not_flex(kernels_measured_faster):
  del kernels_measured_faster
  q, k, v = _qkv()
  chosen = []
  jax.jit(lambda scale: chosen.append(attention.choose_attention_implementation(
      q, k, v, scale=scale)))(0.5)
  assert chosen == ["cudnn"]
  assert attention.choose_attention_implementation(q, k, v, scale=0.5) == "flex"


@pytest.mark.parametrize("times, shapes, expected", [
    (dict(flex=2.0, cudnn=1.0, xla=3.0), dict(), "cudnn"),
    (dict(flex=2.0, cudnn=3.0, xla=1.0), dict(), "xla"),
    # cuDNN, the fastest, cannot take float32: the fastest that can.
    (dict(flex=2.0, cudnn=1.0, xla=3.0), dict(dtype=jnp.float32), "flex"),
    # H 80 is judged by the H 128 point (the smallest measured that covers it).
    (dict(flex=2.0, cudnn=1.0), dict(head_dim=80), "cudnn"),
    # H 256: cuDNN cannot, and the table timed only it and flex there.
    (dict(flex=2.0, cudnn=1.0), dict(head_dim=256), "flex"),
])
def test_default_on_nvidia_gpu_follows_the_measured_table(gpu, monkeypatch, times, shapes,
                                                          expected):
  del gpu
  dtype = "float32" if shapes.get("dtype") == jnp.float32 else "bfloat16"
  points = [dict(dtype=dtype, variant="full", head_dim=h, length=16, ms=ms)
            for h, ms in ((32, dict(flex=1.0, cudnn=9.0, xla=9.0)), (128, times))]
  monkeypatch.setattr(_measured, "load", lambda table: _table(points))
  q, k, v = _qkv(n=2, **{"head_dim": 128, **shapes})  # n = k: the 'full' variant
  assert attention.choose_attention_implementation(q, k, v) == expected
  q, k, v = _qkv(n=2, head_dim=32, dtype=shapes.get("dtype", jnp.bfloat16))
  assert attention.choose_attention_implementation(q, k, v) == "flex"


def test_committed_table_picks_the_fastest_at_each_measured_point(monkeypatch):
  """At each point of ops/dispatch_tables/attention.json (inputs of that
  dtype, variant, head size and length), `None` on that device kind picks the
  fastest timed implementation among those that take the inputs and, for
  flex, passed its check there."""
  monkeypatch.setattr(_backend, "on_nvidia_gpu", lambda: True)
  table = _measured.load("attention")
  assert table is not None and table["devices"]
  for data in table["devices"]:
    monkeypatch.setattr(_measured, "platform", lambda data=data: (
        data["device"], _measured.minor(data["jax"].split(", ")[0])))
    for point in data["points"]:
      n, kv = (8, 1) if point["variant"] == "gqa" else (2, 2)
      t = max(1, point["length"] // 16) if point["variant"] == "cross" else point["length"]
      q = jax.ShapeDtypeStruct((1, t, n, point["head_dim"]), jnp.dtype(point["dtype"]))
      k = jax.ShapeDtypeStruct((1, point["length"], kv, point["head_dim"]), q.dtype)
      options = dict(is_causal=point["variant"] in ("causal", "gqa", "sliding_window"),
                     local_window_size=(256, 0) if point["variant"] == "sliding_window" else None)
      cudnn = attention._cudnn_limit(q, k, None, options["local_window_size"],
                                     options["is_causal"]) is None
      fits = [name for name in point["ms"] if name == "xla" or (name == "cudnn" and cudnn) or
              (name == "flex" and "flex" in data["checked"]
               and attention._flex_limit(q, None, None, None) is None)]
      want = min(fits, key=point["ms"].get) if fits else ("cudnn" if cudnn else "xla")
      assert attention.choose_attention_implementation(q, k, k, **options) == want, point


@pytest.mark.parametrize("options", [{}, dict(is_causal=True),
                                     dict(mask=jnp.ones((1, 1, 16, 16), bool))])
def test_default_on_cpu_is_xla(options):
  assert not _backend.on_nvidia_gpu()  # The test suite runs with JAX_PLATFORMS=cpu.
  q, k, v = _qkv()
  mask = options.pop("mask", None)
  assert attention.choose_attention_implementation(q, k, v, None, mask, **options) == "xla"


def test_explicit_flex_rejects_what_it_cannot_take():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="flex.*bias"):
    attention.choose_attention_implementation(
        q, k, v, None, jnp.ones((1, 1, 16, 16), bool), implementation="flex")
  with pytest.raises(ValueError, match="query_seq_lengths"):
    attention.choose_attention_implementation(
        q, k, v, implementation="flex", query_seq_lengths=jnp.array([1, 2]))
  q, k, v = _qkv(head_dim=512)
  with pytest.raises(ValueError, match="head size"):
    pk.dot_product_attention(q, k, v, implementation="flex")


def test_explicit_flex_runs_the_kernel_on_cpu():
  """implementation='flex' on a CPU runs the Pallas kernel in interpret mode."""
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (1, 24, 4, 16), jnp.float32)
  k = jax.random.normal(keys[1], (1, 24, 2, 16), jnp.float32)
  v = jax.random.normal(keys[2], (1, 24, 2, 16), jnp.float32)
  lengths = jnp.array([19])
  out = pk.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                                 local_window_size=(6, 0), implementation="flex")
  expected = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                          key_value_seq_lengths=lengths,
                                          local_window_size=(6, 0), implementation="xla")
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=2e-5, atol=2e-5)
  ref = flex_attention_reference(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                                 local_window_size=(6, 0))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
