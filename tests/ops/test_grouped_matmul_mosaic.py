"""The Mosaic GPU grouped-matmul kernels (`ops/grouped_matmul/mosaic.py`, and the
grouped MLP on them), on the CPU in Mosaic GPU interpret mode, against
`jax.lax.ragged_dot` in float32; and their lowering for a Hopper GPU.

Interpret mode simulates the kernel's warpgroups, barriers, TMA copies and
wgmma, so these tests check the kernel's own indexing: tiles that straddle
group boundaries (the power-of-two row stores), whole tiles (the swizzled
stores), empty groups, rows after the last group, both warpgroup splits, the
transposed rhs, and the epilogue's extra inputs and multiple outputs.
"""

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops import _backend
from ops.grouped_matmul import configs
from ops.grouped_matmul import mosaic
from ops.grouped_matmul import pallas as gmm_pallas
from ops.grouped_matmul import reference
from ops.grouped_mlp import pallas as mlp_pallas
from ops.grouped_mlp import reference as mlp_reference
from tests.ops.outputs_and_grads import outputs_and_grads

# Small tiles so that a few hundred rows make many tiles and boundaries.
_TILES = {
    # 2 K steps on 2 stages: a block's tiles chain their pipelines.
    "n": configs.MosaicConfig(block_m=64, block_n=128, block_k=32, split="n",
                              max_concurrent_steps=2, epilogue_n=64),
    # 2 K steps on 3 stages: unchained pipelines.
    "m": configs.MosaicConfig(block_m=64, block_n=128, block_k=32, split="m",
                              max_concurrent_steps=3, epilogue_n=64, store_slots=1),
}


_STRADDLING = (50, 0, 70, 60)
_WHOLE_TILES = (128, 0, 64, 108)


def _normal(rng, *shape, dtype=jnp.bfloat16, scale=1.0):
  """A NumPy draw as a device array (an eager `jax.random` call compiles a
  program per shape)."""
  return jnp.asarray((scale * rng.standard_normal(shape, np.float32)).astype(dtype))


@jax.jit
def _ragged_dot_f32(lhs, rhs, sizes):
  return jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)


_group_bounds = jax.jit(reference.group_bounds, static_argnums=1)


def _operands(m, k, n, sizes, *, transpose, seed=0):
  rng = np.random.default_rng(seed)
  lhs = _normal(rng, m, k)
  rhs = _normal(rng, len(sizes), k, n, scale=1 / np.sqrt(k))
  sizes = jnp.asarray(np.asarray(sizes, np.int32))
  want = _ragged_dot_f32(lhs, rhs, sizes)
  rhs_t = jnp.asarray(np.swapaxes(np.asarray(rhs), 1, 2))
  return lhs, (rhs_t if transpose else rhs), sizes, want


def _assert_bf16_close(got, want):
  chex.assert_trees_all_close(got.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)


# A covering set of split x transpose x sizes: every pair of values appears
# once (the warpgroup split decides both which rows of a straddling tile a
# warpgroup stores and how it slices a transposed rhs).
# Straddling: every boundary inside a tile, an empty group, 20 rows after;
# whole tiles: then a boundary.
@pytest.mark.parametrize("split, transpose, sizes", [
    ("n", False, _STRADDLING), ("m", True, _STRADDLING),
    ("n", True, _WHOLE_TILES), ("m", False, _WHOLE_TILES),
], ids=["straddling-n", "straddling-transposed-m", "whole_tiles-transposed-n",
        "whole_tiles-m"])
def test_gmm_matches_ragged_dot(split, transpose, sizes):
  m = 200 if sum(sizes) < 300 else 300
  lhs, rhs, sizes, want = _operands(m, 64, 128, sizes, transpose=transpose)
  _, ends = _group_bounds(sizes, m)
  [got] = mosaic.gmm(lhs, rhs, ends, transpose_rhs=transpose, config=_TILES[split],
                     interpret=True)
  assert got.shape == (m, 128) and got.dtype == jnp.bfloat16
  _assert_bf16_close(got, want)
  # Rows after the last group are zero, not left over.
  np.testing.assert_array_equal(np.asarray(got, np.float32)[int(ends[-1]):], 0.0)


def test_gmm_epilogue_reads_extras_and_writes_several_outputs():
  """Results go to (output, column offset) and extra tiles are read at theirs:
  out0 = acc * e[:, :N], out1[:, N:] = acc + e[:, N:]."""
  m, k, n = 150, 64, 128
  lhs, rhs, sizes, want = _operands(m, k, n, (40, 90, 20), transpose=False, seed=1)
  _, ends = _group_bounds(sizes, m)
  extra = _normal(np.random.default_rng(2), m, 2 * n)
  epilogue = mosaic.Epilogue(
      fn=lambda accs, extras: [accs[0] * extras[0], accs[0] + extras[1]],
      extras=((0, 0), (0, n)), results=((0, 0), (1, n)))
  out0, out1 = mosaic.gmm(
      lhs, rhs, ends, config=_TILES["n"], inputs=[extra],
      outputs=[jax.ShapeDtypeStruct((m, n), jnp.float32),
               jax.ShapeDtypeStruct((m, 2 * n), jnp.float32)],
      epilogue=epilogue, interpret=True)
  e = extra.astype(jnp.float32)
  chex.assert_trees_all_close(out0, want * e[:, :n], atol=2e-2, rtol=2e-2)
  chex.assert_trees_all_close(out1[:, n:], want + e[:, n:], atol=2e-2, rtol=2e-2)


