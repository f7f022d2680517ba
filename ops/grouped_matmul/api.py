"""`ops.grouped_matmul`: a ragged (grouped) matmul, `jax.lax.ragged_dot` semantics.

The rows of `lhs` are split into contiguous groups and group g is multiplied by
`rhs[g]`: the expert layer of a dropless mixture of experts after its tokens
are sorted by expert (MegaBlocks, https://arxiv.org/abs/2211.15841).

Glossary of shapes: M rows, K contraction, N output columns, G groups.
"""

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ops import _shapes
from ops import _sharding
from ops import registry
from ops.grouped_matmul import configs
from ops.grouped_matmul import mosaic
from ops.grouped_matmul import pallas
from ops.grouped_matmul import reference

# The dtypes the kernels multiply and write.
_KERNEL_DTYPES = tuple(map(jnp.dtype, (jnp.float32, jnp.bfloat16, jnp.float16)))
_PRESET = jax.lax.DotAlgorithmPreset
# The algorithm the kernels run, per operand dtype: exact products of the
# operand dtype (float32 without TF32), accumulated in float32.
_KERNEL_ALGORITHM = {jnp.dtype(jnp.float32): _PRESET.F32_F32_F32,
                     jnp.dtype(jnp.bfloat16): _PRESET.BF16_BF16_F32,
                     jnp.dtype(jnp.float16): _PRESET.F16_F16_F32}


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
  plan = _sharding.plan(op, named)
  shards = plan.size("batch")
  starts, ends = reference.group_bounds(group_sizes, x.shape[0])  # [G] each
  local = -(-x.shape[0] // shards)  # rows padded past M belong to no group
  offsets = jnp.arange(shards, dtype=jnp.int32)[:, None] * local  # [shards, 1]
  starts, ends = (jnp.clip(b[None] - offsets, 0, local) for b in (starts, ends))
  bounds = (("batch", None),) * 2  # [shards, G] each: one row per shard
  plan = dataclasses.replace(plan, args=(*plan.args, starts, ends),
                             layouts=(*plan.layouts, *bounds))
  return plan.run(lambda x, *rest: kernel_path(x, *rest[:-2], rest[-2][0], rest[-1][0]),
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


def operand_dtype(lhs_dtype, rhs_dtype) -> jnp.dtype:
  """The dtype the kernels multiply in: the operands' own when they agree,
  else float32, which holds each of the kernels' input dtypes exactly."""
  if jnp.dtype(lhs_dtype) == jnp.dtype(rhs_dtype):
    return jnp.dtype(lhs_dtype)
  return jnp.dtype(jnp.float32)


def dtype_limit(lhs_dtype, rhs_dtype, out_dtype) -> str | None:
  """None when the kernels take these operand and result dtypes, else the
  reason (`implementation=None` then runs XLA, which takes every dtype
  `jax.lax.ragged_dot` takes)."""
  for name, dtype in (("lhs", lhs_dtype), ("rhs", rhs_dtype),
                      ("preferred_element_type", out_dtype)):
    if jnp.dtype(dtype) not in _KERNEL_DTYPES:
      return (f"the kernels take float32, bfloat16 or float16 `{name}`, got "
              f"{jnp.dtype(dtype)}; use implementation='xla' for other dtypes")
  return None


def precision_limit(precision, dtype) -> str | None:
  """None when the kernels honour `precision` (canonical) on operands of
  `dtype` (`operand_dtype`).

  The kernels multiply exactly in the operand dtype and accumulate in float32,
  which meets every `lax.Precision`; of the algorithms they run `DEFAULT`,
  their own (`F32_F32_F32` for float32 operands, `BF16_BF16_F32` for
  bfloat16, `F16_F16_F32` for float16) and `F32_F32_F32`, which computes the
  same as their own on 16-bit operands (whose products float32 holds exactly).
  """
  if precision is None or isinstance(precision, tuple):
    return None
  own = _KERNEL_ALGORITHM[jnp.dtype(dtype)]
  if precision in (_PRESET.DEFAULT, own, _PRESET.F32_F32_F32):
    return None
  return (f"the kernels run `precision`={own} (or DEFAULT, F32_F32_F32) for "
          f"{jnp.dtype(dtype)} operands, got {precision}; use implementation='xla' "
          "for other algorithms")


def output_dtype(lhs_dtype, rhs_dtype, precision, preferred_element_type) -> jnp.dtype:
  """The result dtype, by `jax.lax.ragged_dot`'s own rule: `preferred_element_type`,
  by default the wider of the operand dtypes (bfloat16 for float16 with bfloat16).

  Raises:
    ValueError: naming `preferred_element_type` when it is not a dtype, and
      the dtypes when ragged_dot refuses them together.
  """
  if preferred_element_type is not None:
    try:
      preferred_element_type = jnp.dtype(preferred_element_type)
    except TypeError:
      raise ValueError("`preferred_element_type` must be None or a dtype, got "
                       f"{preferred_element_type!r}") from None
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  try:
    out = jax.eval_shape(
        functools.partial(jax.lax.ragged_dot, precision=precision,
                          preferred_element_type=preferred_element_type),
        spec((1, 1), lhs_dtype), spec((1, 1, 1), rhs_dtype), spec((1,), jnp.int32))
  except TypeError as e:
    raise ValueError(f"`lhs` {jnp.dtype(lhs_dtype)}, `rhs` {jnp.dtype(rhs_dtype)} and "
                     f"`preferred_element_type` {preferred_element_type}: "
                     f"jax.lax.ragged_dot refuses them ({e})") from None
  return jnp.dtype(out.dtype)


def _validate(lhs, rhs, group_sizes, group_offset) -> None:
  _shapes.check_arrays("grouped_matmul", (("lhs", lhs), ("rhs", rhs),
                                          ("group_sizes", group_sizes)))
  if lhs.ndim != 2:
    raise ValueError(f"`lhs` must be [M, K], got shape {lhs.shape}")
  if rhs.ndim != 3:
    raise ValueError(f"`rhs` must be [G, K, N], got shape {rhs.shape}")
  if lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"`lhs` [M, K] and `rhs` [G, K, N] must share K, got "
                     f"{lhs.shape=} {rhs.shape=}")
  validate_group_sizes(group_sizes, lhs.shape[0], rhs.shape[0])
  if group_offset is not None:
    raise ValueError("`group_offset` must be None: jax.lax.ragged_dot implements "
                     f"no other value (it raises for any array), got {group_offset!r}")


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   precision=None, preferred_element_type=None, group_offset=None,
                   implementation: registry.Choice = None) -> jax.Array:
  """Grouped matmul: row i of group g is `lhs[i] @ rhs[g]`.

  `jax.lax.ragged_dot`'s contract (the same arguments, result dtype, values
  and gradients), with Pallas kernels behind it. The options are keyword-only.

  Args:
    lhs: [M, K], any dtype `jax.lax.ragged_dot` takes.
    rhs: [G, K, N], the same dtype as `lhs` or another: their result dtype is
      ragged_dot's (the wider of the two; bfloat16 for float16 with bfloat16).
    group_sizes: [G] non-negative integers; group g is the rows
      `sum(group_sizes[:g]) .. sum(group_sizes[:g+1]) - 1`. Rows after the last
      group are zero in the output (and get zero gradient).
    precision: as for `jax.lax.ragged_dot`: None, a `lax.Precision` (or its
      name), a pair of them, or a `lax.DotAlgorithm(Preset)`. The XLA path
      passes it on. The kernels multiply exactly in the operand dtype (float32
      without TF32) and accumulate in float32, which meets every
      `lax.Precision`; of the algorithms they run `DEFAULT`, `F32_F32_F32` and
      the operand dtype's own (`BF16_BF16_F32`, `F16_F16_F32`). Another
      algorithm raises a ValueError with a kernel's implementation and runs
      on XLA with None.
    preferred_element_type: the output dtype, any that ragged_dot takes
      (default: ragged_dot's result dtype of `lhs` and `rhs`). Floating
      results are accumulated in float32 (or wider) and rounded once to it,
      on both paths.
    group_offset: None, as `jax.lax.ragged_dot` implements no other value.
    implementation: None (on NVIDIA GPUs the kernels where measured faster,
      `ops/dispatch_tables/grouped_matmul.json`; XLA elsewhere and where
      unmeasured), 'triton' (the Triton kernels of triton.py; interpret mode
      off GPU), 'mosaic' (the Mosaic GPU kernels of mosaic.py and
      mosaic_tgmm.py: 16-bit operands on a Hopper GPU), 'pallas' (an alias of
      ('mosaic', 'triton')), 'xla' (`jax.lax.ragged_dot`), or a sequence of
      these tried in order (`ops.registry`). The kernels take float32,
      bfloat16 and float16 operands and results; operands of two dtypes are
      multiplied in float32.

  Returns:
    [M, N] in `preferred_element_type` (default ragged_dot's result dtype).
    Differentiable in `lhs` and `rhs`; their gradients come back in their own
    dtype. The kernels' backward multiplies in the operand dtype, so with
    16-bit operands and a float32 result it rounds the cotangent to 16 bits
    first (ragged_dot multiplies the float32 cotangent).

  Raises:
    ValueError: for bad shapes, dtypes ragged_dot refuses, a bad `precision`,
      `preferred_element_type` or `group_offset`, and when concrete
      `group_sizes` are negative or sum to more than M. Traced `group_sizes`
      cannot be checked: both backends then cut the groups at row M (a group
      running past M is truncated, later groups are empty), so the result
      stays defined.
  """
  _validate(lhs, rhs, group_sizes, group_offset)
  precision = canonical_precision(precision)
  out_dtype = output_dtype(lhs.dtype, rhs.dtype, precision, preferred_element_type)
  call = dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes, precision=precision,
              out_dtype=out_dtype)
  return IMPLEMENTATIONS.choose(implementation, call).run(**call)


