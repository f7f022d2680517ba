"""Backend selection shared by every op.

Each op's `api.py` owns its dispatch rule; this file holds the pieces they all
need: the valid `implementation` values, whether Pallas compiles on this
platform (else it runs in interpret mode), the one error message format for
an input the kernel cannot take, and the measured table that settles
`implementation=None` where the kernel and XLA both take a call: the kernel
only where this device kind's data holds a passing check of it and a
measurement showing it faster (`ops/_measured.py`), XLA everywhere else.
"""

import functools
from typing import Callable, Literal

import jax

from ops import _measured

Implementation = Literal["pallas", "xla"] | None
IMPLEMENTATIONS = (None, "pallas", "xla")


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


def choose(op: str, implementation: Implementation,
           kernel_limit: Callable[[], str | None], **call: int) -> str:
  """Resolves `implementation` to 'pallas' or 'xla' for one call of `op`.

  Args:
    op: the op's public name, for messages (and its table's name).
    implementation: the user's choice (None, 'pallas' or 'xla').
    kernel_limit: returns None when the kernel takes these inputs, otherwise
      a sentence naming the argument and the limit it breaks. Only called when
      the answer matters.
    **call: the call's sizes on the axes of `op`'s measured dispatch table
      (`ops/_measured.py`; key_dim and length for ssd, say).

  Returns:
    'pallas' or 'xla'. None picks, on NVIDIA GPUs where the kernel fits, the
    faster of the two at the measured point that judges the call where this
    device kind's data has both timed and the kernel checked, and XLA
    everywhere else (a GPU without such data, any other platform); it never
    raises for a valid input. 'pallas' raises a ValueError when the kernel
    cannot take the input.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{op}: `implementation` must be one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  if implementation == "xla":
    return "xla"
  if implementation == "pallas":
    limit = kernel_limit()
    if limit is not None:
      raise ValueError(f"{op}(implementation='pallas'): {limit}")
    return "pallas"
  if on_nvidia_gpu() and kernel_limit() is None:
    return _measured.fastest(op, ("pallas", "xla"), **call) or "xla"
  return "xla"
