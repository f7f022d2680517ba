"""Token-expert assignments in expert order: the sort, its inverse, capacity slots.

The sorted paths run the experts on rows grouped by expert: a stable sort of
the assignments by expert id, a gather of the token rows into that order, and
the inverse permutation back. Both permutations have gather-only backward
passes: a scatter-add into the token array is much slower than a gather on
GPUs. With a capacity, each assignment's slot in its expert's buffer ranks it
among the assignments to that expert instead.

Glossary of shapes: T tokens, D d_model, E experts, k top_k, A = T * k
assignments, R rows (assignments, or rows received from other devices), C
expert capacity.
"""

import functools
import math

import jax
import jax.numpy as jnp


def sort_by_expert(ids: jax.Array, num_experts: int, *, method: str = "counting"):
  """Stable sort of rows by expert id; ids == num_experts mark empty rows.

  Args:
    ids: [R] int32 in [0, num_experts].
    num_experts: E.
    method: 'counting' (a counting sort: one cumsum over a [R, E + 1] one-hot,
      then a scatter of row numbers) or 'argsort' (`jnp.argsort`). Both give
      the same stable order; the counting sort avoids a general sort on GPUs.

  Returns:
    order [R] (sorted position -> row), inverse [R] (row -> sorted position),
    group_sizes [E] int32 (empty rows counted in none), sorted_ids [R].
  """
  num_rows = ids.shape[0]
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  if method == "argsort":
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)  # [R]
    inverse = jnp.zeros_like(order).at[order].set(rows)
    group_sizes = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.int32), axis=0)
  else:
    onehot = jax.nn.one_hot(ids, num_experts + 1, dtype=jnp.int32)  # [R, E+1]
    before = jnp.cumsum(onehot, axis=0) - onehot  # earlier rows of the same id
    counts = jnp.sum(onehot, axis=0)  # [E+1]
    starts = jnp.cumsum(counts) - counts
    inverse = jnp.sum((before + starts[None, :]) * onehot, axis=1)  # [R]
    order = jnp.zeros_like(inverse).at[inverse].set(rows, unique_indices=True)
    group_sizes = counts[:num_experts]
  return order, inverse, group_sizes, ids[order]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_tokens(x, order, inverse, top_k):
  """xs[i] = x[order[i] // top_k]: [T, D] -> [A, D] in expert order.

  `order` and `inverse` are `sort_by_expert`'s of the flattened [T, k]
  expert ids; the backward pass gathers and sums each token's k rows.
  """
  return x[order // top_k]


def _gather_tokens_fwd(x, order, inverse, top_k):
  return gather_tokens(x, order, inverse, top_k), (order, inverse, x.shape[0])


def _gather_tokens_bwd(top_k, residuals, dxs):
  order, inverse, num_tokens = residuals
  dx = dxs[inverse].reshape(num_tokens, top_k, -1).sum(axis=1)  # [T, D]
  return dx.astype(dxs.dtype), None, None


gather_tokens.defvjp(_gather_tokens_fwd, _gather_tokens_bwd)


@jax.custom_vjp
def unsort(ys, order, inverse):
  """y[a] = ys[inverse[a]]: rows back from expert order to assignment order."""
  return ys[inverse]


def _unsort_fwd(ys, order, inverse):
  return ys[inverse], (order, inverse)


def _unsort_bwd(residuals, dy):
  order, _ = residuals
  return dy[order], None, None


unsort.defvjp(_unsort_fwd, _unsort_bwd)


def expert_capacity(capacity_factor: float, num_tokens: int, top_k: int,
                    num_experts: int) -> int:
  """C = ceil(capacity_factor * T * k / E) slots per expert, at least one."""
  return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def capacity_positions(expert_ids: jax.Array, num_experts: int,
                       capacity: int) -> tuple[jax.Array, jax.Array]:
  """Each assignment's slot in its expert's buffer, and whether it fits.

  Priority is choice-major (every token's first choice before any second
  choice), then token order, as in Switch/GShard.

  Args:
    expert_ids: [T, k].
    num_experts: E.
    capacity: C slots per expert.

  Returns:
    (slot, keep): each [T, k]; slot is the 0-based rank within the expert,
    keep is `slot < capacity`.
  """
  flat = expert_ids.T.reshape(-1)  # [k*T], choice-major
  onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32)  # [k*T, E]
  rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)  # [k*T]
  slot = rank.reshape(expert_ids.shape[1], -1).T  # [T, k]
  return slot, slot < capacity
