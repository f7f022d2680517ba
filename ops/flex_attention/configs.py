"""Configuration of the flex-attention kernels; the tuned values are in tuned.json.

`TritonConfig` tiles one Triton launch: the forward and its second pass
(`triton.py`), dK/dV and dQ (`triton_backward.py`). The two Mosaic GPU kernels
have tile sets of their own, hence two classes: `MosaicConfig` (the forward,
`mosaic.py`) and `MosaicBackwardConfig` (the one-launch backward,
`mosaic_backward.py`). `FlexConfig` holds one call's launches and the limits
`pallas.prepare` picks them by; `get_config` reads it from tuned.json.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ops import tuning

_OP = "flex_attention"
FWD_SOFTMAX = ("online", "first_tile_max")
# Where rows past the first-tile maxima's limit are recomputed (`triton.py`).
REFRESH = ("launch", "in_kernel", "auto")
MIN_TRITON_TILE = 16  # a tensor-core tile's rows
# A block of either Mosaic GPU kernel: two compute warpgroups beside the memory
# one (their code is written for two), tiles in steps of wgmma's 64 rows.
NUM_COMPUTE_WGS = 2
_WGMMA_ROWS = 64
# Columns of the ones that `MosaicConfig.tensor_core_sums` multiplies P by:
# wgmma's narrowest 16-bit B operand that a 32-byte swizzle tiles.
SUM_COLUMNS = 16


def register_pool(warpgroups: int) -> int:
  """Registers per thread that a block of `warpgroups` x 128 threads holds
  between its warpgroups: the SM's 65,536 split evenly, in multiples of 8
  (504 for three warpgroups, 512 for four); `setmaxnreg` moves them."""
  return 65536 // (128 * warpgroups) // 8 * 8 * warpgroups


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Tiling of one Triton launch."""
  block_q: int  # query rows per tile (power of two, >= 16)
  block_k: int  # key/value rows per tile (power of two, >= 16)
  num_warps: int  # Triton warps per program
  num_stages: int  # Triton software-pipelining depth of the inner loop

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if value < MIN_TRITON_TILE or value & (value - 1):
        raise ValueError(f"`{name}` must be a power of two >= {MIN_TRITON_TILE}, got {value}")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"`num_warps` must be 1, 2, 4, 8 or 16, got {self.num_warps}")
    if self.num_stages < 1:
      raise ValueError(f"`num_stages` must be >= 1, got {self.num_stages}")


