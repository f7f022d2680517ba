"""Pieces every Mosaic GPU (Hopper) kernel of the library needs.

The grouped matmuls (`ops/grouped_matmul/mosaic*.py`) and the attention forward
(`ops/flex_attention/mosaic.py`) share them: the shared-memory transforms that
TMA and wgmma want, the number of SMs a persistent grid spans, and the rule
for when a Mosaic GPU kernel applies at all.
"""

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from ops import _backend

# Hopper's 227 KiB of shared memory per block, less room for the barriers.
SMEM_BUDGET = 232448 - 1024

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def swizzled(dtype, minor: int):
  """Tiling and swizzle transforms for a shared-memory tile with `minor` columns."""
  swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def num_sms() -> int:
  device = jax.devices()[0]
  return getattr(device, "core_count", None) or 132


def on_hopper() -> bool:
  """Whether the default device is a Hopper GPU (compute capability 9.x), the
  generation whose wgmma and TMA the kernels are written for."""
  if not _backend.on_nvidia_gpu():
    return False
  capability = str(getattr(jax.devices()[0], "compute_capability", "0"))
  return capability.split(".")[0] == "9"


def takes(dtype) -> bool:
  """Whether a Mosaic GPU kernel should run on inputs of this dtype here:
  16-bit floats on a Hopper GPU."""
  return jnp.dtype(dtype) in DTYPES and on_hopper()
