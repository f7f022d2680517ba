"""experiments.workloads: the typed attention implementations the benchmarks
time, and the configs their flags parse."""

import dataclasses
import re

from absl import app
from absl import flags
from absl.testing import flagsaver
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import workloads
from ops.flex_attention import configs


def test_parse_config_takes_a_json_object_of_fields():
  tiles = workloads.parse_config(configs.MosaicConfig,
                                 '{"block_k": 256, "ping_pong": false, "persistent": true}')
  assert tiles == configs.MosaicConfig(block_k=256, ping_pong=False, persistent=True)
  assert workloads.parse_config(configs.TritonConfig, dict(
      block_q=64, block_k=32, num_warps=4, num_stages=2)) == configs.TritonConfig(64, 32, 4, 2)
  with pytest.raises(ValueError, match=r"no field \['pipelined'\]"):
    workloads.parse_config(configs.MosaicConfig, '{"pipelined": true}')
  with pytest.raises(ValueError, match="JSON object"):
    workloads.parse_config(configs.MosaicConfig, "[64, 128]")
  with pytest.raises(ValueError, match="multiple of 64"):  # the config's own checks
    workloads.parse_config(configs.MosaicConfig, '{"block_q": 32}')


def test_names_label_what_runs():
  tiles = configs.MosaicConfig(block_k=256, persistent=True)
  assert workloads.FlexMosaicForward(tiles).name == (
      "flex_mosaic_fwd(block_k=256, persistent=True)")
  assert workloads.FlexMosaicForward(tiles, "online").name.endswith(")_online")
  backward = configs.MosaicBackwardConfig(block_q=128, ds_slots=2, pipelined=True)
  assert workloads.FlexMosaicBackward(backward).name == (
      "flex_mosaic_bwd(block_q=128, ds_slots=2, pipelined=True)")
  assert workloads.FlexTritonForward(configs.TritonConfig(128, 64, 4, 3), "online").name == (
      "flex_triton_128x64x4x3_online")
  assert [m.name for m in workloads.MHA_SWEEP] == ["mha_default", "mha_128x64", "mha_64x128"]
  assert all(name == impl.name for name, impl in workloads.ATTENTION.items())
  with pytest.raises(ValueError, match="mod"):
    workloads.Flex("causal")


@pytest.mark.parametrize("name", list(workloads.ATTENTION))
def test_every_named_implementation_builds(name):
  impl = workloads.ATTENTION[name]
  assert callable(impl.fn(32, True))
  want = "float16" if name.startswith("mgpu") else "bfloat16"
  assert jnp.dtype(impl.input_dtype).name == want


def test_flex_variants_run_on_the_configs_they_name(monkeypatch):
  """Each variant's call gets the H32 table entry with its fields replaced;
  given Mosaic forward tiles run every call (the bounded and short-call
  tiles and limits cleared)."""
  monkeypatch.setattr(configs, "gpu_generation", lambda: "sm90")
  seen = []
  monkeypatch.setattr(workloads.flex_pallas, "flex_attention_pallas",
                      lambda q, k, v, *, config, **kw: seen.append(config) or q)
  table = configs.get_config(32, jnp.bfloat16, interpret=False)
  q = jnp.zeros((1, 64, 2, 32), jnp.bfloat16)
  def config_of(impl):
    impl.fn(32, True)(q, q, q)
    return seen.pop()
  tiles = configs.TritonConfig(64, 32, 4, 2)
  got = config_of(workloads.FlexTritonForward(tiles, "online"))
  assert (got.mosaic_fwd, got.mosaic_fwd_bounded, got.fwd, got.fwd_softmax) == (
      None, None, tiles, "online")
  assert got.mosaic_bwd == table.mosaic_bwd
  forward = configs.MosaicConfig(block_k=256, persistent=True)
  got = config_of(workloads.FlexMosaicForward(forward))
  assert got == table.forward_on(forward) and got.mosaic_fwd_min_scores == 0
  backward = configs.MosaicBackwardConfig(block_q=128)
  assert config_of(workloads.FlexMosaicBackward(backward)) == dataclasses.replace(
      table, mosaic_bwd=backward)
  assert config_of(workloads.FlexRefresh("in_kernel")).refresh == "in_kernel"
  assert config_of(workloads.FlexForwardSoftmax("online")) == dataclasses.replace(
      table, fwd_softmax="online")


def test_benchmark_flags_give_typed_implementations():
  from experiments import benchmark_kernel_attention as bench
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(
      impls=["flex", "cudnn", "mha"], mha_sweep=False,
      triton_fwd=['{"block_q": 64, "block_k": 32, "num_warps": 4, "num_stages": 2}'],
      mosaic_fwd=['{"block_k": 256, "persistent": true, "fwd_softmax": "online"}'],
      mosaic_bwd=['{"block_q": 128, "ds_slots": 2, "pipelined": true}']):
    impls = bench.implementations()
  assert impls == [
      workloads.Flex(), workloads.JaxAttention("cudnn"), workloads.PallasMha(),
      workloads.FlexTritonForward(configs.TritonConfig(64, 32, 4, 2)),
      workloads.FlexMosaicForward(configs.MosaicConfig(block_k=256, persistent=True),
                                  fwd_softmax="online"),
      workloads.FlexMosaicBackward(configs.MosaicBackwardConfig(
          block_q=128, ds_slots=2, pipelined=True))]
  assert [bench._family(i) for i in impls] == [
      None, None, "mha", None, "flex_mosaic", "flex_mosaic_bwd"]
  with flagsaver.flagsaver(impls=["flex_mosaic_64x128x2"]):
    with pytest.raises(app.UsageError, match="unknown"):
      bench.implementations()


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_chained_attention_keeps_every_call(mode):
  """Each of the chained calls stays in the optimized executable (none merged
  or dropped) and each computes what one call does."""
  xla = workloads.JaxAttention("xla")
  fn, args = workloads.attention_case(xla, (1, 2, 16, 8), False, mode, chain=3)()
  one, _ = workloads.attention_case(xla, (1, 2, 16, 8), False, mode)()
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
