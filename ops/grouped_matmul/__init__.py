"""Grouped (ragged) matmul with `jax.lax.ragged_dot` semantics."""

from ops.grouped_matmul.api import IMPLEMENTATIONS
from ops.grouped_matmul.api import grouped_matmul
from ops.grouped_matmul.configs import MosaicConfig
from ops.grouped_matmul.configs import MosaicTgmmConfig
from ops.grouped_matmul.configs import TritonConfig
from ops.grouped_matmul.reference import grouped_matmul_reference

__all__ = ("IMPLEMENTATIONS", "grouped_matmul", "grouped_matmul_reference", "MosaicConfig",
           "MosaicTgmmConfig", "TritonConfig")
