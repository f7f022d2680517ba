"""Configuration of the grouped MLP's kernels; the tuned values are in tuned.json.

The Triton kernels (triton.py) run on the grouped matmul's tiles
(`ops.grouped_matmul.configs.TritonConfig`) but for what `TritonConfig` here
changes in the hidden gradient's; the Mosaic GPU kernels take the grouped
matmul's `MosaicConfig` as they are.
"""

import dataclasses

from ops import tuning
from ops.grouped_matmul import configs as gmm_configs


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """What the hidden gradient's Triton kernel (`grouped_mlp_hidden_grad`: a
  matmul, then the activation's derivative with a tile load in its epilogue)
  changes in the grouped matmul's tiles; a field left None takes the tuned
  value for this device (tuned.json)."""
  hidden_grad_block_m: int | None = None    # rows per tile, at most the grouped matmul's
  hidden_grad_num_warps: int | None = None  # warps per program

  def __post_init__(self):
    tuning.fill_unset(self, "grouped_mlp")
    value = self.hidden_grad_block_m
    if value < 16 or value & (value - 1):
      raise ValueError(f"`hidden_grad_block_m` must be a power of two >= 16, got {value}")

  def hidden_grad(self, tiles: gmm_configs.TritonConfig) -> gmm_configs.TritonConfig:
    """The hidden gradient's tiles, from the grouped matmul's `tiles`."""
    return dataclasses.replace(tiles, block_m=min(self.hidden_grad_block_m, tiles.block_m),
                               num_warps=self.hidden_grad_num_warps)
