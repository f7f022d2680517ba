"""probjax_hk.ops: the hot paths, each a Pallas kernel with a pure-XLA fallback.

Every op is one function with arrays positional and options keyword-only,
including `implementation=None | 'pallas' | 'xla'` (see each op's api.py).
"""

from ops.flex_attention import flex_attention, flex_attention_reference
from ops.gated_delta_rule import gated_delta_rule
from ops.grouped_matmul import grouped_matmul
from ops.linear_scan import linear_scan
from ops.selective_scan import selective_scan
from ops.ssd import ssd
