"""Flash attention with masks: `flex_attention` and its dense reference."""

from ops.flex_attention.api import IMPLEMENTATIONS
from ops.flex_attention.api import flex_attention
from ops.flex_attention.configs import FlexConfig
from ops.flex_attention.configs import MosaicBackwardConfig
from ops.flex_attention.configs import MosaicConfig
from ops.flex_attention.configs import TritonConfig
from ops.flex_attention.reference import flex_attention_reference

__all__ = ["IMPLEMENTATIONS", "flex_attention", "flex_attention_reference", "FlexConfig",
           "MosaicBackwardConfig", "MosaicConfig", "TritonConfig"]
