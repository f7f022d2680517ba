"""The static description of a flex-attention call, which every kernel takes.

`pallas.prepare` fixes it for a call; the Triton kernels (`triton.py`,
`triton_backward.py`), the Mosaic GPU ones (`mosaic.py`, `mosaic_backward.py`)
and `masks.py` read it.
"""

import dataclasses
from typing import Callable

from ops.flex_attention import configs


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything the kernels specialise on (hashable: custom_vjp nondiff arg)."""
  scale: float  # logit scale (natural units)
  left: int | None  # keys s >= t - left are open (None: unbounded)
  right: int | None  # keys s <= t + right are open (causal: 0)
  kv_mask: bool  # key lengths vary or Sp > S: mask s >= kv_len
  key_length: int  # S; every row's key length unless `key_value_seq_lengths` is given
  segments: bool  # segment ids given
  groups: int  # G query heads per key/value head
  config: configs.FlexConfig
  interpret: bool
  mask_mod: Callable | None = None  # (b, n, t, s) -> bool, on tile indices
  score_mod: Callable | None = None  # (score, b, n, t, s) -> score

  @property
  def any_mask(self) -> bool:
    return (self.left is not None or self.right is not None or self.kv_mask
            or self.segments or self.mask_mod is not None)
