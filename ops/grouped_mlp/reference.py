"""The specification of `grouped_mlp`: one two-layer MLP per group of rows.

Row i of group g is `act(x[i] @ w_in[g]) @ w_out[g]`, with the grouping of
`ops.grouped_matmul` (`jax.lax.ragged_dot` semantics: contiguous groups in
order, rows after the last group are zero). The hidden activation is rounded to
the input dtype between the two matmuls, as two separate grouped matmuls would.

Glossary of shapes: M rows, D input width, F hidden width (2F columns of
`w_in` for SwiGLU), D' output width, G groups.
"""

from typing import Literal

import jax
import jax.numpy as jnp

from ops.grouped_matmul.reference import grouped_matmul_reference

Activation = Literal["gelu", "swiglu"]
ACTIVATIONS = ("gelu", "swiglu")


def activate(h: jax.Array, activation: Activation) -> jax.Array:
  """The hidden activation: [..., F] -> [..., F] ('gelu', tanh form as
  `jax.nn.gelu`), or [..., 2F] -> [..., F] ('swiglu': `silu(gate) * value`
  with the gate the first half of the columns)."""
  if activation == "swiglu":
    gate, value = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate) * value
  return jax.nn.gelu(h)


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
