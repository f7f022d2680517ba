"""Running an op's Pallas path once per shard: the one partitioning mechanism.

XLA's partitioner cannot see inside a Pallas kernel (a custom call): handed a
sharded operand, it gathers the whole array onto every device and runs the
kernel on all of it. Each op therefore wraps its kernel path with `run`, which
calls it under `jax.shard_map` over the mesh axes its inputs are split over,
so each device runs the kernel on its own shard.

An op describes its arrays with layouts: one label per dimension, e.g.
`("batch", "seq", "heads", None)` for attention's `q`. Labels in `split` may
be sharded (every array with that label sharded the same way, so GQA groups
and head groups stay whole); any other dimension that is sharded is an error
naming the argument and the axis, never a silent gather. ("seq" is in
`split` only where the op passes states between the sequence's shards:
`ops/_sequence_parallel.py`.) Which mesh axes a label gets:

- Explicit mesh axes (`jax.make_mesh(..., axis_types=Explicit)`): read from
  the arrays' types, exactly as the caller sharded them.
- Auto mesh axes of the mesh in context (`jax.set_mesh`, or the one `fit()`
  sets), or else of the mesh the inputs were placed on (`jax.device_put` with
  a `NamedSharding`: the arrays' types carry that mesh through the trace):
  the batch label is split over all of those axes, as data parallelism and
  FSDP place a batch (over every device). A batch they do not divide is
  padded with copies of its last row up to a multiple of their product and
  the outputs cut back, rather than run whole on every device or refused
  in normal use (a last partial batch): exact where rows are independent,
  as a padded row's outputs are dropped and its gradients are zero. A
  shorter run of the axes that divides the batch is kept where it leaves
  each device as few rows (a batch of one runs whole). An op whose rows
  are not independent checks `Plan.rows` or passes `pad=False` (MoE).
  Under `jax.jit` the types do not say how an array is split over Auto
  axes, so any other split is undone by the shard_map's operand layout (a
  reshard, whose cost docs/guide/scaling.md gives); an array passed outside
  jit carries its concrete sharding, read as Explicit axes are for every
  label but the batch.
- Axes that are already manual (inside the caller's own `shard_map`): left
  alone; the kernel already sees per-device blocks there.

With no mesh anywhere (neither in context nor on the inputs) the op runs as
it is, on one device.

`shard_map` is differentiable, so the custom VJP inside runs per shard too:
forward and backward kernels alike, with the gradients of replicated inputs
(a scan's `A`, the experts' weights) summed over the devices by shard_map's
transpose. Why shard_map and not `jax.custom_partitioning`: BUILD_NOTES.md,
"Sharding".
"""

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

Layout = tuple[str | None, ...]  # one label (or None: never split) per dimension

_AXIS_NAMES = {"batch": "batch", "seq": "sequence", "heads": "head",
               "channels": "channel", "rows": "row"}


def _describe(label: str | None, dim: int) -> str:
  name = _AXIS_NAMES.get(label, label) if label else None
  return f"axis {dim} (the {name} axis)" if name else f"axis {dim}"


