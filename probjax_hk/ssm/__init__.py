"""State-space models: SSMModel and its cells (one file per cell, each an SSMCell)."""

from probjax_hk.ssm.base import SSMCell
from probjax_hk.ssm.gated_delta_net import GatedDeltaNetCell
from probjax_hk.ssm.lru import LRUCell
from probjax_hk.ssm.mamba import MambaCell
from probjax_hk.ssm.mamba2 import Mamba2Cell
from probjax_hk.ssm.model import SSMBlock
from probjax_hk.ssm.model import SSMModel
from probjax_hk.ssm.ssd import SSDCell

__all__ = ("GatedDeltaNetCell", "LRUCell", "MambaCell", "Mamba2Cell", "SSDCell",
           "SSMBlock", "SSMCell", "SSMModel")
