"""Where this library's kernels compile: NVIDIA GPUs (Pallas interpret mode
elsewhere). Which implementation runs is each op's registry's choice
(`ops/registry.py`)."""

import functools

import jax


@functools.cache
def on_nvidia_gpu() -> bool:
  """True when the default device is an NVIDIA GPU (Pallas compiles there)."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return False
  version = getattr(device.client, "platform_version", "")
  return "cuda" in version.lower() or "nvidia" in device.device_kind.lower()


def pallas_interpret() -> bool:
  """Pallas runs compiled on NVIDIA GPUs and in interpret mode elsewhere."""
  return not on_nvidia_gpu()
