"""Configuration of the gated delta rule's kernels; the tuned values are in
tuned.json (the Triton tiles per padded state size K x V)."""

import dataclasses

from ops import tuning
from ops._triton import is_pow2
from ops._triton import next_pow2

_OP = "gated_delta_rule"
_NULLABLE = ("state_block_v", "mosaic_walk", "mosaic_grads", "mosaic_key_grads")
_POW2 = ("chunk", "block_v", "state_block_v", "num_warps", "state_num_warps",
         "prepare_num_warps", "inverse_block", "grad_block_k", "value_grad_num_warps",
         "key_grad_num_warps")
_TILES = ("chunk", "block_v", "state_block_v", "grad_block_k")
_SMALLEST = 16  # rows or columns of a tile at the least: a tensor-core tile


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Tiling of the Triton kernels (triton.py), and which of their launches run
  on the Mosaic GPU kernels instead; a field left None takes the tuned value
  for this device (tuned.json's default entry), whose nulls keep the meanings
  of None given below."""
  chunk: int | None = None              # tokens per chunk (L); a power of two >= 16
  block_v: int | None = None            # V columns of one step of the output/gradient
                                        # kernels' loop over V (and of a states program,
                                        # unless state_block_v says otherwise)
  num_warps: int | None = None          # warps of the output kernel
  state_num_warps: int | None = None    # warps of the states kernels
  prepare_num_warps: int | None = None  # warps of the prepare kernel
  state_block_v: int | None = None      # V columns of a states program (None: block_v)
  grad_num_stages: int | None = None    # Triton pipeline stages of the gradient kernels' loops
  grad_block_k: int | None = None       # K columns of a key-gradient program
  value_grad_num_warps: int | None = None  # warps of the value-gradient kernel
  key_grad_num_warps: int | None = None    # warps of the key-gradient kernel
  inverse_block: int | None = None      # rows of the diagonal blocks of the (I + A)^-1
                                        # substitution, merged after it
  mosaic_walk: bool | None = None       # both state walks on the Mosaic GPU kernels
                                        # (mosaic.py); None: wherever they run
                                        # compiled (Hopper, 16-bit, K = V = 128,
                                        # chunks of 16 to 32)
  mosaic_grads: bool | None = None      # all chunk gradients (value and key) on one
                                        # Mosaic GPU kernel (mosaic_grads.py); None:
                                        # where the walks run, it takes the chunk,
                                        # every head has its own keys and
                                        # mosaic_key_grads is not asked for
                                        # (32 tokens; faster than the value + key
                                        # gradient kernels there)
  mosaic_key_grads: bool | None = None  # the key gradients alone on a Mosaic GPU
                                        # kernel (mosaic_key_grads.py); None:
                                        # where the walks run and mosaic_grads not
  num_stages: int | None = None         # Triton pipeline stages of the output kernel's loop
  state_num_stages: int | None = None   # ... of the states kernels' walks
  prepare_num_stages: int | None = None  # ... of the prepare kernel

  def __post_init__(self):
    tuning.fill_unset(self, _OP)
    for field in dataclasses.fields(self):
      if getattr(self, field.name) is None and field.name not in _NULLABLE:
        raise ValueError(f"`{field.name}` has no tuned value in ops/{_OP}/tuned.json")
    for name in _POW2:
      value = getattr(self, name)
      if value is not None and not is_pow2(value):
        raise ValueError(f"`{name}` must be a power of two, got {value}")
    for name in _TILES:
      value = getattr(self, name)
      if value is not None and value < _SMALLEST:
        raise ValueError(f"`{name}` must be >= {_SMALLEST}, got {value}")
    if not 2 <= self.inverse_block <= self.chunk:
      raise ValueError(f"`inverse_block` must be between 2 and `chunk` ({self.chunk}),"
                       f" got {self.inverse_block}")
    for name in ("grad_num_stages", "num_stages", "state_num_stages", "prepare_num_stages"):
      if getattr(self, name) < 1:
        raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")

  @classmethod
  def get_default(cls, time: int, key: int, value: int,
                  chunk: int | None = None) -> "TritonConfig":
    """The tuned tiles for the padded state size, each no larger than the
    padded size it tiles (and the chunk no longer than the padded sequence)."""
    key, value = max(_SMALLEST, next_pow2(key)), max(_SMALLEST, next_pow2(value))
    tuned = tuning.tuned(_OP, cls, key=key, value=value, state_size=key * value)
    if chunk is None:
      chunk = min(tuned.chunk, max(_SMALLEST, next_pow2(time)))
    state_block_v = None if tuned.state_block_v is None else min(tuned.state_block_v, value)
    return dataclasses.replace(tuned, chunk=chunk, block_v=min(tuned.block_v, value),
                               state_block_v=state_block_v,
                               grad_block_k=min(tuned.grad_block_k, key))


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Depths of the shared-memory rings the Mosaic GPU kernels stream their
  operands through (one knob per kernel, so one class for the three); a
  field left None takes the tuned value for this device (tuned.json)."""
  walk_slots: int | None = None         # chunks in the state walks' ring (mosaic.py)
  chunk_grads_slots: int | None = None  # V-half units in the chunk-gradient kernel's row
                                        # ring at the most (mosaic_grads.py; fewer where
                                        # shared memory runs out)
  key_grads_slots: int | None = None    # V-half units in the key-gradient kernel's ring
                                        # (mosaic_key_grads.py)

  def __post_init__(self):
    tuning.fill_unset(self, _OP)
    for field in dataclasses.fields(self):
      if getattr(self, field.name) < 2:
        raise ValueError(f"`{field.name}` must be >= 2, got {getattr(self, field.name)}")
