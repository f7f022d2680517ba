"""Grouped (ragged) matmul with `jax.lax.ragged_dot` semantics."""

from ops.grouped_matmul.api import IMPLEMENTATIONS
from ops.grouped_matmul.api import grouped_matmul
from ops.grouped_matmul.pallas import BlockSizes
from ops.grouped_matmul.reference import grouped_matmul_reference

__all__ = ("IMPLEMENTATIONS", "BlockSizes", "grouped_matmul", "grouped_matmul_reference")
