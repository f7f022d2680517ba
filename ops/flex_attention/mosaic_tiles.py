"""Tile configs and limits of the Mosaic GPU attention kernels.

`MosaicForwardConfig` (the forward, `mosaic.py`) and the rules both kernels'
configs follow (`mosaic_backward.py` has its own config): rows in multiples of
wgmma's 64, the register pool a block's warpgroups share, shared memory.
"""

import dataclasses

from ops._mosaic_gpu import SMEM_BUDGET

NUM_COMPUTE_WGS = 2  # Query-row warpgroups per block, beside the memory one.
# Columns of the ones that `MosaicForwardConfig.tensor_core_sums` multiplies P
# by: wgmma's narrowest 16-bit B operand that a 32-byte swizzle tiles.
SUM_COLUMNS = 16
HEAD_SIZES = (32, 64, 128, 256)  # Padded head sizes the kernel takes.


def register_pool(warpgroups: int) -> int:
  """Registers per thread that a block of `warpgroups` x 128 threads holds
  between its warpgroups: the SM's 65,536 split evenly, in multiples of 8
  (504 for three warpgroups, 512 for four); `setmaxnreg` moves them. Shared
  with the backward (`mosaic_backward.py`)."""
  return 65536 // (128 * warpgroups) // 8 * 8 * warpgroups


# The forward's registers per thread: 40 for the memory warpgroup, and what it
# leaves of the block's pool for each compute one, in multiples of 8 (232).
MEMORY_REGISTERS = 40
COMPUTE_REGISTERS = ((register_pool(NUM_COMPUTE_WGS + 1) - MEMORY_REGISTERS)
                     // NUM_COMPUTE_WGS // 8 * 8)


@dataclasses.dataclass(frozen=True)
class MosaicForwardConfig:
  """Tiles of the Mosaic GPU forward.

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
  block_q: int = 64
  block_k: int = 128
  max_concurrent_steps: int = 2
  ping_pong: bool = True
  persistent: bool = False
  persistent_right_bounded: bool = False
  tensor_core_sums: bool = False
  frozen_masked_tiles: bool = False
  prefetch_query: bool = False

  def __post_init__(self):
    check_tiles(self)

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
    swizzles need), and 2 KiB for the barriers and the rest. (64 x 128 x 3 at H128 counts 232,448 here, over the budget;
    Mosaic GPU asks 232,568 for it and refuses it.)"""
    align = lambda n: -(-n // 1024) * 1024
    q = NUM_COMPUTE_WGS * self.block_q * head_dim * itemsize
    ring = self.max_concurrent_steps * self.block_k * head_dim * itemsize
    lse = NUM_COMPUTE_WGS * self.block_q * 4
    out = align(q) if self.persistent else 0  # else the output reuses q's
    q = q * self.query_slots
    ones = NUM_COMPUTE_WGS * self.block_k * SUM_COLUMNS * itemsize
    ones = align(ones) if self.tensor_core_sums else 0
    return align(q) + out + 2 * align(ring) + align(lse) + ones + 2048


def check_tiles(config) -> None:
  """The tile rules of both Mosaic attention kernels: `block_q` and `block_k`
  multiples of 64 (wgmma's rows), a ring of at least two slots."""
  for name in ("block_q", "block_k"):
    value = getattr(config, name)
    if value < 64 or value % 64:
      raise ValueError(f"`{name}` must be a multiple of 64, got {value}")
  if config.max_concurrent_steps < 2:
    raise ValueError("`max_concurrent_steps` must be >= 2, got "
                     f"{config.max_concurrent_steps}")


def config_limit(config, head_dim: int, *, kernel: str, head_sizes) -> str | None:
  """None when `config` (a tile config with `smem_bytes`) runs at this padded
  head size, else the reason; shared with the backward (`mosaic_backward.py`)."""
  if head_dim not in head_sizes:
    return (f"the Mosaic GPU attention {kernel} takes padded head sizes "
            f"{head_sizes}, got {head_dim}")
  if config.smem_bytes(head_dim) > SMEM_BUDGET:
    return (f"{config} needs {config.smem_bytes(head_dim)} bytes of shared "
            f"memory at head size {head_dim}, more than {SMEM_BUDGET}")
  return None
