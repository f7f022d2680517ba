"""`ssd`: Mamba-2's state-space dual (step reference, chunked XLA, Pallas)."""

from ops.ssd.api import IMPLEMENTATIONS
from ops.ssd.api import ssd
from ops.ssd.configs import TritonConfig
from ops.ssd.pallas import ssd_pallas
from ops.ssd.reference import ssd_reference
from ops.ssd.step import ssd_step
from ops.ssd.xla import ssd_xla

__all__ = ("IMPLEMENTATIONS", "ssd", "ssd_pallas", "ssd_reference", "ssd_step", "ssd_xla",
           "TritonConfig")
