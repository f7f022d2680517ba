"""probjax_hk: Haiku-style fast neural models for JAX.

Models are `hk.Module`s used inside `hk.transform`; the hot paths are the
Pallas kernels of the top-level `ops` package.
"""

import importlib.metadata

from probjax_hk.attention import cached_attention
from probjax_hk.attention import choose_attention_implementation
from probjax_hk.attention import dot_product_attention
from probjax_hk.attention import KVCache
from probjax_hk.attention import MultiHeadAttention
from probjax_hk import diffusion
from probjax_hk.diffusion_transformer import DiffusionTransformer
from probjax_hk.generation import generate
from probjax_hk.generation import TokenModel
from probjax_hk.layers import AdaLNModulation
from probjax_hk.layers import LayerNorm
from probjax_hk.layers import Linear
from probjax_hk.layers import MLP
from probjax_hk.layers import modulate
from probjax_hk.layers import RMSNorm
from probjax_hk.layers import rotary_embedding
from probjax_hk.layers import sinusoidal_embedding
from probjax_hk.layers import TimestepEmbedding
from probjax_hk.moe import expert_parameter_sharding
from probjax_hk.moe import MoELayer
from probjax_hk.ssm import GatedDeltaNetCell
from probjax_hk.ssm import LRUCell
from probjax_hk.ssm import Mamba2Cell
from probjax_hk.ssm import MambaCell
from probjax_hk.ssm import SSDCell
from probjax_hk.ssm import SSMModel
from probjax_hk.stacking import remat_policy_names
from probjax_hk.stacking import stack_layer_params
from probjax_hk.stacking import unstack_layer_params
from probjax_hk.tensor_parallel import tensor_parameter_sharding
from probjax_hk.training import Checkpoint
from probjax_hk.training import EarlyStopping
from probjax_hk.training import fit
from probjax_hk.training import fit_model
from probjax_hk.training import FitResult
from probjax_hk.training import load_checkpoint
from probjax_hk.transformer import Transformer
from probjax_hk.transformer import TransformerState
from probjax_hk.unet import UNet


def _installed_version() -> str:
  """The installed distribution's version; a source tree on `sys.path` that
  was never installed has no metadata, hence the local-version fallback."""
  try:
    return importlib.metadata.version("probjax_hk")
  except importlib.metadata.PackageNotFoundError:
    return "0+unknown"


__version__ = _installed_version()

__all__ = (
    "AdaLNModulation",
    "cached_attention",
    "choose_attention_implementation",
    "diffusion",
    "DiffusionTransformer",
    "dot_product_attention",
    "Checkpoint",
    "EarlyStopping",
    "fit",
    "fit_model",
    "FitResult",
    "load_checkpoint",
    "GatedDeltaNetCell",
    "LayerNorm",
    "LRUCell",
    "Linear",
    "MambaCell",
    "Mamba2Cell",
    "MLP",
    "modulate",
    "expert_parameter_sharding",
    "MoELayer",
    "KVCache",
    "MultiHeadAttention",
    "remat_policy_names",
    "RMSNorm",
    "rotary_embedding",
    "sinusoidal_embedding",
    "SSDCell",
    "SSMModel",
    "stack_layer_params",
    "tensor_parameter_sharding",
    "TimestepEmbedding",
    "Transformer",
    "TransformerState",
    "TokenModel",
    "generate",
    "UNet",
    "unstack_layer_params",
)
