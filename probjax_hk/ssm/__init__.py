"""State-space models: SSMModel and its cells (one file per cell)."""

from probjax_hk.ssm.lru import LRUCell
from probjax_hk.ssm.mamba import MambaCell
from probjax_hk.ssm.model import SSMBlock
from probjax_hk.ssm.model import SSMModel

__all__ = ("LRUCell", "MambaCell", "SSMBlock", "SSMModel")
