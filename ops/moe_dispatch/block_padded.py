"""The 'sort' path: a batched matmul over row blocks, each owned by one expert.

Rows sorted by expert are scattered into blocks so that no block holds two
experts' rows (each expert's rows padded to a block multiple); each block is
then multiplied by its expert's gathered weights in one batched matmul.

Glossary of shapes: R rows, D d_model, F d_hidden (F' = F, or 2F for SwiGLU,
columns of w_in), E experts.
"""

import jax
import jax.numpy as jnp

from ops import _shapes
from ops.grouped_mlp.activations import activate
from ops.grouped_mlp.activations import Activation


def sort_block_size(num_rows: int, num_experts: int) -> int:
  """Each expert's rows are padded to a multiple of this (padding <= ~25% of rows)."""
  quarter_group = _shapes.cdiv(num_rows, 4 * num_experts)
  return min(1024, max(16, 1 << max(0, quarter_group - 1).bit_length()))


def block_padded_experts(xs: jax.Array, group_sizes: jax.Array, sorted_ids: jax.Array,
                         w_in: jax.Array, w_out: jax.Array,
                         activation: Activation) -> jax.Array:
  """The experts on rows sorted by expert, as a batched matmul over blocks.

  Args:
    xs: [R, D] rows sorted by expert (empty rows, id E, last).
    group_sizes: [E]; sorted_ids: [R]; w_in: [E, D, F']; w_out: [E, F, D], in
      xs's dtype.
    activation: 'gelu' or 'swiglu'.

  Returns:
    [R, D], zero for empty rows.
  """
  num_rows, d = xs.shape
  num_experts = w_in.shape[0]
  block = sort_block_size(num_rows, num_experts)
  num_blocks = _shapes.cdiv(num_rows, block) + num_experts  # static upper bound
  padded = (group_sizes + block - 1) // block * block  # [E]
  padded_end = jnp.cumsum(padded)
  padded_start = padded_end - padded
  start = jnp.cumsum(group_sizes) - group_sizes
  ids = jnp.minimum(sorted_ids, num_experts - 1)
  rank = jnp.arange(num_rows) - start[ids]
  dest = jnp.where(sorted_ids < num_experts, padded_start[ids] + rank,
                   num_blocks * block)  # [R]; out of range -> dropped
  xp = jnp.zeros((num_blocks * block, d), xs.dtype).at[dest].set(xs, mode="drop")
  block_first_row = jnp.arange(num_blocks) * block
  block_expert = jnp.minimum(
      jnp.sum(block_first_row[:, None] >= padded_end[None, :], axis=1), num_experts - 1)
  h = jnp.einsum("nbd,ndf->nbf", xp.reshape(num_blocks, block, d), w_in[block_expert])
  y = jnp.einsum("nbf,nfd->nbd", activate(h, activation), w_out[block_expert])
  return y.reshape(num_blocks * block, d).at[dest].get(mode="fill", fill_value=0)
