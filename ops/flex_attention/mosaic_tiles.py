"""The limits both Mosaic GPU attention kernels' tiles meet.

Their tile configs are `configs.MosaicConfig` (the forward, `mosaic.py`) and
`configs.MosaicBackwardConfig` (`mosaic_backward.py`); here: the forward's
register split, and the check of a tile set against the padded head sizes a
kernel takes and the shared memory it has.
"""

from ops._mosaic_gpu import SMEM_BUDGET
from ops.flex_attention.configs import NUM_COMPUTE_WGS
from ops.flex_attention.configs import register_pool

HEAD_SIZES = (32, 64, 128, 256)  # Padded head sizes the forward takes.

# The forward's registers per thread: 40 for the memory warpgroup, and what it
# leaves of the block's pool for each compute one, in multiples of 8 (232).
MEMORY_REGISTERS = 40
COMPUTE_REGISTERS = ((register_pool(NUM_COMPUTE_WGS + 1) - MEMORY_REGISTERS)
                     // NUM_COMPUTE_WGS // 8 * 8)


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
