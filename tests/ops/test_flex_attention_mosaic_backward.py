"""flex attention's one-launch Mosaic GPU backward (`mosaic_backward.py`) on
the CPU in Mosaic GPU interpret mode, against reference.py; when `prepare`
gives it a call; its lowering for a Hopper GPU.

Interpret mode simulates the three warpgroups, the query-side ring, the
barriers (including the two that hand the shared dS^T tile between the
warpgroups) and wgmma, so these tests check the kernel's indexing, masks and
GQA loop. It has no TMA reductions: there each block writes its dQ terms to
its own slice and XLA sums them; the reduction itself is checked on a GPU
(`benchmark_kernel_attention --check --check_mosaic_bwd ...`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops._mosaic_gpu import SMEM_BUDGET
from ops.flex_attention import configs
from ops.flex_attention import mosaic_backward
from ops.flex_attention import pallas
from tests.ops.test_flex_attention import _vjp
from tests.ops.test_flex_attention_mosaic import _CONFIG as _FORWARD_CONFIG
from tests.ops.test_flex_attention_mosaic import _inputs, _prepared, _reference, _rel, _TOL

_TILES = configs.MosaicBackwardConfig(block_q=64, block_k=64, max_concurrent_steps=2)
_CONFIG = dataclasses.replace(configs.get_config(64, jnp.bfloat16, interpret=True),
                              mosaic_bwd=_TILES)


def _options(is_causal=False, local_window_size=None, key_value_seq_lengths=None):
  return dict(scale=None, is_causal=is_causal, window=local_window_size,
              q_segment_ids=None, kv_segment_ids=None, key_value_seq_lengths=key_value_seq_lengths)


# b, t, s, n, kh, h, dtype, options: causal with a window, key lengths and GQA
# 4:2 (two query heads per block's loop) at H24 (padded to 32, where the
# dS^T tile takes the head's 64-byte swizzle, as wgmma needs both of the dQ
# product's operands swizzled alike); cross attention with T padded to the
# query tile and S to the block's 128 keys (f16, H128); a window on both
# sides at H80 (padded to 128), MQA 4:1. (H64, causal: test_vmap_of_gradients.)
_CASES = {
    "causal_window_lengths_gqa_h24_bf16": (
        2, 150, 150, 4, 2, 24, jnp.bfloat16,
        dict(is_causal=True, local_window_size=(70, 0), key_value_seq_lengths=np.array([150, 77]))),
    "cross_padded_h128_f16": (1, 100, 300, 2, 2, 128, jnp.float16, {}),
    "window_both_sides_mqa_h80_bf16": (1, 128, 256, 4, 1, 80, jnp.bfloat16,
                                       dict(local_window_size=(40, 30))),
}


# Each case runs once, on the default tiles or with one option, so that every
# option meets the case it matters for: the dQ product in two 64-column
# slices at H128 (one slice at H128: the H80 case); two dS^T slots, where each
# warpgroup waits only for the steps whose dQ it forms, with GQA at H24 (the
# slots in the 64-byte swizzle; one slot: the other cases).
@pytest.mark.parametrize("name, tiles", [
    pytest.param(name, tiles, id=name + suffix) for name, tiles, suffix in [
        ("causal_window_lengths_gqa_h24_bf16", dataclasses.replace(_TILES, ds_slots=2),
         "-ds_slots_2"),
        ("window_both_sides_mqa_h80_bf16", _TILES, ""),
        ("cross_padded_h128_f16", dataclasses.replace(_TILES, dq_column_chunks=2),
         "-dq_column_chunks_2"),
    ]])
def test_gradients_match_reference(name, tiles):
  config = dataclasses.replace(_CONFIG, mosaic_bwd=tiles)
  b, t, s, n, kh, h, dtype, options = _CASES[name]
  options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
             for k, v in options.items()}
  q, k, v, w = _inputs(b, t, s, n, kh, h, dtype)
  call = dict(_options(**options), scale=h ** -0.5)
  st, _, _ = _prepared(q.shape, k.shape, dtype, interpret=True, config=config, **call)
  assert st.config.mosaic_bwd == tiles  # this call runs the Mosaic backward
  kernel = lambda q, k, v: pallas.flex_attention_pallas(
      q, k, v, interpret=True, config=config, **call)
  out, grads = jax.jit(functools.partial(_vjp, kernel))(q, k, v, w)
  _, grads_r = jax.jit(functools.partial(_vjp, _reference(**options)))(q, k, v, w)
  for name_, g, g_r in zip(("dq", "dk", "dv"), grads, grads_r):
    assert g.dtype == dtype and g.shape == g_r.shape, name_
    assert not np.isnan(np.asarray(g, np.float32)).any(), name_
    assert _rel(g, g_r) < _TOL[dtype], (name_, _rel(g, g_r))


def test_prepare_gives_it_only_the_calls_it_takes():
  def chosen(shape_q, shape_kv, dtype=jnp.bfloat16, config=_CONFIG, **kw):
    options = dict(_options(), scale=1.0)
    options.update(kw)
    st, q_shape, k_shape = _prepared(shape_q, shape_kv, dtype, interpret=True, config=config,
                                     **options)
    return st.config.mosaic_bwd, q_shape, k_shape

  tiles, q_shape, k_shape = chosen((1, 100, 2, 80), (1, 300, 2, 80))
  assert tiles == _TILES
  # S padded to the block's 2 x 64 keys, T to the query tile, H to 128.
  assert k_shape == (1, 384, 2, 128) and q_shape[1] % 64 == 0
  segments = jnp.zeros((1, 256), jnp.int32)
  for shapes, kw in [
      (((1, 256, 2, 64), (1, 256, 2, 64), jnp.float32), {}),      # not 16-bit
      (((1, 256, 2, 256), (1, 256, 2, 256)), {}),                  # head size 256
      (((1, 40, 2, 64), (1, 256, 2, 64)), {}),                     # T < one query tile
      (((1, 256, 2, 64), (1, 100, 2, 64)), {}),                    # S < the block's keys
      (((1, 256, 2, 64), (1, 256, 2, 64)),
       dict(q_segment_ids=segments, kv_segment_ids=segments)),     # segments
      (((1, 256, 2, 64), (1, 256, 2, 64)), dict(mask_mod=lambda b, n, t, s: t >= s)),
      (((1, 256, 2, 64), (1, 256, 2, 64)), dict(score_mod=lambda x, b, n, t, s: x)),
  ]:
    assert chosen(*shapes, **kw)[0] is None, (shapes, kw)
  # Tiles over the shared-memory budget (128-row query tiles at H128): the
  # Triton backward, not a compile error.
  too_big = dataclasses.replace(_CONFIG, mosaic_bwd=configs.MosaicBackwardConfig(
      block_q=128))
  assert chosen((1, 512, 2, 128), (1, 512, 2, 128), config=too_big)[0] is None
  assert chosen((1, 512, 2, 64), (1, 512, 2, 64), config=too_big)[0] == too_big.mosaic_bwd


def test_table_and_config_checks():
  for h in (32, 64, 128):  # measured faster than the Triton backward on an H200
    tiles = configs.get_config(h, jnp.bfloat16, interpret=False, generation="sm90").mosaic_bwd
    assert tiles is not None and tiles.smem_bytes(h) <= SMEM_BUDGET
  for h, dtype, generation in ((256, jnp.bfloat16, "sm90"), (64, jnp.float32, "sm90"),
                               (64, jnp.bfloat16, "sm80")):
    assert configs.get_config(h, dtype, interpret=False,
                              generation=generation).mosaic_bwd is None
  with pytest.raises(ValueError, match="block_k"):
    configs.MosaicBackwardConfig(block_k=32)
  with pytest.raises(ValueError, match="max_concurrent_steps"):
    configs.MosaicBackwardConfig(max_concurrent_steps=1)
  with pytest.raises(ValueError, match="head sizes"):
    mosaic_backward.check_config(_TILES, 256)
  with pytest.raises(ValueError, match="dq_column_chunks"):
    mosaic_backward.check_config(dataclasses.replace(_TILES, dq_column_chunks=2), 64)
  with pytest.raises(ValueError, match="compute_registers"):
    configs.MosaicBackwardConfig(compute_registers=256)
  with pytest.raises(ValueError, match="ds_slots"):
    configs.MosaicBackwardConfig(ds_slots=3)
  one, two = (configs.MosaicBackwardConfig(block_q=128, ds_slots=n) for n in (1, 2))
  assert two.smem_bytes(32) - one.smem_bytes(32) == 128 * 128 * 2
  registers = configs.MosaicBackwardConfig(compute_registers=240)
  assert 2 * registers.compute_registers + registers.memory_registers <= 504


# The pipelined step (compiled only), with one and two dS^T slots. (The
# table's own tiles at H32, H64 and H128 lower with the Mosaic forward:
# test_flex_attention_mosaic.py::test_lowers_to_mosaic_gpu_for_hopper.)
@pytest.mark.parametrize("head_dim, is_causal, options", [
    (32, True, dict(pipelined=True)), (64, False, dict(pipelined=True, ds_slots=2)),
])
def test_lowers_to_mosaic_gpu_for_hopper(head_dim, is_causal, options, hopper_lowering):
  """Interpret mode does not run the Mosaic GPU compiler; lowering for CUDA
  does (register operands, the transposed dS^T operand, the TMA reduction),
  without a GPU. The table's tiles for the head size, with `options`."""
  del hopper_lowering
  config = configs.get_config(head_dim, jnp.bfloat16, interpret=False, generation="sm90")
  tiles = dataclasses.replace(config.mosaic_bwd, block_q=64, **options)
  config = dataclasses.replace(config, mosaic_bwd=tiles)
  def loss(q, k, v):
    out = pallas.flex_attention_pallas(q, k, v, interpret=False, config=config,
                                       **dict(_options(is_causal=is_causal), scale=0.1))
    return jnp.sum(out.astype(jnp.float32))
  spec_q = jax.ShapeDtypeStruct((2, 512, 4, head_dim), jnp.bfloat16)
  spec_kv = jax.ShapeDtypeStruct((2, 512, 2, head_dim), jnp.bfloat16)
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
      spec_q, spec_kv, spec_kv).lower(lowering_platforms=("cuda",)).as_text()
  assert "flex_attention_mosaic_bwd" in text and "flex_attention_dkdv" not in text


