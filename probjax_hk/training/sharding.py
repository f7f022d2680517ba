"""Data-parallel placement for `fit()`: one mesh axis over every device.

`fit()` replicates parameters, optimizer state and Haiku state on every device
of a `jax.sharding.Mesh` and splits each batch along its leading axis over all
of the mesh's axes (plain data parallelism, SPMD: the gradient all-reduce is
inserted by XLA). The default mesh holds `jax.devices()`: every local device in
a single process, every device of every process after
`jax.distributed.initialize()`.

Glossary of shapes: B global batch, P number of processes, D devices in the mesh.
"""

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

BATCH_AXIS = "data"


def default_mesh() -> Mesh:
  """A one-axis mesh `('data',)` over `jax.devices()` (all hosts' devices)."""
  return Mesh(np.asarray(jax.devices()), (BATCH_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
  """The sharding of parameters and optimizer state: a full copy per device."""
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, *, stacked: bool = False) -> NamedSharding:
  """The sharding of a batch: leading axis split over every mesh axis (the
  second axis for `stacked` batches [K, B, ...], K steps' worth)."""
  axes = tuple(mesh.axis_names)
  return NamedSharding(mesh, PartitionSpec(None, axes) if stacked else PartitionSpec(axes))


def check_batch_size(batch_size: int, mesh: Mesh) -> None:
  """Raises a ValueError unless `batch_size` splits evenly over the mesh."""
  if batch_size % mesh.size:
    raise ValueError(
        f"`batch_size` must be divisible by the number of devices in the mesh,"
        f" got {batch_size=} and {mesh.size} devices {dict(mesh.shape)}")
  if batch_size % jax.process_count():
    raise ValueError(
        f"`batch_size` must be divisible by the number of processes, got"
        f" {batch_size=} and {jax.process_count()} processes")


def put_replicated(tree, mesh: Mesh):
  """Copies `tree` onto every device (never aliases the caller's buffers).

  A copy, so that donating the training state to the compiled step never
  deletes arrays the caller still holds.
  """
  sharding = replicated(mesh)
  return jax.tree.map(
      lambda x: jax.device_put(x, sharding, may_alias=False), tree)


def put_batch(batch, mesh: Mesh, *, stacked: bool = False):
  """Places a host batch on the mesh, split along the batch axis.

  In one process `batch` is the global batch [B, ...] ([K, B, ...] when
  `stacked`). With several processes each one passes its own slice
  [B / P, ...] (the rows its devices hold) and the result is the global array.
  """
  sharding = batch_sharding(mesh, stacked=stacked)
  if jax.process_count() == 1:
    return jax.device_put(batch, sharding)
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
      batch)
