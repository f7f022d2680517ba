"""Training: `fit()` on arrays and streams, callbacks, checkpoints, sharding."""

from probjax_hk.training.callbacks import Callback
from probjax_hk.training.callbacks import EarlyStopping
from probjax_hk.training.checkpoints import Checkpoint
from probjax_hk.training.checkpoints import CheckpointReadError
from probjax_hk.training.checkpoints import load_checkpoint
from probjax_hk.training.loop import fit
from probjax_hk.training.loop import fit_model
from probjax_hk.training.runner import FitResult
from probjax_hk.training.runner import NonFiniteLossError
from probjax_hk.training.sharding import default_mesh
from probjax_hk.training.sharding import FSDP_MIN_SIZE
from probjax_hk.training.sharding import fsdp_spec

__all__ = (
    "Callback",
    "Checkpoint",
    "CheckpointReadError",
    "default_mesh",
    "EarlyStopping",
    "FSDP_MIN_SIZE",
    "fsdp_spec",
    "fit",
    "fit_model",
    "FitResult",
    "load_checkpoint",
    "NonFiniteLossError",
)
