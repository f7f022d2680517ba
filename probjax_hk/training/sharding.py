"""Placement for `fit()`: the batch over every device, parameters as asked.

`fit()` splits each batch along its leading axis over all of a
`jax.sharding.Mesh`'s axes (SPMD data parallelism: XLA inserts the gradient
reduction), or with a `sequence_axis` over the other axes, each leaf of rank
>= 2 then also split along its time axis (axis 1) over that one (context
parallelism: `batch_spec`). A `tensor_axis` (the axis a tensor-parallel
`parameter_sharding` splits heads and hidden units over, `tensor_axis_of`)
holds whole batches: every device along it sees the same rows. It places the
parameters by `parameter_sharding`:

- `'replicated'`: a full copy of the parameters and optimizer state on every
  device (plain data parallelism; the gradients are all-reduced).
- `'fsdp'` (ZeRO-3): every parameter with at least `FSDP_MIN_SIZE` elements is
  split along one dimension over the whole mesh (`fsdp_spec` says which), its
  optimizer state alike; XLA gathers each layer's parameters where they are
  used and reduce-scatters their gradients. Smaller leaves are replicated.
- a callable `(path, leaf) -> PartitionSpec | None`: any layout per
  parameter (tensor or expert parallelism); None replicates the leaf. One
  with a `tensor_axis` attribute (`probjax_hk.tensor_parameter_sharding`)
  names the mesh axis the batch is not split over.

Optimizer state leaves take the sharding of the parameter they mirror (matched
by key path and shape, `optimizer_state_specs`); the rest of the training
state (Haiku state, step, key, counters) is replicated. The default mesh holds
`jax.devices()`: every local device in a single process, every device of every
process after `jax.distributed.initialize()`.

Inside the compiled step the batch is placed with `constrain`: a sharding
constraint on Auto mesh axes (the partitioner's freedom elsewhere), `reshard`
on Explicit ones (whose layout is part of the arrays' types, which the ops
read to split their work).

Glossary of shapes: B global batch, T time, P number of processes, D devices
in the mesh.
"""

import dataclasses
import functools
import math
import numbers
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

BATCH_AXIS = "data"
PARAMETER_SHARDING_MODES = ("replicated", "fsdp")
# 'fsdp' replicates leaves of fewer elements (norm scales, most biases):
# splitting one saves under 4 KiB (f32) per device, not worth a gather.
FSDP_MIN_SIZE = 1024

# (path, leaf) -> PartitionSpec | None: the layout of one parameter.
ParameterShardingFn = Callable[[str, Any], PartitionSpec | None]


