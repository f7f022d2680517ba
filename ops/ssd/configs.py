"""Configuration of the SSD kernels; the tuned values are in tuned.json."""

import dataclasses

from ops import tuning
from ops._triton import is_pow2
from ops._triton import next_pow2

_TILES = ("chunk", "state_block_k", "state_block_v", "output_block_v", "grad_block_k",
          "grad_block_v")


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Tiling of the Triton kernels (pallas.py); a field left None takes the
  tuned value for this device (tuned.json)."""
  chunk: int | None = None           # tokens per chunk (L); a power of two >= 16
  state_block_k: int | None = None   # K rows of the state tile in the states kernels
  state_block_v: int | None = None   # V columns of the state tile in the states kernels
  output_block_v: int | None = None  # V columns per program in the output kernel
  grad_block_k: int | None = None    # K columns per program of the keys' chunk gradients
  grad_block_v: int | None = None    # V columns per program of the values' chunk gradients
  num_warps: int | None = None       # warps of the output and chunk-gradient kernels
  state_num_warps: int | None = None  # warps of the states kernels
  state_programs: int | None = None  # the states walk splits its chunks into groups
                                     # until it has about this many programs

  def __post_init__(self):
    tuning.fill_unset(self, "ssd")
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not is_pow2(value):
        raise ValueError(f"`{field.name}` must be a power of two, got {value}")
    for name in _TILES:
      if getattr(self, name) < 16:
        raise ValueError(f"`{name}` must be >= 16 (a tensor-core tile), got "
                         f"{getattr(self, name)}")

  @classmethod
  def get_default(cls, time: int, key: int, value: int,
                  chunk: int | None = None) -> "TritonConfig":
    """The tuned tiles, each no larger than the padded sizes it tiles (and
    the chunk no longer than the padded sequence)."""
    tuned = cls()
    key, value = max(16, next_pow2(key)), max(16, next_pow2(value))
    if chunk is None:
      chunk = min(tuned.chunk, max(16, next_pow2(time)))
    return dataclasses.replace(
        tuned, chunk=chunk, state_block_k=min(tuned.state_block_k, key),
        state_block_v=min(tuned.state_block_v, value),
        output_block_v=min(tuned.output_block_v, value),
        grad_block_k=min(tuned.grad_block_k, key), grad_block_v=min(tuned.grad_block_v, value))