def _xla(lhs, rhs, group_sizes, precision, out_dtype):
  starts, ends = reference.group_bounds(group_sizes, lhs.shape[0])
  # Floating results accumulate in float32 (or wider) unless an algorithm
  # fixes the accumulation type.
  accumulate = out_dtype
  if jnp.issubdtype(out_dtype, jnp.inexact) and not isinstance(
      precision, (jax.lax.DotAlgorithm, jax.lax.DotAlgorithmPreset)):
    accumulate = jnp.promote_types(out_dtype, jnp.float32)
  out = jax.lax.ragged_dot(lhs, rhs, ends - starts, precision=precision,
                           preferred_element_type=accumulate)
  return out.astype(out_dtype)


def _kernels(*, on_mosaic: bool):
  """The kernel path: every matmul on Mosaic GPU, or every one on Triton."""
  def run(lhs, rhs, group_sizes, precision, out_dtype):
    del precision  # the kernels' own, which `_kernel_supports` checked
    dtype = operand_dtype(lhs.dtype, rhs.dtype)
    kernel_path = functools.partial(pallas.grouped_matmul_pallas, out_dtype=out_dtype,
                                    mosaic=on_mosaic, mosaic_tgmm=on_mosaic)
    return run_rows_per_shard("grouped_matmul", kernel_path, ("lhs", lhs.astype(dtype)),
                              (("rhs", rhs.astype(dtype)),), group_sizes)
  return run


