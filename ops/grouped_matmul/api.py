"""`ops.grouped_matmul`: a ragged (grouped) matmul, `jax.lax.ragged_dot` semantics.

The rows of `lhs` are split into contiguous groups and group g is multiplied by
`rhs[g]`: the expert layer of a dropless mixture of experts after its tokens
are sorted by expert (MegaBlocks, https://arxiv.org/abs/2211.15841).

Glossary of shapes: M rows, K contraction, N output columns, G groups.
"""

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ops import _backend
from ops import _shapes
from ops import _sharding
from ops.grouped_matmul import pallas
from ops.grouped_matmul import reference

_DTYPES = (jnp.float32, jnp.bfloat16)
# The algorithm the kernels run, per input dtype: exact products of the
# input dtype (float32 without TF32), accumulated in float32.
_KERNEL_ALGORITHM = {jnp.dtype(jnp.float32): jax.lax.DotAlgorithmPreset.F32_F32_F32,
                     jnp.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32}


def validate_group_sizes(group_sizes, num_rows: int, num_groups: int) -> None:
  """Shape and dtype of `group_sizes`, and its values when they are concrete."""
  if group_sizes.shape != (num_groups,):
    raise ValueError(f"`group_sizes` must be [G] with G = {num_groups} groups of "
                     f"weights, got shape {group_sizes.shape}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"`group_sizes` must be integers, got {group_sizes.dtype}")
  if not isinstance(group_sizes, jax.core.Tracer):
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
      raise ValueError(f"`group_sizes` must be non-negative, got {sizes}")
    if sizes.sum() > num_rows:
      raise ValueError(f"`group_sizes` sums to {sizes.sum()}, more than the "
                       f"{num_rows} rows of the input")


def kernel_limit(rows: str, num_rows: int, weights: str, num_groups: int
                 ) -> str | None:
  """None when the Pallas kernels take M rows (of the argument named `rows`)
  and G groups (of `weights`), else the reason (`implementation=None` then
  runs XLA, which takes empty inputs)."""
  if num_rows < 1:
    return f"`{rows}` needs M >= 1 rows for the kernel, got M = {num_rows}"
  if num_groups < 1:
    return f"`{weights}` needs G >= 1 groups for the kernel, got G = {num_groups}"
  return None


def run_rows_per_shard(op: str, kernel_path, rows: tuple[str, jax.Array],
                       weights: Sequence[tuple[str, jax.Array]], group_sizes) -> jax.Array:
  """`kernel_path(rows, *weights, starts, ends)` once per shard of the rows.

  The rows (tokens) split over the batch's mesh axes; each shard gets its
  groups' bounds cut to its own rows (a group spanning two shards is split
  between them), and the weights are replicated, their gradients summed over
  the shards.

  Args:
    op: the op's public name, for messages.
    kernel_path: the Pallas path, `(rows [m, K], *weights, starts [G],
      ends [G]) -> [m, N]` for the m rows of one shard.
    rows: (name, [M, K] array).
    weights: (name, array) pairs, each replicated.
    group_sizes: [G] integers.
  """
  name, x = rows
  named = ((name, x, ("batch", None)), *((n, w, None) for n, w in weights))
  shards = _sharding.plan(op, named).size("batch")
  starts, ends = reference.group_bounds(group_sizes, x.shape[0])  # [G] each
  local = x.shape[0] // shards
  offsets = jnp.arange(shards, dtype=jnp.int32)[:, None] * local  # [shards, 1]
  starts, ends = (jnp.clip(b[None] - offsets, 0, local) for b in (starts, ends))
  return _sharding.run(
      op, lambda x, *rest: kernel_path(x, *rest[:-2], rest[-2][0], rest[-1][0]),
      (*named, ("group_sizes", starts, ("batch", None)), ("group_sizes", ends, ("batch", None))),
      ("batch", None))


def canonical_precision(precision):
  """`precision` in one of the forms `jax.lax` takes, checked.

  Returns:
    None, a pair of `lax.Precision` (one per operand), or a `lax.DotAlgorithm`
    / `lax.DotAlgorithmPreset` (a preset may be named by a string).

  Raises:
    ValueError: naming `precision` for anything else.
  """
  if precision is None or isinstance(precision, (jax.lax.DotAlgorithm,
                                                 jax.lax.DotAlgorithmPreset)):
    return precision
  pair = tuple(precision) if isinstance(precision, (tuple, list)) else (precision, precision)
  try:
    if len(pair) == 2 and all(isinstance(p, (str, jax.lax.Precision)) for p in pair):
      return tuple(jax.lax.Precision(p) for p in pair)
  except ValueError:  # not a Precision name; perhaps a preset's
    pass
  if isinstance(precision, str) and precision.upper() in jax.lax.DotAlgorithmPreset.__members__:
    return jax.lax.DotAlgorithmPreset[precision.upper()]
  raise ValueError(
      "`precision` must be None, a lax.Precision or its name ('default', 'high', "
      "'highest', ...), a pair of them, or a lax.DotAlgorithm(Preset) or a preset's "
      f"name, got {precision!r}")


def precision_limit(precision, dtype) -> str | None:
  """None when the kernels honour `precision` (canonical) for `dtype` inputs.

  The kernels multiply exactly in the input dtype and accumulate in float32,
  which meets every `lax.Precision`; of the algorithms they run only their
  own (`DotAlgorithmPreset.F32_F32_F32` for float32 inputs, `BF16_BF16_F32`
  for bfloat16) and `DEFAULT`.
  """
  if precision is None or isinstance(precision, tuple):
    return None
  own = _KERNEL_ALGORITHM[jnp.dtype(dtype)]
  if precision in (jax.lax.DotAlgorithmPreset.DEFAULT, own):
    return None
  return (f"the kernels run `precision`={own} (or DEFAULT) for {jnp.dtype(dtype)} "
          f"inputs, got {precision}; use implementation='xla' for other algorithms")


def output_dtype(preferred_element_type, input_dtype) -> jnp.dtype:
  """The result dtype: `preferred_element_type`, by default the input's."""
  if preferred_element_type is None:
    return jnp.dtype(input_dtype)
  try:
    dtype = jnp.dtype(preferred_element_type)
  except TypeError:
    dtype = None
  if dtype not in _DTYPES:
    raise ValueError("`preferred_element_type` must be None, float32 or bfloat16, "
                     f"got {preferred_element_type!r}")
  return dtype


def _validate(lhs, rhs, group_sizes) -> None:
  _shapes.check_arrays("grouped_matmul", (("lhs", lhs), ("rhs", rhs),
                                          ("group_sizes", group_sizes)))
  if lhs.ndim != 2:
    raise ValueError(f"`lhs` must be [M, K], got shape {lhs.shape}")
  if rhs.ndim != 3:
    raise ValueError(f"`rhs` must be [G, K, N], got shape {rhs.shape}")
  if lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"`lhs` [M, K] and `rhs` [G, K, N] must share K, got "
                     f"{lhs.shape=} {rhs.shape=}")
  if lhs.dtype not in _DTYPES or rhs.dtype != lhs.dtype:
    raise ValueError(f"`lhs` and `rhs` must both be float32 or both bfloat16, got "
                     f"{lhs.dtype=} {rhs.dtype=}")
  validate_group_sizes(group_sizes, lhs.shape[0], rhs.shape[0])


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   precision=None, preferred_element_type=None,
                   implementation: _backend.Implementation = None) -> jax.Array:
  """Grouped matmul: row i of group g is `lhs[i] @ rhs[g]`.

  `jax.lax.ragged_dot`'s contract (the same arguments, result and gradients),
  with a Pallas kernel behind it.

  Args:
    lhs: [M, K] float32 or bfloat16.
    rhs: [G, K, N], same dtype as `lhs`.
    group_sizes: [G] non-negative integers; group g is the rows
      `sum(group_sizes[:g]) .. sum(group_sizes[:g+1]) - 1`. Rows after the last
      group are zero in the output (and get zero gradient).
    precision: as for `jax.lax.ragged_dot`: None, a `lax.Precision` (or its
      name), a pair of them, or a `lax.DotAlgorithm(Preset)`. The XLA path
      passes it on. The kernels multiply exactly in the input dtype (float32
      without TF32) and accumulate in float32, which meets every
      `lax.Precision`; of the algorithms they run `DotAlgorithmPreset.DEFAULT`
      and their own, `F32_F32_F32` for float32 inputs and `BF16_BF16_F32` for
      bfloat16. Another algorithm raises a ValueError with
      implementation='pallas' and runs on XLA with None.
    preferred_element_type: the output dtype, float32 or bfloat16 (default
      `lhs.dtype`). Both paths accumulate in float32; the XLA path rounds the
      accumulator once to this dtype, the kernels store it in the input dtype
      and cast, so float32 output from bfloat16 inputs carries bfloat16
      rounding on the Pallas path.
    implementation: None (the Pallas kernel on NVIDIA GPUs, else XLA),
      'pallas' (the kernel; interpret mode off GPU), or 'xla'
      (`jax.lax.ragged_dot`).

  Returns:
    [M, N] in `preferred_element_type` (default `lhs.dtype`). Differentiable
    in `lhs` and `rhs`; their gradients come back in their own dtype.

  Raises:
    ValueError: for bad shapes, dtypes, `precision` or
      `preferred_element_type`, and when concrete `group_sizes` are negative
      or sum to more than M. Traced `group_sizes` cannot be checked: both
      backends then cut the groups at row M (a group running past M is
      truncated, later groups are empty), so the result stays defined.
  """
  _validate(lhs, rhs, group_sizes)
  precision = canonical_precision(precision)
  out_dtype = output_dtype(preferred_element_type, lhs.dtype)

  def kernel_limit_here():
    return (kernel_limit("lhs", lhs.shape[0], "rhs", rhs.shape[0])
            or precision_limit(precision, lhs.dtype))
  backend = _backend.choose("grouped_matmul", implementation, kernel_limit_here)
  if backend == "pallas":
    out = run_rows_per_shard("grouped_matmul", pallas.grouped_matmul_pallas,
                             ("lhs", lhs), (("rhs", rhs),), group_sizes)
    return out.astype(out_dtype)
  starts, ends = reference.group_bounds(group_sizes, lhs.shape[0])
  # Accumulate in float32 unless an algorithm fixes the accumulation type.
  algorithm = isinstance(precision, (jax.lax.DotAlgorithm, jax.lax.DotAlgorithmPreset))
  out = jax.lax.ragged_dot(lhs, rhs, ends - starts, precision=precision,
                           preferred_element_type=out_dtype if algorithm else jnp.float32)
  return out.astype(out_dtype)
