"""probjax_hk.ops: the hot paths, each a Pallas kernel with a pure-XLA fallback.

Every op is one function with arrays positional and options keyword-only,
including `implementation=None | 'pallas' | 'xla'` (see each op's api.py).
"""

from ops.grouped_matmul import grouped_matmul
