"""Configuration of the selective scan kernels; the tuned values are in
tuned.json, per padded state size."""

import dataclasses

from ops import _shapes
from ops import tuning
from ops._triton import next_pow2


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Tiling of the Triton kernels (pallas.py); a field left None takes the
  tuned value for this device (tuned.json's default entry)."""
  block_d: int | None = None     # channels per program; a power of two
  unroll: int | None = None      # time steps per loop iteration (loaded together,
                                 # one checkpoint each); a power of two
  chunk: int | None = None       # time steps per program; a multiple of `unroll`
  num_warps: int | None = None   # warps per program
  num_stages: int | None = None  # Triton's software pipelining of the loop
  programs: int | None = None    # get_default splits time into chunks until about this
                                 # many programs run
  max_chunks: int | None = None  # ... but into no more than this many chunks

  def __post_init__(self):
    tuning.fill_unset(self, "selective_scan")
    _shapes.check_time_blocks(self)

  @classmethod
  def get_default(cls, batch: int, time: int, width: int, state: int) -> "TritonConfig":
    """The tuned tiles for the padded state size, no wider than the padded
    channels and no longer than the padded sequence, and the chunk that gives
    about `programs` programs."""
    tuned = tuning.tuned("selective_scan", cls, state=next_pow2(state))
    block_d = min(tuned.block_d, next_pow2(width))
    unroll = min(tuned.unroll, next_pow2(time))
    chunk = _shapes.time_chunk(batch, time, width, block_d, unroll, tuned.programs,
                               tuned.max_chunks)
    return dataclasses.replace(tuned, block_d=block_d, unroll=unroll, chunk=chunk)
