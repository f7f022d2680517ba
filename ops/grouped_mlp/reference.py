"""The specification of `grouped_mlp`: one two-layer MLP per group of rows.

Row i of group g is `act(x[i] @ w_in[g]) @ w_out[g]`, with the grouping of
`ops.grouped_matmul` (`jax.lax.ragged_dot` semantics: contiguous groups in
order, rows after the last group are zero). The hidden activation is rounded to
the input dtype between the two matmuls, as two separate grouped matmuls would.

Glossary of shapes: M rows, D input width, F hidden width (2F columns of
`w_in` for SwiGLU), D' output width, G groups.
"""

import jax

from ops.grouped_matmul.reference import grouped_matmul_reference
from ops.grouped_mlp.activations import activate
from ops.grouped_mlp.activations import Activation


def grouped_mlp_reference(x: jax.Array, w_in: jax.Array, w_out: jax.Array,
                          group_sizes: jax.Array, *,
                          activation: Activation = "gelu") -> jax.Array:
  """Grouped MLP from the reference grouped matmul (fp32 accumulation).

  Args:
    x: [M, D].
    w_in: [G, D, F] ('gelu') or [G, D, 2F] ('swiglu'), float32 or x.dtype.
    w_out: [G, F, D'], float32 or x.dtype.
    group_sizes: [G] integers.
    activation: 'gelu' or 'swiglu'.

  Returns:
    [M, D'] in `x.dtype`.
  """
  h = grouped_matmul_reference(x, w_in.astype(x.dtype), group_sizes)
  return grouped_matmul_reference(activate(h, activation), w_out.astype(x.dtype),
                                  group_sizes)
