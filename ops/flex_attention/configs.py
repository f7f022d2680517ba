"""Block sizes, warps and stages of the flex-attention kernels, per GPU.

One table, keyed by (padded head size, dtype, GPU generation), filled from
`experiments/tune_flex_attention.py` runs; a key the table lacks falls back to
the nearest smaller head size of the same generation, then to `_DEFAULT`.
In interpret mode (CPU) small blocks keep the Python loops short.
"""

import dataclasses

import jax
import jax.numpy as jnp

from ops.flex_attention import mosaic
from ops.flex_attention import mosaic_backward


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Tiling of one kernel launch."""
  block_q: int  # query rows per tile (power of two, >= 16)
  block_k: int  # key/value rows per tile (power of two, >= 16)
  num_warps: int  # Triton warps per program
  num_stages: int  # Triton software-pipelining depth of the inner loop

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(f"`{name}` must be a power of two >= 16, got {value}")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"`num_warps` must be 1, 2, 4, 8 or 16, got {self.num_warps}")
    if self.num_stages < 1:
      raise ValueError(f"`num_stages` must be >= 1, got {self.num_stages}")


FWD_SOFTMAX = ("online", "first_tile_max")
# Where rows past the first-tile maxima's limit are recomputed (`pallas.py`).
REFRESH = ("launch", "in_kernel", "auto")
# refresh='auto' takes 'in_kernel' for calls of at most this many scores
# (B x N x T x S), 'launch' for larger ones: the rerun inside the kernel saves
# a launch (fixed) but slows the walk (in proportion to the work); where they
# cross on an H200: BUILD_NOTES.md, "flex_attention".
IN_KERNEL_REFRESH_MAX_SCORES = 2**24


@dataclasses.dataclass(frozen=True)
class FlexConfig:
  """The three launches of one attention call: forward, dK/dV and dQ.

  `mosaic_fwd`, where set, runs the forward on the Mosaic GPU kernel
  (`mosaic.py`) instead of `fwd`'s Triton one, for the calls it takes
  (`pallas.prepare` decides: 16-bit, no segments or mods, long enough);
  `mosaic_fwd_bounded`, where set, takes its place for the calls whose keys
  are bounded on the right (causal, or a window with a right side), whose
  items have unequal work and may want other tiles.
  `mosaic_bwd` likewise runs the backward on the one-launch Mosaic GPU kernel
  (`mosaic_backward.py`) instead of the `dkdv` and `dq` Triton launches.
  `fwd_softmax` is how the forward (either kernel) keeps its exponentials
  in range: 'online' (the running row maxima, rescaling as they grow) or
  'first_tile_max' (the maxima of the first fully open key tile, kept for
  the other open tiles: no maxima and no rescaling there; `pallas.py`;
  float16 calls and calls with a `score_mod` keep 'online').
  `refresh` is where 'first_tile_max' recomputes the query tiles whose rows
  passed the kept maxima by far: 'launch' (a second launch whose programs
  read the lse of eight query tiles each and rerun the flagged ones) or
  'in_kernel' (the Triton forward reruns the tile online at its end, no
  second launch; the Mosaic forward always launches) or 'auto' ('in_kernel'
  for calls of at most `IN_KERNEL_REFRESH_MAX_SCORES` scores, where the
  second launch is a large share of the call; `pallas.prepare` decides).
  `mosaic_fwd_min_scores` and `tensor_core_sums_min_scores` leave the calls
  of fewer scores (B x N x T x S) to the Triton forward (calls without a
  right bound only: short causal calls measured faster on the Mosaic
  forward), and to the Mosaic forward
  without its row sums on the tensor cores, where short calls measured faster
  that way. `mosaic_fwd_short_bounded`, where set, takes the place of
  `mosaic_fwd_bounded` for the right-bounded calls of fewer than
  `mosaic_fwd_bounded_min_scores` scores (short causal calls have few items
  per SM and measured faster on other tiles). 0: no limit; `forward_on`
  clears the limits and the other tile sets, so that a tile set given there
  is the one that runs.
  """
  fwd: KernelConfig
  dkdv: KernelConfig
  dq: KernelConfig
  mosaic_fwd: mosaic.MosaicForwardConfig | None = None
  mosaic_bwd: mosaic_backward.MosaicBackwardConfig | None = None
  fwd_softmax: str = "online"
  refresh: str = "launch"
  mosaic_fwd_bounded: mosaic.MosaicForwardConfig | None = None
  mosaic_fwd_min_scores: int = 0
  tensor_core_sums_min_scores: int = 0
  mosaic_fwd_short_bounded: mosaic.MosaicForwardConfig | None = None
  mosaic_fwd_bounded_min_scores: int = 0

  def __post_init__(self):
    for name in ("mosaic_fwd_min_scores", "tensor_core_sums_min_scores",
                 "mosaic_fwd_bounded_min_scores"):
      if getattr(self, name) < 0:
        raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}")
    if self.fwd_softmax not in FWD_SOFTMAX:
      raise ValueError(f"`fwd_softmax` must be one of {FWD_SOFTMAX}, got {self.fwd_softmax!r}")
    if self.refresh not in REFRESH:
      raise ValueError(f"`refresh` must be one of {REFRESH}, got {self.refresh!r}")

  def forward_on(self, mosaic_fwd) -> "FlexConfig":
    """This config with every call's forward on the Mosaic tiles `mosaic_fwd`
    (None: on the Triton kernel), right-bounded and short calls included."""
    return dataclasses.replace(self, mosaic_fwd=mosaic_fwd, mosaic_fwd_bounded=None,
                               mosaic_fwd_min_scores=0, tensor_core_sums_min_scores=0,
                               mosaic_fwd_short_bounded=None,
                               mosaic_fwd_bounded_min_scores=0)

  @property
  def keeps_first_tile_max(self) -> bool:
    """Whether the forward keeps its first open tile's row maxima."""
    return self.fwd_softmax == "first_tile_max"


