"""A model calls each op with the same static arguments in every layer; the
ops call their custom VJPs through `_pallas.shared_lowering`, so the lowered
program holds each kernel once however many times it is called (before, an
unrolled 24-layer Transformer embedded 48 Mosaic GPU attention kernels where
2 are distinct, and compiled for 143 s on an H200). Checked by lowering the
gradient of one call and of three calls for Hopper on the CPU and counting
the kernels' custom calls in the StableHLO text."""

import jax
import jax.numpy as jnp
import pytest

from ops.flex_attention import configs
from tests.ops.test_flex_attention_mosaic import _kernel
from tests.ops.test_shard_map import _cases


def _lowered_text(fn, args, calls: int) -> str:
  def loss(*a):
    return sum(jnp.sum(jnp.sin(fn(*a).astype(jnp.float32))) for _ in range(calls))
  grad = jax.grad(loss, argnums=tuple(range(len(args))))
  return jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("name", ["flex_attention", "ssd", "gated_delta_rule",
                                  "selective_scan", "linear_scan", "grouped_matmul",
                                  "grouped_mlp"])
def test_triton_kernels_are_lowered_once(name, hopper_lowering):
  del hopper_lowering
  fn, args, _ = _cases()[name]
  marker = "__gpu$xla.gpu.triton"
  once = _lowered_text(fn, args, 1).count(marker)
  assert once > 0
  assert _lowered_text(fn, args, 3).count(marker) == once


def test_mosaic_attention_kernels_are_lowered_once(hopper_lowering):
  del hopper_lowering
  config = configs.get_config(64, jnp.bfloat16, interpret=False, generation="sm90")
  attention = _kernel(config, is_causal=True, scale=0.125, interpret=False)
  spec = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  args = [jnp.zeros(spec.shape, spec.dtype)] * 3
  texts = [_lowered_text(attention, args, calls) for calls in (1, 3)]
  for kernel in ("flex_attention_mosaic_fwd", "flex_attention_mosaic_bwd"):
    assert texts[0].count(kernel) > 0, kernel
    assert texts[1].count(kernel) == texts[0].count(kernel), kernel
