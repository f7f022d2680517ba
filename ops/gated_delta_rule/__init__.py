"""`gated_delta_rule`: Gated DeltaNet's recurrence (step reference, chunked XLA, Pallas)."""

from ops.gated_delta_rule.api import gated_delta_rule
from ops.gated_delta_rule.api import IMPLEMENTATIONS
from ops.gated_delta_rule.configs import MosaicConfig
from ops.gated_delta_rule.configs import TritonConfig
from ops.gated_delta_rule.pallas import gated_delta_rule_pallas
from ops.gated_delta_rule.reference import gated_delta_rule_reference
from ops.gated_delta_rule.step import gated_delta_step
from ops.gated_delta_rule.xla import gated_delta_rule_xla

__all__ = ("IMPLEMENTATIONS", "gated_delta_rule", "gated_delta_rule_pallas",
           "gated_delta_rule_reference", "gated_delta_rule_xla", "gated_delta_step", "MosaicConfig",
           "TritonConfig")