def _mosaic_tiles(cls, fields):
  """A Mosaic config from a tuple or a dict of its fields, or None."""
  if fields is None:
    return None
  return cls(**fields) if isinstance(fields, dict) else cls(*fields)


def _c(fwd, dkdv, dq, mosaic_fwd=None, mosaic_bwd=None, fwd_softmax="online",
       refresh="launch", mosaic_fwd_bounded=None, mosaic_fwd_short_bounded=None,
       **limits) -> FlexConfig:
  forward_tiles = lambda fields: _mosaic_tiles(mosaic.MosaicForwardConfig, fields)
  return FlexConfig(
      KernelConfig(*fwd), KernelConfig(*dkdv), KernelConfig(*dq),
      forward_tiles(mosaic_fwd),
      _mosaic_tiles(mosaic_backward.MosaicBackwardConfig, mosaic_bwd),
      fwd_softmax, refresh, forward_tiles(mosaic_fwd_bounded),
      mosaic_fwd_short_bounded=forward_tiles(mosaic_fwd_short_bounded), **limits)


# (block_q, block_k, num_warps, num_stages) for fwd, dkdv, dq.
# Keys: (padded head size, dtype name, generation). 'sm90' = Hopper (H100/H200).
# The Triton tiles are `experiments/tune_flex_attention.py` winners on an H200;
# the dK/dV block_k is the program's key tile and block_q its loop tile.
# The fourth entry, (block_q, block_k, max_concurrent_steps) or a dict of
# `MosaicForwardConfig`'s fields, puts the 16-bit forward on the Mosaic GPU
# kernel (`mosaic.py`); `mosaic_fwd_bounded` and `mosaic_fwd_short_bounded`
# give right-bounded calls (causal, a window with a right side) tiles of their
# own, and the score limits send short calls elsewhere (`FlexConfig`).
# The fifth entry, (block_q, block_k, max_concurrent_steps[, dq_column_chunks[,
# compute_registers]]) or a dict, puts the 16-bit backward on the one-launch
# Mosaic GPU kernel (`mosaic_backward.py`).
# Each choice is the fastest of same-process timings on an H200; the gain
# behind each, and what lost: BUILD_NOTES.md, "flex_attention", "Tiles".
_TABLE: dict[tuple[int, str, str], FlexConfig] = {
    (32, "bfloat16", "sm90"): _c((128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3),
                                 dict(block_q=64, block_k=256, max_concurrent_steps=2,
                                      ping_pong=False, persistent=True,
                                      tensor_core_sums=True),
                                 dict(block_q=128, block_k=64, max_concurrent_steps=3,
                                      ds_slots=2, pipelined=True),
                                 fwd_softmax="first_tile_max", refresh="auto",
                                 mosaic_fwd_bounded=dict(block_q=128, block_k=128,
                                                         max_concurrent_steps=2,
                                                         ping_pong=False),
                                 mosaic_fwd_min_scores=2**26,
                                 tensor_core_sums_min_scores=2**29),
    (64, "bfloat16", "sm90"): _c((64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3),
                                 dict(block_q=64, block_k=256, max_concurrent_steps=2,
                                      persistent=True), (128, 64, 2),
                                 fwd_softmax="first_tile_max",
                                 mosaic_fwd_bounded=dict(block_q=64, block_k=256,
                                                         max_concurrent_steps=2,
                                                         frozen_masked_tiles=True),
                                 mosaic_fwd_short_bounded=dict(
                                     block_q=64, block_k=128, max_concurrent_steps=2,
                                     persistent=True, persistent_right_bounded=True,
                                     frozen_masked_tiles=True, prefetch_query=True),
                                 mosaic_fwd_bounded_min_scores=2**30),
    (128, "bfloat16", "sm90"): _c((64, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3),
                                  dict(block_q=64, block_k=128, max_concurrent_steps=2,
                                       persistent=True), (64, 64, 2, 2, 240),
                                  fwd_softmax="first_tile_max"),
    (256, "bfloat16", "sm90"): _c((64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 3),
                                  (64, 64, 2), fwd_softmax="first_tile_max"),
    # Halving the 16-bit entry's key tiles would ask 311,296 bytes of shared
    # memory in the float32 dQ kernel; these fit.
    (256, "float32", "sm90"): _c((64, 16, 4, 2), (32, 32, 4, 1), (64, 16, 4, 1)),
}