def _check_mosaic_tiles(config) -> None:
  """The tile rules of both Mosaic attention kernels: `block_q` and `block_k`
  multiples of wgmma's rows, a ring of at least two slots."""
  for name in ("block_q", "block_k"):
    value = getattr(config, name)
    if value < _WGMMA_ROWS or value % _WGMMA_ROWS:
      raise ValueError(f"`{name}` must be a multiple of {_WGMMA_ROWS}, got {value}")
  if config.max_concurrent_steps < 2:
    raise ValueError("`max_concurrent_steps` must be >= 2, got "
                     f"{config.max_concurrent_steps}")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiles of the Mosaic GPU forward; a field left None takes the tuned value
  (tuned.json).

  block_q: query rows per compute warpgroup (the block takes twice that).
  block_k: key rows per tile of the ring.
  max_concurrent_steps: slots of the key/value ring.
  ping_pong: the two compute warpgroups take turns on the tensor cores (one's
    softmax under the other's matmuls). False lets both run freely: where the
    softmax is most of a step (small heads), the two softmaxes can then run
    at once, with two warps per SM quarter to hide each other's latencies.
  persistent: one block per SM walks work items (a query tile of one
    (batch, head)) in turn, instead of one block per item. The memory
    warpgroup then streams the next item's key/value tiles while the compute
    warpgroups finish the last one, and each compute warpgroup loads its next
    query tile under its epilogue (`prefetch_query`: under its walk), so the
    per-block start (launch, first loads) and end (output store) are paid
    once per SM. The output is staged in its own buffer (the query buffer is
    being refilled). Items then go to blocks in a fixed order, so
    `pallas.prepare` keeps it for calls whose items have equal work (no right
    bound; causal calls launch one block per item, which the hardware's
    scheduler balances).
  persistent_right_bounded: with `persistent`, walk right-bounded calls
    persistently too: their items then go heaviest first (query tiles
    slowest, from the last), and each round of `num_blocks` items is dealt in
    the opposite direction to the round before, so that a block that took a
    heavy item takes a light one next.
  tensor_core_sums: the softmax's row sums as P @ ones on the tensor cores
    (one more wgmma per key tile, beside P V, into a [block_q, 16]
    accumulator: `SUM_COLUMNS`), as the Triton forward's first-tile-maxima
    tiles do, instead of an add per logit and lane shuffles per tile. At
    small heads the softmax's per-logit instructions, not the tensor cores,
    hold the kernel. It pays on long walks over 256-key tiles (BUILD_NOTES.md,
    "flex_attention").
  frozen_masked_tiles: with `FlexConfig.fwd_softmax='first_tile_max'`, the
    partly masked key tiles after a warpgroup's first open one (a causal
    call's diagonal tiles, a window's right edge, the key lengths' last tile)
    run against the kept maxima too, their closed keys at p = 0, instead of
    online: no row maxima and no rescaling there either. Every row's
    maxima are finite by then (the open tile had a key for each), and a row
    that a later key passes by far is flagged for the second pass as on the
    open tiles.
  prefetch_query: with `persistent`, two query buffers per compute
    warpgroup: each loads its next item's query tile as soon as the current
    one has arrived, so the load runs under the whole walk instead of under
    the last item's epilogue (where a short walk may wait for it). No effect
    with one block per item.
  """
  block_q: int | None = None
  block_k: int | None = None
  max_concurrent_steps: int | None = None
  ping_pong: bool | None = None
  persistent: bool | None = None
  persistent_right_bounded: bool | None = None
  tensor_core_sums: bool | None = None
  frozen_masked_tiles: bool | None = None
  prefetch_query: bool | None = None

  def __post_init__(self):
    tuning.fill_unset(self, _OP)
    _check_mosaic_tiles(self)

  @property
  def rows_per_block(self) -> int:
    return NUM_COMPUTE_WGS * self.block_q

  @property
  def query_slots(self) -> int:
    """Query buffers per compute warpgroup (`prefetch_query`)."""
    return 2 if self.persistent and self.prefetch_query else 1

  def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
    """Shared memory for the query tiles (`query_slots` of them), the
    output tiles, the ring, the lse rows and (`tensor_core_sums`) each
    compute warpgroup's ones, each buffer aligned to 1 KiB (what 128-byte
    swizzles need), and 2 KiB for the barriers and the rest. (64 x 128 x 3
    at H128 counts 232,448 here, over the budget; Mosaic GPU asks 232,568
    for it and refuses it.)"""
    align = lambda n: -(-n // 1024) * 1024
    q = NUM_COMPUTE_WGS * self.block_q * head_dim * itemsize
    ring = self.max_concurrent_steps * self.block_k * head_dim * itemsize
    lse = NUM_COMPUTE_WGS * self.block_q * 4
    out = align(q) if self.persistent else 0  # else the output reuses q's
    q = q * self.query_slots
    ones = NUM_COMPUTE_WGS * self.block_k * SUM_COLUMNS * itemsize
    ones = align(ones) if self.tensor_core_sums else 0
    return align(q) + out + 2 * align(ring) + align(lse) + ones + 2048


@dataclasses.dataclass(frozen=True)
class MosaicBackwardConfig:
  """Tiles of the Mosaic GPU backward; a field left None takes the tuned
  value (tuned.json).

  block_q: query rows per step (the dQ tile).
  block_k: key rows per compute warpgroup (the block takes twice that).
  max_concurrent_steps: slots of the query-side ring.
  dq_column_chunks: the dQ product in this many column slices of >= 64
    (fewer accumulator registers live at once, next to dK and dV).
  compute_registers: registers per thread of each compute warpgroup; the
    memory warpgroup gets what is left of the 504 that three warpgroups of
    one block can hold (232 -> 40, 240 -> 24).
  ds_slots: shared dS^T tiles, 1 or 2. With 2, step t writes slot t % 2 and
    only the warpgroup that forms that step's dQ waits for both halves: the
    other runs on into its next step under the dQ product.
  pipelined: issue S^T and dP^T together and wait for S^T only, so dP^T runs
    under the exponentials; dV's product runs under dS, dK's under the dS^T
    store (compiled only: interpret mode runs the same steps one at a time).
  """
  block_q: int | None = None
  block_k: int | None = None
  max_concurrent_steps: int | None = None
  dq_column_chunks: int | None = None
  compute_registers: int | None = None
  ds_slots: int | None = None
  pipelined: bool | None = None

  def __post_init__(self):
    tuning.fill_unset(self, _OP)
    _check_mosaic_tiles(self)
    if self.dq_column_chunks not in (1, 2):
      raise ValueError(f"`dq_column_chunks` must be 1 or 2, got {self.dq_column_chunks}")
    if self.compute_registers not in (232, 240):
      raise ValueError(f"`compute_registers` must be 232 or 240, got {self.compute_registers}")
    if self.ds_slots not in (1, NUM_COMPUTE_WGS):
      raise ValueError(f"`ds_slots` must be 1 or {NUM_COMPUTE_WGS}, got {self.ds_slots}")

  @property
  def memory_registers(self) -> int:
    return register_pool(NUM_COMPUTE_WGS + 1) - NUM_COMPUTE_WGS * self.compute_registers

  @property
  def keys_per_block(self) -> int:
    return NUM_COMPUTE_WGS * self.block_k

  def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
    """K and V of the block, the Q/dO ring, lse/delta rows, the shared dS^T
    tiles and one f32 dQ tile per compute warpgroup, each aligned to 1 KiB,
    and 2 KiB for the barriers."""
    align = lambda n: -(-n // 1024) * 1024
    kv = 2 * align(self.keys_per_block * head_dim * itemsize)
    ring = 2 * align(self.max_concurrent_steps * self.block_q * head_dim * itemsize)
    rows = 2 * align(self.max_concurrent_steps * self.block_q * 4)
    ds = align(self.ds_slots * self.keys_per_block * self.block_q * itemsize)
    dq = NUM_COMPUTE_WGS * align(self.block_q * head_dim * 4)
    return kv + ring + rows + ds + dq + 2048


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
  the other open tiles: no maxima and no rescaling there; `triton.py`;
  float16 calls and calls with a `score_mod` keep 'online').
  `refresh` is where 'first_tile_max' recomputes the query tiles whose rows
  passed the kept maxima by far: 'launch' (a second launch whose programs
  read the lse of `refresh_tiles_per_program` query tiles each and rerun
  the flagged ones) or 'in_kernel' (the Triton forward reruns the tile
  online at its end, no second launch; the Mosaic forward always launches)
  or 'auto' ('in_kernel' for calls of at most `in_kernel_refresh_max_scores`
  scores (B x N x T x S), where the second launch is a large share of the
  call; `pallas.prepare` decides).
  `mosaic_fwd_min_scores` and `tensor_core_sums_min_scores` leave the calls
  of fewer scores to the Triton forward (calls without a
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
  fwd: TritonConfig
  dkdv: TritonConfig
  dq: TritonConfig
  mosaic_fwd: MosaicConfig | None = None
  mosaic_bwd: MosaicBackwardConfig | None = None
  fwd_softmax: str = "online"
  refresh: str = "launch"
  mosaic_fwd_bounded: MosaicConfig | None = None
  mosaic_fwd_min_scores: int = 0
  tensor_core_sums_min_scores: int = 0
  mosaic_fwd_short_bounded: MosaicConfig | None = None
  mosaic_fwd_bounded_min_scores: int = 0
  # Query tiles whose lse one program of the second launch reads in one load
  # (a power of two; fewer where their number has no such factor).
  refresh_tiles_per_program: int = 1
  # refresh='auto' reruns in the kernel up to this many scores: the rerun saves
  # a launch (fixed) but slows the walk (in proportion to the work).
  in_kernel_refresh_max_scores: int = 0

  def __post_init__(self):
    for name in ("mosaic_fwd_min_scores", "tensor_core_sums_min_scores",
                 "mosaic_fwd_bounded_min_scores", "in_kernel_refresh_max_scores"):
      if getattr(self, name) < 0:
        raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}")
    tiles = self.refresh_tiles_per_program
    if tiles < 1 or tiles & (tiles - 1):
      raise ValueError(f"`refresh_tiles_per_program` must be a power of two, got {tiles}")
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


@dataclasses.dataclass(frozen=True)
class Float32Fallback:
  """How `get_config` gives a float32 call the Triton launches of a 16-bit
  entry, where tuned.json has none for float32: each launch's key tile
  halved (four-byte elements, the same shared memory) and its pipeline cut
  to `max_num_stages`."""
  max_num_stages: int


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
  """The launches for this head size (padded to a power of two) and dtype:
  tuned.json's first entry for (`generation`, default this device's;
  `head_dim_padded`; the dtype, float16 taking the bfloat16 entries;
  `interpret`), or for float32 without an entry of its own the 16-bit
  entry's Triton launches (`Float32Fallback`)."""
  generation = gpu_generation() if generation is None else generation
  return _tuned(generation, head_dim_padded, dtype_key(dtype), interpret)


