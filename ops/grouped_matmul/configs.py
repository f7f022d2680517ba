"""Configuration of the grouped matmul kernels; the tuned values are in tuned.json.

`TritonConfig` tiles the Triton kernels (triton.py). The Mosaic GPU kernels
have two tile sets: `MosaicConfig` for the matmul over rows (mosaic.py) and
`MosaicTgmmConfig` for the weight gradient (mosaic_tgmm.py), whose block
reduces over rows instead; `MosaicCandidates` is the tuned list that
`mosaic.choose_config` picks a `MosaicConfig` from.
"""

import dataclasses

from jax.experimental import pallas as pl
import jax.numpy as jnp

from ops import tuning

# Both Mosaic GPU kernels are written for two compute warpgroups (and one
# memory warpgroup), which split the block's tile between them.
NUM_COMPUTE_WGS = 2
# A TMA store reads shared memory from a 128-byte boundary, and a straddling
# tile's row runs start at any row of its chunk: a chunk row must be 128 bytes
# (64 16-bit columns); 32 columns ran into a misaligned address.
MIN_EPILOGUE_N = 64


def _check_pow2(config, names, least: int) -> None:
  for name in names:
    value = getattr(config, name)
    if value < least or value & (value - 1):
      raise ValueError(f"`{name}` must be a power of two >= {least}, got {value}")


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Tile sizes of the three Triton kernels (triton.py); a field left None
  takes the tuned value for this device (tuned.json)."""
  block_m: int | None = None       # gmm: rows per tile
  block_k: int | None = None       # gmm: contraction step
  block_n: int | None = None       # gmm: output columns per program
  num_warps: int | None = None
  num_stages: int | None = None
  tgmm_block_m: int | None = None  # tgmm: rows per reduction step
  tgmm_block_k: int | None = None  # tgmm: rows of the [K, N] weight gradient per program
  tgmm_block_n: int | None = None  # tgmm: columns of the weight gradient per program
  tgmm_num_warps: int | None = None
  tgmm_num_stages: int | None = None
  columns_fastest: bool | None = None  # gmm grid order: a row tile's column blocks
                                       # run back to back (its lhs rows stay in L2)

  def __post_init__(self):
    tuning.fill_unset(self, "grouped_matmul")
    _check_pow2(self, [f.name for f in dataclasses.fields(self)
                       if f.name.startswith(("block", "tgmm_block"))], 16)

  @classmethod
  def get_default(cls, num_rows: int, k: int, n: int) -> "TritonConfig":
    """The tuned tiles, shrunk for small problems (tiny shapes in tests)."""
    def fit(block, size):
      return max(16, min(block, pl.next_power_of_2(size)))
    tuned = cls()
    return dataclasses.replace(
        tuned, block_m=fit(tuned.block_m, num_rows), block_k=fit(tuned.block_k, k),
        block_n=fit(tuned.block_n, n), tgmm_block_m=fit(tuned.tgmm_block_m, num_rows),
        tgmm_block_k=fit(tuned.tgmm_block_k, k), tgmm_block_n=fit(tuned.tgmm_block_n, n))


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiles of the Mosaic GPU grouped matmul (mosaic.py); a field left None
  takes the tuned value for this device (tuned.json).

  The block's tile is [block_m, block_n]; `split` says which of its sides the
  two compute warpgroups divide ('n': each takes [block_m, block_n / 2]). The
  epilogue works on `epilogue_n`-column chunks of a warpgroup's tile, through
  `store_slots` shared-memory buffers (2: a chunk's store overlaps the next
  chunk's math). A block walks its tiles a row tile's column blocks first,
  and where the K steps are a multiple of `max_concurrent_steps` the loads
  of its next tile start during this tile's epilogue (chained pipelines).
  """
  block_m: int | None = None
  block_n: int | None = None
  block_k: int | None = None
  max_concurrent_steps: int | None = None
  split: str | None = None
  epilogue_n: int | None = None
  store_slots: int | None = None

  def __post_init__(self):
    tuning.fill_unset(self, "grouped_matmul")
    if self.split not in ("m", "n"):
      raise ValueError(f"`split` must be 'm' or 'n', got {self.split!r}")
    _check_pow2(self, ("block_m", "block_n", "block_k", "epilogue_n"), 16)
    if not MIN_EPILOGUE_N <= self.epilogue_n <= self.wg_tile[1]:
      raise ValueError(f"`epilogue_n` ({self.epilogue_n}) must be at least "
                       f"{MIN_EPILOGUE_N} and at most a warpgroup's columns "
                       f"({self.wg_tile[1]})")
    if self.max_concurrent_steps < 2:
      raise ValueError("`max_concurrent_steps` must be >= 2, got "
                       f"{self.max_concurrent_steps}")
    if self.store_slots not in (1, 2):
      raise ValueError(f"`store_slots` must be 1 or 2, got {self.store_slots}")

  def smem_bytes(self, *, num_accs: int, num_extras: int, itemsize: int = 2,
                 out_itemsize: int = 2) -> int:
    """Shared memory the kernel allocates (the pipeline's slots and the extra
    tiles in the inputs' `itemsize`, the store buffers in the outputs'),
    barriers aside."""
    step = self.block_m * self.block_k + num_accs * self.block_k * self.block_n
    chunk = NUM_COMPUTE_WGS * self.wg_tile[0] * self.epilogue_n
    stores = self.store_slots + 1  # + the straddling tiles' buffer
    return (itemsize * (self.max_concurrent_steps * step + num_extras * chunk)
            + out_itemsize * stores * chunk)

  @property
  def wg_tile(self) -> tuple[int, int]:
    if self.split == "m":
      return self.block_m // NUM_COMPUTE_WGS, self.block_n
    return self.block_m, self.block_n // NUM_COMPUTE_WGS