def test_grouped_matmul_values_and_gradients():
  """The op's Pallas path on the Mosaic kernels, the weight gradient's
  (`mosaic_tgmm.py`) included; K and N padded to their tiles."""
  m, k, n = 200, 40, 72
  lhs, rhs, sizes, _ = _operands(m, k, n, _STRADDLING, transpose=False, seed=3)
  starts, ends = _group_bounds(sizes, m)
  cot = _normal(np.random.default_rng(4), m, n)

  def run(fn):
    out, grads = outputs_and_grads(fn, lambda out: cot.astype(out.dtype))(lhs, rhs)
    return (out.astype(jnp.float32), *grads)

  got = run(lambda a, b: gmm_pallas.grouped_matmul_pallas(a, b, starts, ends, mosaic=True,
                                                          mosaic_tgmm=True))
  want = run(lambda a, b: reference.grouped_matmul_reference(
      a.astype(jnp.float32), b.astype(jnp.float32), sizes))
  for g, w in zip(got, want):
    chex.assert_trees_all_close(g.astype(jnp.float32), w.astype(jnp.float32),
                                atol=3e-2, rtol=3e-2)


def test_vmap_over_batches_of_groupings():
  m, k, n = 64, 32, 64
  rng = np.random.default_rng(6)
  lhs, rhs = _normal(rng, 2, m, k), _normal(rng, 2, 2, k, n)
  sizes = jnp.asarray(np.array([[30, 34], [10, 40]], np.int32))

  def fn(a, b, s):
    return gmm_pallas.grouped_matmul_pallas(a, b, *reference.group_bounds(s, m),
                                            mosaic=True)

  got = jax.jit(jax.vmap(fn))(lhs, rhs, sizes)
  for i in range(2):
    want = _ragged_dot_f32(*(jnp.asarray(np.asarray(x)[i]) for x in (lhs, rhs, sizes)))
    _assert_bf16_close(got[i], want)


@pytest.mark.parametrize("activation, fused_on_mosaic, given_tiles", [
    # Every kernel on Mosaic GPU with the tiles it chooses.
    ("swiglu", True, False),
    # Every kernel on Mosaic GPU with the tiles GELU's kernels choose, given
    # (`mosaic_config`): the widths pad to them (128), not to every candidate's.
    ("gelu", True, True),
    # Triton's fused kernels and weight gradients, the plain matmuls on Mosaic GPU
    ("gelu", False, False),
])
def test_grouped_mlp_values_and_gradients(activation, fused_on_mosaic, given_tiles):
  m, d, f, d_out = 200, 64, 96, 48
  rng = np.random.default_rng(5)
  x = _normal(rng, m, d)
  w_in = _normal(rng, 4, d, f * (2 if activation == "swiglu" else 1), dtype=jnp.float32,
                 scale=1 / 8)
  w_out = _normal(rng, 4, f, d_out, dtype=jnp.float32, scale=1 / 8)
  sizes = jnp.asarray(np.asarray(_STRADDLING, np.int32))
  starts, ends = _group_bounds(sizes, m)
  cot = _normal(rng, m, d_out)

  def run(fn):
    out, grads = outputs_and_grads(fn, lambda out: cot.astype(out.dtype))(x, w_in, w_out)
    return (out, *grads)

  got = run(lambda *a: mlp_pallas.grouped_mlp_pallas(
      *a, starts, ends, activation=activation, mosaic=fused_on_mosaic,
      mosaic_plain=True, mosaic_tgmm=fused_on_mosaic,
      mosaic_config=mosaic.choose_config(128) if given_tiles else None))
  want = run(lambda x, *w: mlp_reference.grouped_mlp_reference(
      x.astype(jnp.float32), *w, sizes, activation=activation))
  assert got[0].dtype == jnp.bfloat16
  assert got[2].dtype == got[3].dtype == jnp.float32  # float32 weights' gradients
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    rel = np.linalg.norm(g - w) / np.linalg.norm(w)
    assert rel < 1e-2, rel


def test_float32_is_refused_by_name():
  x = jnp.ones((16, 32), jnp.float32)
  bounds = reference.group_bounds(jnp.array([16], jnp.int32), 16)
  with pytest.raises(ValueError, match="lhs"):
    gmm_pallas.grouped_matmul_pallas(x, jnp.ones((1, 32, 32)), *bounds, mosaic=True)
  with pytest.raises(ValueError, match="`x`"):
    mlp_pallas.grouped_mlp_pallas(x, jnp.ones((1, 32, 32)), jnp.ones((1, 32, 32)),
                                  *bounds, activation="gelu", mosaic=True)


