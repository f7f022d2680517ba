"""`linear_scan`: `h_t = a_t * h_{t-1} + b_t` (step reference, associative XLA, Pallas)."""

from ops.linear_scan.api import IMPLEMENTATIONS
from ops.linear_scan.api import linear_scan
from ops.linear_scan.configs import TritonConfig
from ops.linear_scan.pallas import linear_scan_pallas
from ops.linear_scan.reference import linear_scan_reference
from ops.linear_scan.xla import linear_scan_xla

__all__ = ("IMPLEMENTATIONS", "linear_scan", "linear_scan_pallas", "linear_scan_reference",
           "linear_scan_xla", "TritonConfig")