def test_vmap_of_gradients():
  """The kernel's dQ buffer is a `jax.new_ref` operand; vmap batches it. The
  Mosaic GPU forward runs before it, under the same vmap (the forward's only
  vmap test): outputs and gradients."""
  q, k, v, w = _inputs(2, 128, 128, 2, 1, 64, jnp.bfloat16, seed=4)
  call = dict(_options(is_causal=True), scale=0.125)
  config = dataclasses.replace(_FORWARD_CONFIG, mosaic_bwd=_TILES)
  st, _, _ = _prepared((1, 128, 2, 64), (1, 128, 1, 64), jnp.bfloat16, interpret=True,
                       config=config, **call)
  assert st.config.mosaic_fwd is not None and st.config.mosaic_bwd == _TILES
  kernel = lambda q, k, v: pallas.flex_attention_pallas(
      q, k, v, interpret=True, config=config, **call)
  ref = _reference(is_causal=True, scale=0.125)
  def vjp(fn):  # vmap over the batch
    return jax.jit(jax.vmap(functools.partial(_vjp, fn)))(
        q[:, None], k[:, None], v[:, None], w[:, None])
  (out, grads), (out_r, grads_r) = vjp(kernel), vjp(ref)
  for name, x, x_r in [("out", out, out_r), *zip(("dq", "dk", "dv"), grads, grads_r)]:
    assert _rel(x, x_r) < _TOL[jnp.bfloat16], name