def _context_mesh(arrays):
  """The mesh in context, else the one the arrays were placed on."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    return mesh
  for x in arrays:
    sharding = getattr(jax.typeof(x), "sharding", None)
    if sharding is not None and not sharding.mesh.empty:
      return sharding.mesh
  return mesh


def _spec_axes(entry) -> tuple[str, ...]:
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def placement(x) -> tuple[tuple[str, ...], ...]:
  """The mesh axes each dimension of `x` is known to be split over: Explicit
  axes from its type, and for an array outside a trace (its buffers already
  placed) also the Auto axes of its concrete `NamedSharding`."""
  sharding = getattr(x, "sharding", None)
  if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
      and isinstance(sharding, jax.sharding.NamedSharding)):
    kinds = (AxisType.Explicit, AxisType.Auto)
  else:
    sharding, kinds = getattr(jax.typeof(x), "sharding", None), (AxisType.Explicit,)
  if sharding is None or sharding.mesh.empty:
    return ()
  types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
  return tuple(tuple(a for a in _spec_axes(entry) if types.get(a) in kinds)
               for entry in sharding.spec)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which mesh axes each layout label is split over, for one call."""
  mesh: Any
  axes: dict[str, tuple[str, ...]]
  args: tuple = ()  # the arrays (or None) the kernel path takes, in order
  layouts: tuple = ()  # their layouts
  rows: int | None = None  # the batch size before padding; None: not padded

  @property
  def splits(self) -> bool:
    return any(self.axes.values())

  def size(self, label: str) -> int:
    """How many shards the `label` dimension is cut into."""
    return math.prod(self.mesh.shape[a] for a in self.axes.get(label, ()))

  def spec(self, layout: Layout | None) -> P:
    """The PartitionSpec of an array with `layout` (None: replicated)."""
    if layout is None:
      return P()
    return P(*(self.axes.get(label) or None if label else None for label in layout))

  def run(self, fn: Callable, out_layouts) -> Any:
    """`fn(*args)`, once per shard when the plan splits anything.

    `out_layouts` is the layout of `fn`'s output, or a list of layouts when
    `fn` returns a tuple of arrays. A batch the plan pads (`rows` set) is
    padded in front of `fn` and cut back to `rows` in its outputs."""
    args, layouts = self.args, self.layouts
    if not self.splits:
      return fn(*args)
    if self.rows is not None:
      args = [self._pad(x, l) for x, l in zip(args, layouts)]
    present = [i for i, x in enumerate(args) if x is not None]

    def body(*present_args):
      full = list(args)
      for i, x in zip(present, present_args):
        full[i] = x
      return fn(*full)

    in_specs = tuple(self.spec(layouts[i]) for i in present)
    explicit = [a for a, t in zip(self.mesh.axis_names, self.mesh.axis_types)
                if t == AxisType.Explicit]
    placed = [args[i] for i in present]
    if explicit:  # Explicit-typed inputs must arrive as shard_map expects them.
      typed = [P(*(tuple(a for a in _spec_axes(e) if a in explicit) or None for e in spec))
               for spec in in_specs]  # reshard takes Explicit axes only
      placed = [x if jax.typeof(x).sharding.spec == spec else jax.sharding.reshard(x, spec)
                for x, spec in zip(placed, typed)]
    if isinstance(out_layouts, list):  # several outputs, returned as a tuple
      out_specs = tuple(self.spec(l) for l in out_layouts)
    else:
      out_specs = self.spec(out_layouts)
    # check_vma=False: Pallas interpret mode mixes varying and invariant values
    # inside some kernels, which the type check refuses; the types carry no
    # information here, as every split is stated by the specs.
    # Manual over every axis not already manual, the unused ones replicated
    # (what the partitioner does to a kernel anyway): JAX 0.11.2 runs a
    # shard_map manual over some axes only when it is traced, and fails when it
    # runs eagerly (as `hk.transform(f).init` does outside jit).
    free = {a for a, t in zip(self.mesh.axis_names, self.mesh.axis_types)
            if t != AxisType.Manual}
    out = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                        out_specs=out_specs, axis_names=free,
                        check_vma=False)(*placed)
    if self.rows is None:
      return out
    if isinstance(out_layouts, list):
      return tuple(self._cut(y, l) for y, l in zip(out, out_layouts))
    return self._cut(out, out_layouts)

  def _pad(self, x, layout):
    """`x` with its batch axis padded (copies of its last row) to a multiple
    of the batch's shards."""
    if x is None or layout is None or "batch" not in layout:
      return x
    dim, n = layout.index("batch"), self.size("batch")
    rows = x.shape[dim]
    if not rows % n:
      return x
    # A gather of clipped row indices, not jnp.pad's concatenation, which the
    # partitioner splits along another axis and reshards with all-to-alls.
    index = jnp.minimum(jnp.arange(rows + -rows % n), rows - 1)
    return jnp.take(x, index, axis=dim)

  def _cut(self, y, layout):
    """An output back to the batch's `rows`."""
    if y is None or layout is None or "batch" not in layout:
      return y
    return jax.lax.slice_in_dim(y, 0, self.rows, axis=layout.index("batch"))

  @property
  def used_axes(self) -> tuple[str, ...]:
    return tuple(a for axes in self.axes.values() for a in axes)