def default_mesh() -> Mesh:
  """A one-axis mesh `('data',)` over `jax.devices()` (all hosts' devices)."""
  return Mesh(np.asarray(jax.devices()), (BATCH_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
  """A full copy per device (the unsharded parts of the training state)."""
  return NamedSharding(mesh, PartitionSpec())


def batch_axes(mesh: Mesh, sequence_axis: str | None = None,
               tensor_axis: str | None = None) -> tuple[str, ...]:
  """The mesh axes a batch's rows are split over: all but `sequence_axis`
  and `tensor_axis`."""
  return tuple(a for a in mesh.axis_names if a not in (sequence_axis, tensor_axis))


def tensor_axis_of(parameter_sharding) -> str | None:
  """The mesh axis a tensor-parallel `parameter_sharding` splits heads and
  hidden units over (its `tensor_axis` attribute), which the batch is not
  split over; None for the modes and for plain callables."""
  if isinstance(parameter_sharding, str):
    return None
  return getattr(parameter_sharding, "tensor_axis", None)


def _entry(axes: tuple[str, ...]):
  return axes[0] if len(axes) == 1 else (axes or None)


def batch_spec(ndim: int, mesh: Mesh, *, stacked: bool = False,
               sequence_axis: str | None = None,
               tensor_axis: str | None = None) -> PartitionSpec:
  """The layout of one batch leaf of rank `ndim`: [B, T, ...] rows over
  `batch_axes`, time over `sequence_axis` (leaves of rank >= 2; an axis of
  size 1 leaves time whole, as it is anyway, and the ops their usual path),
  whole along `tensor_axis`; `stacked` leaves [K, B, T, ...] hold K steps'
  worth."""
  entries = [_entry(batch_axes(mesh, sequence_axis, tensor_axis))]
  if (sequence_axis is not None and mesh.shape[sequence_axis] > 1
      and ndim >= 2 + stacked):
    entries.append(sequence_axis)
  return PartitionSpec(*([None] * stacked + entries))


def batch_sharding(mesh: Mesh, *, stacked: bool = False,
                   sequence_axis: str | None = None,
                   tensor_axis: str | None = None) -> NamedSharding:
  """The sharding of a batch's rows: leading axis split over `batch_axes`
  (the second axis for `stacked` batches [K, B, ...], K steps' worth)."""
  return NamedSharding(mesh, batch_spec(1 + stacked, mesh, stacked=stacked,
                                        sequence_axis=sequence_axis,
                                        tensor_axis=tensor_axis))


def batch_shardings(batch, mesh: Mesh, *, stacked: bool = False,
                    sequence_axis: str | None = None,
                    tensor_axis: str | None = None):
  """One NamedSharding per leaf of `batch` (arrays or ShapeDtypeStructs),
  by `batch_spec`."""
  return jax.tree.map(lambda x: NamedSharding(mesh, batch_spec(
      len(np.shape(x)), mesh, stacked=stacked, sequence_axis=sequence_axis,
      tensor_axis=tensor_axis)), batch)


def _axis_types(mesh) -> dict[str, Any]:
  return dict(zip(mesh.axis_names, mesh.axis_types))


def has_explicit_axes(mesh) -> bool:
  """Whether any axis of `mesh` is Explicit (its layouts are in the types)."""
  return AxisType.Explicit in _axis_types(mesh).values()


def _spec_of_kind(spec: PartitionSpec, types: dict, kind) -> PartitionSpec:
  """`spec` with only the mesh axes of type `kind` kept."""
  return PartitionSpec(*(_entry(tuple(a for a in _spec_axes(e) if types[a] == kind))
                         for e in spec))


def constrain(tree, shardings):
  """Inside jit: `tree`'s leaves laid out by `shardings` (a matching tree of
  NamedShardings): `reshard` over the Explicit mesh axes (a
  sharding constraint there is an assertion), a sharding constraint over the
  Auto ones."""
  def one(x, sharding):
    types = _axis_types(sharding.mesh)
    if AxisType.Explicit in types.values():
      x = jax.sharding.reshard(x, _spec_of_kind(sharding.spec, types, AxisType.Explicit))
    if AxisType.Auto in types.values():
      x = jax.lax.with_sharding_constraint(x, NamedSharding(
          sharding.mesh, _spec_of_kind(sharding.spec, types, AxisType.Auto)))
    return x
  return jax.tree.map(one, tree, shardings)


def check_sequence_axis(sequence_axis, mesh: Mesh) -> None:
  """Raises a ValueError unless `sequence_axis` is None or an axis of `mesh`
  whose axes are all Explicit (an Auto axis cannot say in the arrays' types
  that time is split, and the ops read the types)."""
  if sequence_axis is None:
    return
  types = _axis_types(mesh)
  axes = (f"mesh axes {dict(mesh.shape)} of types"
          f" {tuple(t.name for t in types.values())}")
  if not isinstance(sequence_axis, str) or sequence_axis not in types:
    raise ValueError(
        f"`sequence_axis` must be None or the name of a mesh axis, got"
        f" {sequence_axis=} and {axes}")
  if any(t != AxisType.Explicit for t in types.values()):
    raise ValueError(
        f"`sequence_axis` needs a mesh whose axes are all Explicit (the ops"
        f" read the time split from the arrays' types, and split the batch"
        f" beside it over Explicit axes only), got {sequence_axis=} and"
        f" {axes}: make the mesh with jax.make_mesh(...,"
        f" axis_types=(AxisType.Explicit,) * len(axis_names))")


def check_tensor_axis(tensor_axis, mesh: Mesh, sequence_axis: str | None) -> None:
  """Raises a ValueError unless `tensor_axis` (`tensor_axis_of` the
  `parameter_sharding`) is None or an axis of `mesh` other than
  `sequence_axis`."""
  if tensor_axis is None:
    return
  if not isinstance(tensor_axis, str) or tensor_axis not in mesh.shape:
    raise ValueError(
        f"`parameter_sharding` splits heads and hidden units over mesh axis"
        f" {tensor_axis!r} (its `tensor_axis`), which is not an axis of the"
        f" mesh {dict(mesh.shape)}")
  if tensor_axis == sequence_axis:
    raise ValueError(
        f"`parameter_sharding`'s `tensor_axis` and `sequence_axis` must be"
        f" different mesh axes, got both {tensor_axis!r}")


def check_time_length(batch, mesh: Mesh, sequence_axis: str | None,
                      argname: str = "data") -> None:
  """Raises a ValueError unless every leaf of rank >= 2 of `batch` (arrays or
  ShapeDtypeStructs [B, T, ...]) has a time length T divisible by the size
  of `sequence_axis`."""
  if sequence_axis is None:
    return
  size = mesh.shape[sequence_axis]
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    shape = np.shape(x)
    if len(shape) >= 2 and shape[1] % size:
      raise ValueError(
          f"`sequence_axis`={sequence_axis!r} splits axis 1 (time) of every"
          f" {argname} leaf of rank >= 2 over its {size} devices, but leaf"
          f" {jax.tree_util.keystr(path) or '<root>'} of shape {shape} has"
          f" T={shape[1]}, not divisible by {size} (mesh axes"
          f" {dict(mesh.shape)})")


def splits_evenly(batch, mesh: Mesh, sequence_axis: str | None = None,
                  tensor_axis: str | None = None) -> bool:
  """Whether `batch_spec` cuts every leaf of `batch` (arrays or
  ShapeDtypeStructs) into equal shards."""
  rows = math.prod(mesh.shape[a] for a in batch_axes(mesh, sequence_axis, tensor_axis))
  time = 1 if sequence_axis is None else mesh.shape[sequence_axis]
  return all(np.shape(x)[0] % rows == 0
             and (len(np.shape(x)) < 2 or np.shape(x)[1] % time == 0)
             for x in jax.tree.leaves(batch))


def check_batch_size(batch_size: int, mesh: Mesh,
                     sequence_axis: str | None = None,
                     tensor_axis: str | None = None) -> None:
  """Raises a ValueError unless `batch_size` splits evenly over the mesh
  (over the axes other than `sequence_axis` and `tensor_axis`)."""
  axes = batch_axes(mesh, sequence_axis, tensor_axis)
  devices = math.prod(mesh.shape[a] for a in axes)
  if batch_size % devices:
    others = [f"`{arg}`={axis!r}" for arg, axis in (
        ("sequence_axis", sequence_axis), ("tensor_axis", tensor_axis)) if axis]
    where = (f"{devices} devices {dict(mesh.shape)}" if not others
             else f"{devices} devices of mesh axes {axes} (all but"
                  f" {' and '.join(others)}; mesh {dict(mesh.shape)})")
    raise ValueError(
        f"`batch_size` must be divisible by the number of devices in the mesh,"
        f" got {batch_size=} and {where}")
  if batch_size % jax.process_count():
    raise ValueError(
        f"`batch_size` must be divisible by the number of processes, got"
        f" {batch_size=} and {jax.process_count()} processes")


def put_replicated(tree, mesh: Mesh):
  """Places `tree` on every device of `mesh`.

  The result may share the caller's buffers (`jax.device_put` reuses a
  buffer already on a mesh device): use it only for arrays that are never
  donated (the data); the training state goes through `copy_to`.
  """
  return jax.device_put(tree, replicated(mesh))


def put_batch(batch, mesh: Mesh, *, stacked: bool = False,
              sequence_axis: str | None = None, tensor_axis: str | None = None):
  """Places a host batch on the mesh, split by `batch_spec`.

  In one process `batch` is the global batch [B, ...] ([K, B, ...] when
  `stacked`). With several processes each one passes its own slice
  [B / P, ...] (the rows its devices hold) and the result is the global array.
  """
  shardings = batch_shardings(batch, mesh, stacked=stacked,
                              sequence_axis=sequence_axis, tensor_axis=tensor_axis)
  if jax.process_count() == 1:
    return jax.device_put(batch, shardings)
  return jax.tree.map(
      lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)),
      batch, shardings)


