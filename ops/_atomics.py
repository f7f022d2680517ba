"""A relaxed atomic add into a Pallas Triton ref.

`plgpu.atomic_add` lowers to Triton's `atomic_rmw` with acquire-release
semantics: every add is an `atom` whose completion the issuing thread waits
for before its next memory access. A kernel that only accumulates into a
buffer (no thread reads it before the kernel ends) needs no ordering, and
with relaxed semantics and an unused result Triton emits fire-and-forget
`red` instructions instead. `relaxed_atomic_add` binds its own primitive
that reuses the stock primitive's abstract evaluation and interpret-mode
(discharge) rule and differs only in the semantics it lowers with.

Uses JAX's private Pallas Triton modules (pinned: jax 0.11.2), as
`ops/_tile_scan.py` does; BUILD_NOTES.md records this.
"""

import functools

from jax._src import tree_util
from jax.extend import core as jex_core
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.pallas.triton import primitives as triton_primitives
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing
from jax._src.state import primitives as state_primitives

_ADD = triton_primitives.AtomicOpType.ADD
_relaxed_add_p = jex_core.Primitive("relaxed_atomic_add")


def relaxed_atomic_add(ref, idx, value) -> None:
  """`ref[idx] += value`, atomically and with no memory ordering (float)."""
  ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "relaxed_atomic_add")
  args_flat, args_tree = tree_util.tree_flatten((ref, transforms, value, None))
  _relaxed_add_p.bind(*args_flat, args_tree=args_tree)


_relaxed_add_p.def_effectful_abstract_eval(
    functools.partial(triton_primitives._atomic_abstract_eval, atomic_type=_ADD))
state_discharge.register_discharge_rule(_relaxed_add_p)(
    functools.partial(triton_primitives._atomic_rmw_discharge_rule, atomic_type=_ADD))


@triton_lowering.register_lowering(_relaxed_add_p)
def _lowering(ctx, *args_flat, args_tree):
  # The stock rule's pointer arithmetic (jax 0.11.2), with relaxed semantics.
  block_info, *_ = ctx.block_infos
  ptr, indexers, value, _ = args_tree.unflatten(args_flat)
  *_, value_aval, _ = args_tree.unflatten(ctx.avals_in)
  indexers = list(indexers)
  if len(indexers) != 1 or not isinstance(indexers[0], indexing.NDIndexer):
    raise NotImplementedError("relaxed_atomic_add takes one plain index")
  ptr = triton_lowering._compute_pointers_from_indices(ptr, block_info, indexers[0])
  value = triton_lowering._ensure_ir_value(value, value_aval)
  # The old values: the primitive has the stock one's output, which callers
  # drop, so the op's result has no uses and Triton can emit `red`.
  return triton_lowering._atomic_rmw(tt_dialect.RMWOp.FADD, ptr, value,
                                     semantic=tt_dialect.MemSemantic.RELAXED)