def test_config_validation_and_choice():
  with pytest.raises(ValueError, match="split"):
    configs.MosaicConfig(split="k")
  with pytest.raises(ValueError, match="epilogue_n"):
    configs.MosaicConfig(block_n=64, split="n", epilogue_n=64)
  with pytest.raises(ValueError, match="epilogue_n"):  # 64-byte rows: misaligned TMA
    configs.MosaicConfig(epilogue_n=32)
  with pytest.raises(ValueError, match="block_m"):
    configs.MosaicConfig(block_m=96)
  with pytest.raises(ValueError, match="store_slots"):
    configs.MosaicConfig(store_slots=3)
  budget = mosaic.SMEM_BUDGET
  for accs, extras, out_itemsize in ((1, 0, 2), (1, 1, 2), (2, 0, 2), (1, 2, 2), (1, 0, 4)):
    config = mosaic.choose_config(1024, num_accs=accs, num_extras=extras,
                                  out_itemsize=out_itemsize)
    assert config.smem_bytes(num_accs=accs, num_extras=extras,
                             out_itemsize=out_itemsize) <= budget
    if accs == 2:  # SwiGLU: two accumulators of at most 64 x 128 per warpgroup
      assert config.wg_tile[0] * config.wg_tile[1] <= 64 * 128
  # A narrow N skips the 256-wide tile.
  assert mosaic.choose_config(128).block_n == 128


def test_few_waves_rule_takes_64_row_tiles_only_where_measured_faster(monkeypatch):
  """At M 16384 and N 512 on 132 SMs the 128 x 128 tiles need 5 waves and the
  64 x 256 ones 4; at N 1024 it is 9 against 8, at M 131072 63 against 63."""
  monkeypatch.setattr(mosaic, "num_sms", lambda: 132)
  pick = lambda rows, n, **kw: mosaic.choose_config(n, rows=rows, num_groups=8, **kw)
  assert pick(16384, 512).block_m == 64
  assert pick(16384, 512).smem_bytes(num_accs=1, num_extras=0) <= mosaic.SMEM_BUDGET
  assert pick(16384, 1024).block_m == 128
  assert pick(131072, 1024).block_m == 128
  # Only for plain grouped matmuls: an epilogue's extras or two accumulators
  # keep the preferred tiles.
  assert pick(16384, 512, num_extras=1).block_m == 128
  assert mosaic.choose_config(512).block_m == 128  # rows unknown


def test_preferred_only_for_16_bit_inputs_on_hopper(monkeypatch):
  assert not mosaic.preferred(jnp.bfloat16)  # the CPU
  monkeypatch.setattr(_backend, "on_nvidia_gpu", lambda: True)
  for capability, dtype, want in (("9.0", jnp.bfloat16, True), ("9.0", jnp.float16, True),
                                  ("9.0", jnp.float32, False), ("10.0", jnp.bfloat16, False),
                                  ("8.0", jnp.bfloat16, False)):
    device = types.SimpleNamespace(compute_capability=capability)
    monkeypatch.setattr(jax, "devices", lambda device=device: [device])
    assert mosaic.preferred(dtype) is want, (capability, dtype)
  # The grouped MLP stays on Triton by default (measured faster in the layer).
  assert not mlp_pallas.mosaic_default(jnp.bfloat16)


def _spec(shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("op", ["grouped_matmul", "grouped_matmul_float32_result",
                                "grouped_mlp_swiglu"])
def test_lowers_to_mosaic_gpu_for_hopper(op, hopper_lowering):
  """Interpret mode does not run the Mosaic GPU compiler; lowering for CUDA
  does (shared memory budget, layouts, TMA shapes), without a GPU. A float32
  result doubles the epilogue's store buffers."""
  del hopper_lowering
  sizes = jnp.array([100, 0, 300, 112], jnp.int32)
  bounds = reference.group_bounds(sizes, 512)
  if op.startswith("grouped_matmul"):
    out_dtype = jnp.float32 if op.endswith("float32_result") else None
    fn = lambda x, w: gmm_pallas.grouped_matmul_pallas(x, w, *bounds, mosaic=True,
                                                       out_dtype=out_dtype)
    specs = (_spec((512, 256)), _spec((4, 256, 384)))
  else:
    fn = lambda x, w1, w2: mlp_pallas.grouped_mlp_pallas(
        x, w1, w2, *bounds, activation="swiglu", mosaic=True)
    specs = (_spec((512, 200)), _spec((4, 200, 640), jnp.float32),
             _spec((4, 320, 136), jnp.float32))
  loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32))
  grad = jax.grad(loss, argnums=tuple(range(len(specs))))
  text = jax.jit(grad).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