# --- parameter layouts --------------------------------------------------------


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_name(path) -> str:
  """A key path as the string a `parameter_sharding` callable receives:
  the keys joined by '/', e.g. 'transformer/block_0/attention/query/w'
  for Haiku's params['transformer/block_0/attention/query']['w']."""
  return "/".join(_key_name(k) for k in path)


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec)


def check_parameter_sharding(parameter_sharding) -> None:
  """Raises a ValueError unless `parameter_sharding` is a mode or a callable."""
  if callable(parameter_sharding):
    return
  if (not isinstance(parameter_sharding, str)
      or parameter_sharding not in PARAMETER_SHARDING_MODES):
    raise ValueError(
        f"`parameter_sharding` must be one of {PARAMETER_SHARDING_MODES} or a"
        f" callable (path, leaf) -> PartitionSpec | None, got"
        f" {parameter_sharding=}")


def fsdp_spec(shape: tuple[int, ...], mesh: Mesh,
              min_size: int = FSDP_MIN_SIZE) -> PartitionSpec:
  """The 'fsdp' layout of one leaf of `shape`.

  The largest dimension divisible by the mesh's device count is split over
  all mesh axes; on a tie the last of them (so the leading layer axis of a
  `scan_layers` stack [L, ...] stays whole where a layer's own dimension is as
  large: the scan slices it one layer at a time). A leaf of fewer than
  `min_size` elements, or with no such dimension, is replicated (P()).

  Raises:
    TypeError: `shape` is not a sequence of integers, `mesh` not a
      `jax.sharding.Mesh`, or `min_size` not an integer.
    ValueError: a size in `shape` or `min_size` is negative.
  """
  is_count = lambda n: isinstance(n, numbers.Integral) and not isinstance(n, bool)
  if (isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence)
      or not all(is_count(n) for n in shape)):
    raise TypeError(f"`shape` must be a sequence of integers >= 0, got {shape=}")
  if not isinstance(mesh, Mesh):
    raise TypeError(f"`mesh` must be a jax.sharding.Mesh, got {mesh!r}")
  if not is_count(min_size):
    raise TypeError(f"`min_size` must be an integer >= 0, got {min_size=}")
  for arg, value in (("shape", min(shape, default=0)), ("min_size", min_size)):
    if value < 0:
      raise ValueError(f"`{arg}` must hold integers >= 0, got {shape=} {min_size=}")
  if mesh.size == 1 or math.prod(shape) < min_size:
    return PartitionSpec()
  candidates = [d for d, n in enumerate(shape) if n % mesh.size == 0]
  if not candidates:
    return PartitionSpec()
  dim = max(candidates, key=lambda d: (shape[d], d))
  entries = [None] * len(shape)
  names = tuple(mesh.axis_names)
  entries[dim] = names[0] if len(names) == 1 else names
  return PartitionSpec(*entries)


