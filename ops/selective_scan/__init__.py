"""`selective_scan`: Mamba-1's S6 recurrence (step reference, associative XLA, Pallas)."""

from ops.selective_scan.api import selective_scan
from ops.selective_scan.api import IMPLEMENTATIONS
from ops.selective_scan.configs import TritonConfig
from ops.selective_scan.pallas import selective_scan_pallas
from ops.selective_scan.reference import selective_scan_reference
from ops.selective_scan.step import selective_scan_step
from ops.selective_scan.xla import selective_scan_xla

__all__ = ("IMPLEMENTATIONS", "selective_scan", "selective_scan_pallas",
           "selective_scan_reference", "selective_scan_step", "selective_scan_xla", "TritonConfig")