@dataclasses.dataclass(frozen=True)
class MosaicCandidates:
  """The tiles `mosaic.choose_config` picks from (tuned.json): the first of
  `preferred` that fits the kernel's needs, cutting its store buffers (to 1)
  before its pipeline's stages (to 2) to fit in shared memory; for a plain
  grouped matmul, `few_waves` instead where its waves over the SMs are at
  most `few_waves_max_ratio` of the first choice's (a wave of smaller tiles
  takes longer at equal work)."""
  preferred: tuple[MosaicConfig, ...]
  few_waves: MosaicConfig
  few_waves_max_ratio: float

  @property
  def width_multiple(self) -> int:
    """What a width must be a multiple of for every candidate tile to span it."""
    return max(max(c.block_n, c.block_k) for c in self.preferred + (self.few_waves,))


@dataclasses.dataclass(frozen=True)
class MosaicTgmmConfig:
  """Tiles of the Mosaic GPU transposed grouped matmul (mosaic_tgmm.py); a
  field left None takes the tuned value for this device (tuned.json).

  A block computes a [block_k, block_n] output tile, reducing `block_m` rows
  per pipeline step; each compute warpgroup takes block_n / 2 columns.
  """
  block_m: int | None = None
  block_k: int | None = None
  block_n: int | None = None
  max_concurrent_steps: int | None = None

  def __post_init__(self):
    tuning.fill_unset(self, "grouped_matmul")
    _check_pow2(self, ("block_m", "block_k", "block_n"), 64)
    if self.max_concurrent_steps < 2:
      raise ValueError("`max_concurrent_steps` must be >= 2, got "
                       f"{self.max_concurrent_steps}")

  def epilogue_n(self, out_dtype) -> int:
    """Columns of an epilogue chunk: 128-byte rows (what one swizzled TMA
    store row takes)."""
    return min(self.block_n // NUM_COMPUTE_WGS, 128 // jnp.dtype(out_dtype).itemsize)

  def smem_bytes(self, out_dtype, itemsize: int = 2) -> int:
    step = self.block_m * (self.block_k + self.block_n) * itemsize
    chunk = (NUM_COMPUTE_WGS * self.block_k * self.epilogue_n(out_dtype)
             * jnp.dtype(out_dtype).itemsize)
    return self.max_concurrent_steps * step + chunk
