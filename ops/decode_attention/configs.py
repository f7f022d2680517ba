"""Configuration of the decode kernel; the tuned values are in tuned.json."""

import dataclasses

import jax

from ops import _backend
from ops import _shapes
from ops import tuning
from ops._triton import next_pow2

# An H200's multiprocessors (SMs); the device's own count is used on a GPU.
DEFAULT_MULTIPROCESSORS = 132


def multiprocessors() -> int:
  """The default GPU's multiprocessor count (an H200's off a GPU)."""
  if _backend.on_nvidia_gpu():
    return getattr(jax.devices()[0], "core_count", DEFAULT_MULTIPROCESSORS)
  return DEFAULT_MULTIPROCESSORS


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Tiling of the decode kernel (pallas.py) and how a call's split count and
  warps are chosen (`get_default`). A field left None takes the tuned value for
  this device (tuned.json), but `num_splits`: None chooses it per call."""
  block_k: int | None = None     # keys per tile of a program's loop (a power of two >= 16)
  num_splits: int | None = None  # chunks per (sequence, key/value head); fewer when S is short
  num_warps: int | None = None   # Triton warps per program
  num_stages: int | None = None  # Triton software-pipelining depth of the loop
  # A program whose [Mp, Hp] queries hold more values runs `wide_num_warps`
  # (its float32 accumulator lives in registers).
  wide_tile_elements: int | None = None
  wide_num_warps: int | None = None
  # Programs per multiprocessor the split count aims for: a memory-bound loop
  # needs several resident programs per SM to keep enough loads in flight.
  programs_per_multiprocessor: int | None = None
  # The fewest key tiles a chunk holds: shorter chunks spend more on loading
  # the queries and storing the partial results than on the cache.
  min_tiles_per_split: int | None = None

  def __post_init__(self):
    if any(getattr(self, name) is None for name in _TUNED):
      tuning.fill_unset(self, "decode_attention")
    if self.block_k < 16 or self.block_k & (self.block_k - 1):
      raise ValueError(f"`block_k` must be a power of two >= 16, got {self.block_k}")
    if self.num_splits is not None and self.num_splits < 1:
      raise ValueError(f"`num_splits` must be >= 1, got {self.num_splits}")
    for name in ("num_warps", "wide_num_warps"):
      if getattr(self, name) not in (1, 2, 4, 8, 16):
        raise ValueError(f"`{name}` must be 1, 2, 4, 8 or 16, got {getattr(self, name)}")
    if self.num_stages < 1:
      raise ValueError(f"`num_stages` must be >= 1, got {self.num_stages}")
    for name in ("wide_tile_elements", "programs_per_multiprocessor", "min_tiles_per_split"):
      if getattr(self, name) < 1:
        raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")

  @classmethod
  def get_default(cls, *, batch: int, kv_heads: int, seq_kv: int, rows: int,
                  head_dim: int, interpret: bool) -> "TritonConfig":
    """The tiling for B sequences of K key/value heads, S cache slots and M
    rows (padded) of Hp (padded head size) per program: the tuned entry for
    the head size (interpret mode has its own, whose short tiles still split
    the tests' small caches), its wide warps for a wide program, and the
    split count for the call."""
    tuned = tuning.tuned("decode_attention", cls, interpret=interpret,
                         head_dim=max(16, next_pow2(head_dim)))
    if rows * head_dim > tuned.wide_tile_elements:
      tuned = dataclasses.replace(tuned, num_warps=tuned.wide_num_warps)
    return tuned.split_for(batch=batch, kv_heads=kv_heads, seq_kv=seq_kv)

  def split_for(self, *, batch: int, kv_heads: int, seq_kv: int) -> "TritonConfig":
    """This tiling, with the split count chosen for B sequences of K key/value
    heads and S cache slots where `num_splits` is None: enough programs for
    `programs_per_multiprocessor` on every multiprocessor, chunks of at least
    `min_tiles_per_split` tiles, at least one."""
    if self.num_splits is not None:
      return self
    wanted = self.programs_per_multiprocessor * multiprocessors()
    splits = _shapes.cdiv(wanted, batch * kv_heads)
    splits = max(1, min(splits, seq_kv // (self.min_tiles_per_split * self.block_k)))
    return dataclasses.replace(self, num_splits=splits)


# The fields a tuned entry gives (every one but the per-call split count).
_TUNED = tuple(f.name for f in dataclasses.fields(TritonConfig) if f.name != "num_splits")
