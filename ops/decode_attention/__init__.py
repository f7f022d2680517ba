"""Split-K attention of a few new tokens to a KV cache: `decode_attention` and
its dense reference."""

from ops.decode_attention.api import IMPLEMENTATIONS
from ops.decode_attention.api import decode_attention
from ops.decode_attention.configs import TritonConfig
from ops.decode_attention.reference import decode_attention_reference

__all__ = ("IMPLEMENTATIONS", "decode_attention", "decode_attention_reference", "TritonConfig")
