"""Tile configs and limits of the Mosaic GPU attention kernels.

`MosaicForwardConfig` (the forward, `mosaic.py`) and the rules both kernels'
configs follow (`mosaic_backward.py` has its own config): rows in multiples of
wgmma's 64, the register pool a block's warpgroups share, shared memory.
"""

import dataclasses

from ops._mosaic_gpu import SMEM_BUDGET

NUM_COMPUTE_WGS = 2  # The default; `MosaicForwardConfig.compute_warpgroups`.
# Columns of the ones that `MosaicForwardConfig.tensor_core_sums` multiplies P
# by: wgmma's narrowest 16-bit B operand that a 32-byte swizzle tiles.
SUM_COLUMNS = 16
HEAD_SIZES = (32, 64, 128, 256)  # Padded head sizes the kernel takes.
# The memory warpgroup's registers per thread, by compute warpgroups; the
# compute ones share the rest of the block's pool (`compute_registers`).
_MEMORY_REGISTERS = {2: 40, 3: 32}
# Per compute thread with `MosaicForwardConfig.extra_registers` (two warpgroups).
_EXTRA_COMPUTE_REGISTERS = 240


def register_pool(warpgroups: int) -> int:
  """Registers per thread that a block of `warpgroups` x 128 threads holds
  between its warpgroups: the SM's 65,536 split evenly, in multiples of 8
  (504 for three warpgroups, 512 for four); `setmaxnreg` moves them. Shared
  with the backward (`mosaic_backward.py`)."""
  return 65536 // (128 * warpgroups) // 8 * 8 * warpgroups


