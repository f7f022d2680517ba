"""The Mosaic GPU weight-gradient kernel (`ops/grouped_matmul/mosaic_tgmm.py`) on
the CPU in Mosaic GPU interpret mode, against a per-group numpy product, and
its lowering for a Hopper GPU. (The grouped ops' gradients with it are in
`test_grouped_matmul_mosaic.py`.)

Interpret mode simulates the warpgroups, the TMA ring and wgmma, so these tests
check the kernel's own indexing: the rows it zeroes in a group's boundary tiles,
empty groups (in the middle and at the end of the rows), rows after the last
group, several K and N blocks, and K and N padded to the tiles.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops import _backend
from ops.grouped_matmul import configs
from ops.grouped_matmul import mosaic_tgmm
from ops.grouped_matmul import pallas as gmm_pallas
from ops.grouped_matmul import reference

# Small tiles so that a few hundred rows make many boundary tiles.
_TILES = configs.MosaicTgmmConfig(block_m=64, block_k=64, block_n=128,
                                  max_concurrent_steps=2)


def _per_group_products(lhs, dout, starts, ends):
  lhs, dout = np.asarray(lhs, np.float32), np.asarray(dout, np.float32)
  return np.stack([lhs[s:e].T @ dout[s:e]
                   for s, e in zip(np.asarray(starts), np.asarray(ends))])


@pytest.mark.parametrize("m, k, n, sizes, out_dtype", [
    # boundaries inside tiles, an empty group, 40 rows after the last group
    (300, 64, 128, (50, 0, 150, 60), jnp.float32),
    # whole tiles, several K and N blocks, an empty group at the end of the rows
    (256, 128, 256, (128, 64, 64, 0), jnp.float32),
    # K and N padded to the tiles, a bfloat16 result
    (200, 100, 200, (0, 90, 20, 90), jnp.bfloat16),
], ids=["straddling", "whole_tiles", "padded"])
def test_tgmm_matches_per_group_products(m, k, n, sizes, out_dtype):
  k1, k2 = jax.random.split(jax.random.key(0))
  lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16)
  dout = jax.random.normal(k2, (m, n), jnp.float32).astype(jnp.bfloat16)
  starts, ends = reference.group_bounds(jnp.asarray(sizes, jnp.int32), m)
  got = mosaic_tgmm.tgmm(lhs, dout, starts, ends, out_dtype=out_dtype, config=_TILES,
                         interpret=True)
  assert got.shape == (len(sizes), k, n) and got.dtype == out_dtype
  want = _per_group_products(lhs, dout, starts, ends)
  # float32 results are the accumulator itself; bfloat16 ones are rounded.
  tol = 1e-4 if out_dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(got, np.float32), want,
                             atol=tol * np.abs(want).max(), rtol=tol)
  for g, size in enumerate(sizes):
    if size == 0:  # written as zeros, not left over
      np.testing.assert_array_equal(np.asarray(got[g], np.float32), 0.0)


def test_refuses_float32_and_mixed_dtypes_by_name():
  bounds = reference.group_bounds(jnp.array([16], jnp.int32), 16)
  with pytest.raises(ValueError, match="`lhs`"):
    mosaic_tgmm.tgmm(jnp.ones((16, 64)), jnp.ones((16, 64)), *bounds, interpret=True)
  with pytest.raises(ValueError, match="`dout`"):
    mosaic_tgmm.tgmm(jnp.ones((16, 64), jnp.bfloat16), jnp.ones((16, 64)), *bounds,
                     interpret=True)


def test_config_validation_and_choice():
  with pytest.raises(ValueError, match="block_k"):
    configs.MosaicTgmmConfig(block_k=96)
  with pytest.raises(ValueError, match="max_concurrent_steps"):
    configs.MosaicTgmmConfig(max_concurrent_steps=1)
  for out_dtype in (jnp.float32, jnp.bfloat16):
    config = mosaic_tgmm.choose_config(out_dtype)
    assert config.smem_bytes(out_dtype) <= mosaic_tgmm.SMEM_BUDGET
    assert config.max_concurrent_steps >= 2
  # 128-byte epilogue rows: 32 float32 or 64 bfloat16 columns.
  assert configs.MosaicTgmmConfig().epilogue_n(jnp.float32) == 32
  assert configs.MosaicTgmmConfig().epilogue_n(jnp.bfloat16) == 64


def test_preferred_follows_the_forward_rule(monkeypatch):
  assert not gmm_pallas.mosaic_tgmm_default(jnp.bfloat16)  # the CPU
  monkeypatch.setattr(_backend, "on_nvidia_gpu", lambda: True)
  for capability, dtype, want in (("9.0", jnp.bfloat16, True),
                                  ("9.0", jnp.float32, False),
                                  ("10.0", jnp.bfloat16, False)):
    device = types.SimpleNamespace(compute_capability=capability)
    monkeypatch.setattr(jax, "devices", lambda device=device: [device])
    assert gmm_pallas.mosaic_tgmm_default(dtype) is want, (capability, dtype)


def test_lowers_to_mosaic_gpu_for_hopper(monkeypatch):
  """Lowering for CUDA runs the Mosaic GPU compiler's own checks (shared memory,
  layouts, TMA shapes) without a GPU, here at the MoE layer's widths."""
  monkeypatch.setattr(_backend, "pallas_interpret", lambda: False)
  sizes = jnp.array([1000, 0, 3000, 96], jnp.int32)
  starts, ends = reference.group_bounds(sizes, 4096)
  specs = [jax.ShapeDtypeStruct((4096, 512), jnp.bfloat16),
           jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)]
  for out_dtype in (jnp.float32, jnp.bfloat16):
    fn = lambda a, b: mosaic_tgmm.tgmm(a, b, starts, ends, out_dtype=out_dtype)
    monkeypatch.setattr(mosaic_tgmm, "num_sms", lambda: 132)
    text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