# For any GPU and head size the table does not cover.
_DEFAULT = _c((64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2))
_DEFAULT_LARGE_HEAD = _c((64, 32, 4, 2), (32, 32, 4, 1), (32, 32, 4, 1))  # H > 128
_INTERPRET = _c((32, 32, 4, 1), (32, 32, 4, 1), (32, 32, 4, 1))


def gpu_generation() -> str:
  """'sm90' style name of the default device, or 'cpu'."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return "cpu"
  capability = getattr(device, "compute_capability", None)
  if capability is None:
    return "gpu"
  return "sm" + str(capability).replace(".", "")


def get_config(head_dim_padded: int, dtype, *, interpret: bool,
               generation: str | None = None) -> FlexConfig:
  """The tiling for this head size (padded to a power of two) and dtype."""
  if interpret:
    return _INTERPRET
  generation = gpu_generation() if generation is None else generation
  name = jnp.dtype(dtype).name
  name = "bfloat16" if name == "float16" else name  # Same tiles for 16-bit floats.
  if (head_dim_padded, name, generation) in _TABLE:
    return _TABLE[(head_dim_padded, name, generation)]
  if name == "float32" and (head_dim_padded, "bfloat16", generation) in _TABLE:
    # Four-byte elements: halve the key tile to keep shared memory in budget.
    c = _TABLE[(head_dim_padded, "bfloat16", generation)]
    half = lambda k: dataclasses.replace(k, block_k=max(16, k.block_k // 2),
                                         num_stages=min(k.num_stages, 2))
    return FlexConfig(half(c.fwd), half(c.dkdv), half(c.dq))
  return _DEFAULT_LARGE_HEAD if head_dim_padded > 128 else _DEFAULT