def _auto_batch(sizes: set[int], free: Sequence[str], mesh, pad: bool
                ) -> tuple[tuple[str, ...], int | None]:
  """The Auto axes a batch of `sizes` rows splits over, and its size when
  padded (None: not padded)."""
  chosen, product = [], 1
  for a in free:  # the longest run that divides every size
    if any(s % (product * mesh.shape[a]) for s in sizes):
      break
    chosen.append(a)
    product *= mesh.shape[a]
  if not pad or len(sizes) != 1 or len(chosen) == len(free):
    return tuple(chosen), None
  rows, = sizes
  if rows // product == -(-rows // math.prod(mesh.shape[a] for a in free)):
    return tuple(chosen), None  # as few rows per device as padding would leave
  return tuple(free), rows


def plan(op: str, named_args: Sequence[tuple[str, Any, Layout | None]], *,
         split: Sequence[str] = ("batch",), pad: bool = True) -> Plan:
  """Decides how one call of `op` splits over the mesh.

  Args:
    op: the op's public name, for messages.
    named_args: (argument name, array or None, layout) for every array the
      kernel path takes.
    split: the labels the kernel can compute locally. "batch", when listed, is
      also the label split over Auto mesh axes.
    pad: whether a batch the Auto axes do not divide is padded (its rows are
      independent); False: it splits over the longest run of them that
      divides it, and the op checks what it needs.

  Returns:
    A Plan; `Plan.run` calls the kernel path per shard.

  Raises:
    ValueError: when an argument is sharded along a dimension the op cannot
      split (over Explicit axes, or over Auto axes where an array outside a
      trace says so), when two arguments shard one label differently, or
      when a label cannot be cut evenly over the axes another argument uses
      for it.
  """
  args = tuple(x for _, x, _ in named_args)
  layouts = tuple(l for _, _, l in named_args)
  present = [(n, x, l) for n, x, l in named_args if x is not None and l is not None]
  mesh = _context_mesh([x for _, x, _ in present])
  if mesh.empty:
    return Plan(mesh, {}, args, layouts)
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  axes: dict[str, tuple[str, ...]] = {}
  source: dict[str, str] = {}
  for name, x, layout in present:
    if len(layout) != x.ndim:
      raise AssertionError(f"{op}: layout {layout} for `{name}` of shape {x.shape}")
    for dim, (label, placed) in enumerate(zip(layout, placement(x))):
      # An Auto axis (only an array outside a trace shows one) never fixes the
      # batch: the rule below splits it over more of the mesh.
      used = tuple(a for a in placed if types.get(a) == AxisType.Explicit
                   or (types.get(a) == AxisType.Auto and label != "batch"))
      if not used:
        continue
      if label not in split:
        raise ValueError(
            f"{op}: `{name}` is sharded over mesh axis {used} along its "
            f"{_describe(label, dim)}, which {op} cannot split; shard only its "
            f"{' / '.join(_AXIS_NAMES.get(s, s) for s in split)} axes")
      if label in axes and axes[label] != used:
        raise ValueError(
            f"{op}: `{name}` is sharded over {used} along its "
            f"{_describe(label, dim)} but `{source[label]}` over {axes[label]}; "
            "they must be split alike")
      axes[label], source[label] = used, name
  free = [a for a in mesh.axis_names if types[a] == AxisType.Auto and mesh.shape[a] > 1]
  taken = {a for used in axes.values() for a in used}
  free = [a for a in free if a not in taken]
  rows = None
  if "batch" in split and "batch" not in axes and free:
    sizes = {x.shape[d] for _, x, l in present for d, lab in enumerate(l) if lab == "batch"}
    axes["batch"], rows = _auto_batch(sizes, free, mesh, pad)
  result = Plan(mesh, {k: v for k, v in axes.items() if v}, args, layouts, rows)
  for name, x, layout in present:
    for dim, label in enumerate(layout):
      n = result.size(label) if label in result.axes else 1
      if x.shape[dim] % n and not (label == "batch" and rows is not None):
        raise ValueError(
            f"{op}: `{name}` has {x.shape[dim]} entries along its "
            f"{_describe(label, dim)}, which cannot be split over mesh axes "
            f"{result.axes[label]} ({n} shards) as `{source.get(label, name)}` is")
  return result


def run(op: str, fn: Callable, named_args: Sequence[tuple[str, Any, Layout | None]],
        out_layouts, *, split: Sequence[str] = ("batch",)) -> Any:
  """`fn(*arrays)` per shard: `plan(op, named_args, split=split).run(...)`."""
  return plan(op, named_args, split=split).run(fn, out_layouts)
