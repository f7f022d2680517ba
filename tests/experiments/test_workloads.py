"""experiments.workloads: the attention implementation names that the
benchmarks take map to the configs they say."""

import re

import jax
import numpy as np
import pytest

from experiments import workloads


def test_mosaic_forward_tiles():
  tiles = workloads.mosaic_fwd_tiles("64x128x2_free")
  assert (tiles.block_q, tiles.block_k, tiles.max_concurrent_steps) == (64, 128, 2)
  assert not tiles.ping_pong
  tiles = workloads.mosaic_fwd_tiles("128x128x2")
  assert tiles.ping_pong and not tiles.persistent
  tiles = workloads.mosaic_fwd_tiles("64x128x3_free_persist")
  assert tiles.persistent and not tiles.persistent_right_bounded
  assert not tiles.tensor_core_sums
  assert workloads.mosaic_fwd_tiles("64x256x2_persist_all").persistent_right_bounded
  tiles = workloads.mosaic_fwd_tiles("128x128x2_free_persist_sums")
  assert tiles.tensor_core_sums and tiles.persistent and not tiles.ping_pong
  assert not tiles.prefetch_query and not tiles.frozen_masked_tiles
  tiles = workloads.mosaic_fwd_tiles("64x256x2_free_persist_sums_fm_pq")
  assert tiles.prefetch_query and tiles.frozen_masked_tiles and tiles.query_slots == 2
  with pytest.raises(ValueError, match="Mosaic forward tiles"):
    workloads.mosaic_fwd_tiles("128x128")


def test_mosaic_backward_tiles():
  tiles = workloads.mosaic_bwd_tiles("128x64x3x1x240")
  assert (tiles.block_q, tiles.block_k, tiles.compute_registers) == (128, 64, 240)
  assert (tiles.ds_slots, tiles.pipelined) == (1, False)
  tiles = workloads.mosaic_bwd_tiles("128x64x3_ds2_pipe")
  assert (tiles.max_concurrent_steps, tiles.ds_slots, tiles.pipelined) == (3, 2, True)
  with pytest.raises(ValueError, match="Mosaic backward tiles"):
    workloads.mosaic_bwd_tiles("128x64")


@pytest.mark.parametrize("impl", ["flex", "flex_triton", "flex_triton_128x128x8x3",
                                  "flex_mosaic_64x128x2_free",
                                  "flex_mosaic_bwd_128x64x3", "flex_online",
                                  "flex_refresh_in_kernel", "cudnn", "mha_128x64"])
def test_attention_names_resolve(impl):
  assert callable(workloads.attention_fn(impl, 32, True))


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_chained_attention_keeps_every_call(mode):
  """Each of the chained calls stays in the optimized executable (none merged
  or dropped) and each computes what one call does."""
  fn, args = workloads.attention_case("xla", (1, 2, 16, 8), False, mode, chain=3)()
  one, _ = workloads.attention_case("xla", (1, 2, 16, 8), False, mode)()
  products = lambda f: len(re.findall(r"= \S+ dot\(", f.lower(*args).compile().as_text()))
  assert products(fn) == 3 * products(one) > 0
  last, earlier = fn(*args)
  assert len(earlier) == 2
  for got in (last, *earlier):
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(one(*args))):
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32), rtol=1e-6)


def test_short_attention_shapes_are_chained():
  from experiments import benchmark_kernel_attention as bench
  assert bench.chain_for(8, 8, 1024) == 10  # 2^26 scores: tens of microseconds
  assert bench.chain_for(8, 8, 2048) == bench.chain_for(8, 8, 4096) == 1