def dtype_key(dtype) -> str:
  """The "dtype" of the entries for inputs of `dtype`: float16 takes the
  bfloat16 ones (the same tiles for 16-bit floats)."""
  name = jnp.dtype(dtype).name
  return "bfloat16" if name == "float16" else name


@functools.cache
def _tuned(generation: str, head_dim: int, dtype: str, interpret: bool) -> FlexConfig:
  call = dict(generation=generation, head_dim=head_dim, interpret=interpret)
  if (dtype == "float32" and not interpret and not _has_entry(generation, head_dim, dtype)
      and _has_entry(generation, head_dim, "bfloat16")):
    sixteen = tuning.tuned(_OP, FlexConfig, dtype="bfloat16", **call)
    return _float32_launches(sixteen, generation)
  return tuning.tuned(_OP, FlexConfig, dtype=dtype, **call)


def _has_entry(generation: str, head_dim: int, dtype: str) -> bool:
  """Whether tuned.json has a FlexConfig entry for exactly this generation,
  head size and dtype (a measured one, not a default)."""
  key = dict(generation=generation, head_dim=head_dim, dtype=dtype)
  return any(all(entry.get(k) == v for k, v in key.items())
             for entry in tuning.entries(_OP, FlexConfig))


def _float32_launches(sixteen: FlexConfig, generation: str) -> FlexConfig:
  """`sixteen`'s Triton launches for four-byte elements (`Float32Fallback`);
  the Mosaic kernels take 16-bit inputs only."""
  rule = tuning.tuned(_OP, Float32Fallback, generation=generation)
  half = lambda launch: dataclasses.replace(
      launch, block_k=max(MIN_TRITON_TILE, launch.block_k // 2),
      num_stages=min(launch.num_stages, rule.max_num_stages))
  return FlexConfig(half(sixteen.fwd), half(sixteen.dkdv), half(sixteen.dq),
                    refresh_tiles_per_program=sixteen.refresh_tiles_per_program,
                    in_kernel_refresh_max_scores=sixteen.in_kernel_refresh_max_scores)