def _spec_axes(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _check_spec(name: str, spec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
  """`spec` for the parameter `name` of `shape`, checked against `mesh`."""
  if spec is None:
    return PartitionSpec()
  if not _is_spec(spec):
    raise ValueError(
        f"`parameter_sharding` must return a jax.sharding.PartitionSpec or"
        f" None, got {spec!r} for parameter '{name}'")
  if len(spec) > len(shape):
    raise ValueError(
        f"`parameter_sharding` gave parameter '{name}' of shape {shape} the"
        f" spec {spec}, which has {len(spec)} entries for {len(shape)} dimensions")
  used = []
  for dim, entry in enumerate(spec):
    axes = _spec_axes(entry)
    for axis in axes:
      if axis not in mesh.shape:
        raise ValueError(
            f"`parameter_sharding` gave parameter '{name}' the spec {spec},"
            f" which names mesh axis {axis!r}; the mesh has axes"
            f" {tuple(mesh.axis_names)}")
    used.extend(axes)
    shards = math.prod(mesh.shape[a] for a in axes)
    if shape[dim] % shards:
      raise ValueError(
          f"`parameter_sharding` gave parameter '{name}' of shape {shape} the"
          f" spec {spec}: its dimension {dim} ({shape[dim]}) is not divisible"
          f" by the {shards} shards of mesh axes {axes}")
  if len(set(used)) != len(used):
    raise ValueError(
        f"`parameter_sharding` gave parameter '{name}' the spec {spec}, which"
        f" uses a mesh axis twice")
  return spec


def parameter_specs(params, parameter_sharding, mesh: Mesh):
  """One `PartitionSpec` per leaf of `params` (arrays or ShapeDtypeStructs).

  Raises:
    ValueError: `parameter_sharding` is not a mode or a callable, or a spec
      it returns is not a PartitionSpec, names an axis not in `mesh`, or
      does not divide its dimension (the message names the parameter path).
  """
  check_parameter_sharding(parameter_sharding)

  def spec(path, leaf):
    shape = tuple(np.shape(leaf))
    if parameter_sharding == "replicated":
      return PartitionSpec()
    if parameter_sharding == "fsdp":
      return fsdp_spec(shape, mesh)
    name = path_name(path)
    return _check_spec(name, parameter_sharding(name, leaf), shape, mesh)

  return jax.tree_util.tree_map_with_path(spec, params)


def optimizer_state_specs(opt_state, params, param_specs):
  """The specs of an optimizer state (arrays or ShapeDtypeStructs).

  optax states hold trees shaped like the parameters (Adam's `mu`, `nu`),
  possibly nested in chains, masks or named tuples: a leaf whose key path
  ends with a parameter's key path and whose shape is that parameter's gets
  the parameter's spec (the longest such path wins). Every other leaf
  (counts, factored second moments, scalars) is replicated.
  """
  table = {}
  for (path, leaf), spec in zip(
      jax.tree_util.tree_flatten_with_path(params)[0],
      jax.tree.leaves(param_specs, is_leaf=_is_spec)):
    table[tuple(str(k) for k in path)] = (tuple(np.shape(leaf)), spec)

  def spec(path, leaf):
    keys = tuple(str(k) for k in path)
    for start in range(len(keys) + 1):
      match = table.get(keys[start:])
      if match is not None and match[0] == tuple(np.shape(leaf)):
        return match[1]
    return PartitionSpec()

  return jax.tree_util.tree_map_with_path(spec, opt_state)


@dataclasses.dataclass(frozen=True)
class Layout:
  """A hashable tree of `PartitionSpec`s (a key of the compiled-step cache).

  Attributes:
    treedef: the tree's structure.
    specs: one PartitionSpec per leaf, in flattening order.
  """
  treedef: Any
  specs: tuple[PartitionSpec, ...]

  @classmethod
  def of(cls, spec_tree) -> "Layout":
    specs, treedef = jax.tree.flatten(spec_tree, is_leaf=_is_spec)
    return cls(treedef, tuple(specs))

  def shardings(self, mesh: Mesh):
    """The tree of `NamedSharding`s on `mesh`."""
    return jax.tree.unflatten(
        self.treedef, [NamedSharding(mesh, s) for s in self.specs])


def train_state_layout(params, param_specs, opt_state, state) -> Layout:
  """The layout of `fit()`'s training state (see step.py): parameters by
  `param_specs`, optimizer state by `optimizer_state_specs`, the rest
  replicated. Arguments may be arrays or ShapeDtypeStructs."""
  rep = PartitionSpec()
  return Layout.of({
      "params": param_specs,
      "opt_state": optimizer_state_specs(opt_state, params, param_specs),
      "state": jax.tree.map(lambda _: rep, state),
      "step": rep, "rng": rep, "nonfinite": rep, "first_nonfinite": rep})


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


@functools.lru_cache(maxsize=32)
def _copier(shardings_def, shardings_leaves):
  return jax.jit(_copy, out_shardings=jax.tree.unflatten(
      shardings_def, shardings_leaves))


def copy_to(tree, shardings):
  """A fresh copy of `tree` placed with `shardings` (a matching tree of
  `NamedSharding`s, or one for every leaf): never the caller's buffers, so
  that the copy can be donated while the caller's arrays stay readable.

  Arrays already on the mesh's devices are copied (and resharded) by one
  jitted copy, whose outputs never alias its inputs; others (numpy, arrays on
  other devices) are first sent there shard by shard (`jax.device_put`, which
  may reuse a buffer, hence the copy after it).
  """
  leaves, treedef = jax.tree.flatten(tree)
  if isinstance(shardings, jax.sharding.Sharding):
    targets = [shardings] * len(leaves)
  else:
    targets = treedef.flatten_up_to(shardings)

  def on_mesh(x, sharding):
    return (isinstance(x, jax.Array) and x.committed
            and x.sharding.device_set == sharding.device_set)
  placed = [x if on_mesh(x, s) else jax.device_put(x, s)
            for x, s in zip(leaves, targets)]
  return _copier(treedef, tuple(targets))(jax.tree.unflatten(treedef, placed))
