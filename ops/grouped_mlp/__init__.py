"""Grouped two-layer MLP (the experts of a dropless MoE), activation fused."""

from ops.grouped_mlp.activations import activate
from ops.grouped_mlp.activations import Activation
from ops.grouped_mlp.activations import ACTIVATIONS
from ops.grouped_mlp.api import grouped_mlp
from ops.grouped_mlp.api import IMPLEMENTATIONS
from ops.grouped_mlp.configs import TritonConfig
from ops.grouped_mlp.reference import grouped_mlp_reference

__all__ = ("activate", "Activation", "ACTIVATIONS", "grouped_mlp", "grouped_mlp_reference",
           "IMPLEMENTATIONS", "TritonConfig")
