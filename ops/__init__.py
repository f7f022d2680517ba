"""probjax_hk.ops: the hot paths, each a Pallas kernel with a pure-XLA fallback.

Every op is one function with arrays positional and options keyword-only,
including `implementation=None | 'pallas' | 'xla'` (see each op's api.py).
The recurrences also give their single step (`ssd_step`, `gated_delta_step`,
`selective_scan_step`), the decode step of the SSM cells.
"""

from ops.decode_attention import decode_attention
from ops.decode_attention import decode_attention_reference
from ops.flex_attention import flex_attention
from ops.flex_attention import flex_attention_reference
from ops.gated_delta_rule import gated_delta_rule
from ops.gated_delta_rule import gated_delta_rule_reference
from ops.gated_delta_rule import gated_delta_step
from ops.grouped_matmul import grouped_matmul
from ops.grouped_matmul import grouped_matmul_reference
from ops.grouped_mlp import grouped_mlp
from ops.grouped_mlp import grouped_mlp_reference
from ops.linear_scan import linear_scan
from ops.linear_scan import linear_scan_reference
from ops.moe_dispatch import moe_dispatch
from ops.moe_dispatch import moe_dispatch_reference
from ops.selective_scan import selective_scan
from ops.selective_scan import selective_scan_reference
from ops.selective_scan import selective_scan_step
from ops.ssd import ssd
from ops.ssd import ssd_reference
from ops.ssd import ssd_step

__all__ = (
    "decode_attention",
    "decode_attention_reference",
    "flex_attention",
    "flex_attention_reference",
    "gated_delta_rule",
    "gated_delta_rule_reference",
    "gated_delta_step",
    "grouped_matmul",
    "grouped_matmul_reference",
    "grouped_mlp",
    "grouped_mlp_reference",
    "linear_scan",
    "linear_scan_reference",
    "moe_dispatch",
    "moe_dispatch_reference",
    "selective_scan",
    "selective_scan_reference",
    "selective_scan_step",
    "ssd",
    "ssd_reference",
    "ssd_step",
)