@dataclasses.dataclass(frozen=True)
class MosaicForwardConfig:
  """Tiles of the Mosaic GPU forward.

  block_q: query rows per compute warpgroup (the block takes twice that).
  block_k: key rows per tile of the ring.
  max_concurrent_steps: slots of the key/value ring.
  causal_only: take only calls whose keys are bounded on the right (causal,
    or a window with a right side), leaving the others to the Triton
    forward. (`FlexConfig.mosaic_fwd_bounded` instead gives the bounded
    calls Mosaic tiles of their own.)
  ping_pong: the two compute warpgroups take turns on the tensor cores (one's
    softmax under the other's matmuls). False lets both run freely: where the
    softmax is most of a step (small heads), the two softmaxes can then run
    at once, with two warps per SM quarter to hide each other's latencies.
  compute_warpgroups: query-row warpgroups per block (2 or 3; 3 only without
    ping-pong). A third gives each SM quarter a third warp of softmax work
    to hide latencies with, at fewer registers each (160 instead of 232).
  pipelined: inside each compute warpgroup, issue the next key tile's
    `Q K^T` and this tile's `P V` before the softmax that sits between them
    (FlashAttention-3's intra-warpgroup pipelining), so that the tensor cores
    work under the softmax of the same warps. With `ping_pong` a warpgroup
    issues both after its turn and hands the turn over at once. Two logit
    tiles are live at once, so it suits `block_q` 64, and a ring of three
    slots (a value tile is released one step later).
  persistent: one block per SM walks work items (a query tile of one
    (batch, head)) in turn, instead of one block per item. The memory
    warpgroup then streams the next item's key/value tiles while the compute
    warpgroups finish the last one, and each compute warpgroup loads its next
    query tile under its epilogue (`prefetch_query`: under its walk), so the
    per-block start (launch, first loads) and end (output store) are paid
    once per SM. The output is staged
    in its own buffer (the query buffer is being refilled). Items then go
    to blocks in a fixed order, so `pallas.prepare` keeps it for calls whose
    items have equal work (no right bound; causal calls launch one block per
    item, which the hardware's scheduler balances).
  persistent_right_bounded: with `persistent`, walk right-bounded calls
    persistently too: their items then go heaviest first (query tiles
    slowest, from the last), and each round of `num_blocks` items is dealt in
    the opposite direction to the round before, so that a block that took a
    heavy item takes a light one next.
  extra_registers: with two compute warpgroups, give each 240 registers per
    thread instead of 232 (the memory warpgroup keeps 24 of the block's 504
    instead of 40), as the backward's `compute_registers=240` does.
  tensor_core_sums: the softmax's row sums as P @ ones on the tensor cores
    (one more wgmma per key tile, beside P V, into a [block_q, 16]
    accumulator: `SUM_COLUMNS`), as the Triton forward's first-tile-maxima
    tiles do, instead of an add per logit and lane shuffles per tile. At
    small heads the softmax's per-logit instructions, not the tensor cores,
    hold the kernel. The non-pipelined walk only. It pays on long walks over
    256-key tiles (BUILD_NOTES.md, "flex_attention").
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
  causal_only: bool = False
  ping_pong: bool = True
  compute_warpgroups: int = NUM_COMPUTE_WGS
  pipelined: bool = False
  persistent: bool = False
  persistent_right_bounded: bool = False
  extra_registers: bool = False
  tensor_core_sums: bool = False
  frozen_masked_tiles: bool = False
  prefetch_query: bool = False

  def __post_init__(self):
    check_tiles(self)
    if self.compute_warpgroups not in _MEMORY_REGISTERS:
      raise ValueError("`compute_warpgroups` must be 2 or 3, got "
                       f"{self.compute_warpgroups}")
    if self.compute_warpgroups != 2 and self.ping_pong:
      raise ValueError("`ping_pong` turns take two compute warpgroups; with "
                       f"`compute_warpgroups={self.compute_warpgroups}` set ping_pong=False")
    if self.tensor_core_sums and self.pipelined:
      raise ValueError("`tensor_core_sums` takes the non-pipelined walk; set "
                       "pipelined=False")
    if self.extra_registers and self.compute_warpgroups != 2:
      raise ValueError("`extra_registers` takes two compute warpgroups, got "
                       f"`compute_warpgroups={self.compute_warpgroups}`")

  @property
  def rows_per_block(self) -> int:
    return self.compute_warpgroups * self.block_q

  @property
  def query_slots(self) -> int:
    """Query buffers per compute warpgroup (`prefetch_query`)."""
    return 2 if self.persistent and self.prefetch_query else 1

  @property
  def memory_registers(self) -> int:
    if self.extra_registers:  # what two compute warpgroups of 240 leave: 24
      return register_pool(3) - 2 * _EXTRA_COMPUTE_REGISTERS
    return _MEMORY_REGISTERS[self.compute_warpgroups]

  @property
  def compute_registers(self) -> int:
    """Per thread of each compute warpgroup: what the memory one leaves, in
    multiples of 8 (`setmaxnreg`): 232 for two (240 with `extra_registers`),
    160 for three."""
    pool = register_pool(self.compute_warpgroups + 1)
    return (pool - self.memory_registers) // self.compute_warpgroups // 8 * 8

  def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
    """Shared memory for the query tiles (`query_slots` of them), the
    output tiles, the ring, the lse rows and (`tensor_core_sums`) each
    compute warpgroup's ones, each buffer aligned
    to 1 KiB (what 128-byte swizzles need), and 2 KiB for the barriers and
    the rest. (64 x 128 x 3 at H128 counts 232,448 here, over the budget;
    Mosaic GPU asks 232,568 for it and refuses it.)"""
    align = lambda n: -(-n // 1024) * 1024
    q = self.compute_warpgroups * self.block_q * head_dim * itemsize
    ring = self.max_concurrent_steps * self.block_k * head_dim * itemsize
    lse = self.compute_warpgroups * self.block_q * 4
    out = align(q) if self.persistent else 0  # else the output reuses q's
    q = q * self.query_slots
    ones = self.compute_warpgroups * self.block_k * SUM_COLUMNS * itemsize
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