def _kernel_supports(call) -> str | None:
  lhs, rhs = call["lhs"], call["rhs"]
  return (kernel_limit("lhs", lhs.shape[0], "rhs", rhs.shape[0])
          or dtype_limit(lhs.dtype, rhs.dtype, call["out_dtype"])
          or precision_limit(call["precision"], operand_dtype(lhs.dtype, rhs.dtype)))


def _mosaic_supports(call) -> str | None:
  if (limit := _kernel_supports(call)) is not None:
    return limit
  dtype = operand_dtype(call["lhs"].dtype, call["rhs"].dtype)
  if not mosaic.preferred(dtype):
    return (f"the Mosaic GPU kernels take bfloat16 or float16 operands on a Hopper "
            f"GPU, got {dtype} on {jax.devices()[0].device_kind}")
  return None


# The measured table decides the default (ops/dispatch_tables/grouped_matmul.json,
# where the kernels are timed as 'pallas': Mosaic GPU's where they run, else Triton's,
# which the registration order and the alias keep).
IMPLEMENTATIONS = registry.Registry("grouped_matmul", table="grouped_matmul")
IMPLEMENTATIONS.register("xla", _xla)
IMPLEMENTATIONS.register("mosaic", _kernels(on_mosaic=True), supports=_mosaic_supports,
                         kernel=True, config=configs.MosaicConfig, measured_as="pallas")
IMPLEMENTATIONS.register("triton", _kernels(on_mosaic=False), supports=_kernel_supports,
                         kernel=True, config=configs.TritonConfig, measured_as="pallas")
IMPLEMENTATIONS.alias("pallas", ("mosaic", "triton"))
