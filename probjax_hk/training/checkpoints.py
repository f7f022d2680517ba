"""Checkpoints of a `fit()` run, written with orbax-checkpoint.

A checkpoint is one step directory `<checkpoint_dir>/<step>/` holding two
items: `state`, the training state (params, optimizer state, Haiku state, step,
RNG key, non-finite counters) as an orbax `StandardSave` pytree, and `meta`, a
JSON document (step, loss history, validation history, parameter shapes).
Sharded arrays are saved as global arrays, each process writing the shards
its devices hold, and restored into whatever shardings the resuming run asks
for: a fit resumed on another mesh or device count, or with another
`parameter_sharding`, continues from the same state.

Crash safety comes from orbax's commit protocol: a step is written into a
temporary directory (`<step>.orbax-checkpoint-tmp-*`) and renamed into place
only when complete (on local and POSIX file systems the rename is atomic), and
`CheckpointManager` lists only finalized steps, so a half-written checkpoint
(a process killed mid-save) is never the one resumed from; `latest_step`
also skips a step directory missing orbax's metadata or an item. `fit()` never saves
non-finite parameters: its step rejects any update whose loss, gradient or
update is not finite, so the saved state is always the last finite one.

`load_checkpoint(directory)` reads a checkpoint back for inference: the
parameters, the Haiku state and the step (and the optimizer state when given
the optimizer), on one device or placed on a mesh.

```python
net = hk.transform(my_model)
pk.fit(loss_fn, params, data, num_steps=1000, checkpoint_dir="/tmp/run")
checkpoint = pk.training.load_checkpoint("/tmp/run")  # the newest step
logits = net.apply(checkpoint.params, None, x)
```
"""

import dataclasses
import os
from typing import Any

from absl import logging
import jax
import numpy as np

from probjax_hk.training import sharding as sharding_lib

# The two items of a step directory and orbax's own metadata file.
_ITEMS = ("state", "meta")
_METADATA_FILE = "_CHECKPOINT_METADATA"

# orbax is imported lazily: a fit without `checkpoint_dir` never pays for it.
_OCP = None


def _ocp():
  global _OCP
  if _OCP is None:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    _OCP = ocp
  return _OCP


def _shapes(tree) -> dict[str, tuple[tuple[int, ...], str]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): (tuple(np.shape(x)), str(np.dtype(x.dtype)))
          for p, x in flat}


def describe_mismatch(saved: dict[str, Any], current: dict[str, Any],
                      current_name: str = "the model") -> str:
  """Lists parameter paths missing, extra or of another shape/dtype ('' if none)."""
  problems = []
  missing = sorted(set(saved) - set(current))
  extra = sorted(set(current) - set(saved))
  if missing:
    problems.append(f"in the checkpoint but not {current_name}: {missing}")
  if extra:
    problems.append(f"in {current_name} but not the checkpoint: {extra}")
  for path in sorted(set(saved) & set(current)):
    s_shape, s_dtype = tuple(saved[path][0]), saved[path][1]
    c_shape, c_dtype = tuple(current[path][0]), current[path][1]
    if (s_shape, s_dtype) != (c_shape, c_dtype):
      problems.append(f"{path}: checkpoint {s_shape} {s_dtype},"
                      f" {current_name} {c_shape} {c_dtype}")
  return "; ".join(problems)


class Checkpointer:
  """Saves and restores `fit()` training states in `directory`.

  Args:
    directory: where the step directories live (created if missing).
    keep: how many of the newest checkpoints to keep (older ones are deleted).
  """

  def __init__(self, directory: str, *, keep: int):
    ocp = _ocp()
    self.directory = os.path.abspath(os.fspath(directory))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def is_complete(self, step: int) -> bool:
    """A finalized step directory with orbax's metadata and both items."""
    return _is_complete(self.directory, step)

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step (None if there is none).

    Belt and braces over orbax's atomic rename: a step directory that lacks
    orbax's metadata file or an item (copied half-way, say) is skipped.
    """
    for step in reversed(self.all_steps()):
      if self.is_complete(step):
        return step
      logging.warning("fit: skipping incomplete checkpoint %s/%d",
                      self.directory, step)
    return None

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore(self, step: int, template, shardings) -> tuple[Any, dict]:
    """Restores the training state saved at `step` into `template`'s structure.

    Args:
      step: the checkpoint's step.
      template: a training state of the current model (dict of pytrees); its
        structure, shapes and dtypes are the restore target.
      shardings: the sharding each restored array gets: a tree matching
        `template`, or one `jax.sharding.Sharding` for every leaf. orbax reads
        only the slices each device holds, so a checkpoint written on one
        mesh (8 devices, FSDP) restores onto another (4 devices, replicated).

    Returns:
      (training state, meta dict).

    Raises:
      ValueError: the checkpoint's parameters differ from the template's
        (the message names the parameter paths).
    """
    ocp = _ocp()
    meta = self._manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    mismatch = describe_mismatch(meta["param_shapes"],
                                 _shapes(template["params"]))
    if mismatch:
      raise ValueError(
          f"the checkpoint at {self.directory}/{step} is from a different model"
          f" (pass `resume=False` or another `checkpoint_dir`): {mismatch}")
    if isinstance(shardings, jax.sharding.Sharding):
      shardings = jax.tree.map(lambda _: shardings, template)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        template, shardings)
    restored = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    logging.info("fit: resumed from %s/%d", self.directory, step)
    return restored["state"], meta

  def save(self, step: int, train_state, meta: dict) -> None:
    """Writes `train_state` (dict of pytrees) and the JSON `meta` at `step`."""
    ocp = _ocp()
    if step in self._manager.all_steps():
      return
    meta = dict(meta, param_shapes={
        k: [list(v[0]), v[1]] for k, v in _shapes(train_state["params"]).items()})
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state),
        meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()
    logging.info("fit: saved checkpoint %s/%d", self.directory, step)

  def close(self) -> None:
    self._manager.close()


def _is_complete(directory: str, step: int) -> bool:
  path = os.path.join(directory, str(step))
  return all(os.path.exists(os.path.join(path, name))
             for name in (_METADATA_FILE,) + _ITEMS)


@dataclasses.dataclass
class Checkpoint:
  """What `load_checkpoint` returns: one step of a `fit()` run.

  Attributes:
    params: the parameters (the tree `fit()` trained, e.g. Haiku's
      {module: {name: array}}).
    state: the Haiku state, or None when the fit had none.
    step: the step it was saved at (batches consumed).
    opt_state: the optimizer state when `load_checkpoint` was given the
      optimizer, else None.
    history: the fit's history up to `step`, as in `FitResult.history`
      (numpy arrays; no `steps_per_sec`).
    directory: the step's directory.
  """
  params: Any
  state: Any
  step: int
  opt_state: Any
  history: dict[str, np.ndarray]
  directory: str


def checkpoint_steps(directory: str) -> list[int]:
  """The steps of the complete checkpoints in `directory`, oldest first
  (see the module docstring: a half-written step is not one)."""
  if not os.path.isdir(directory):
    return []
  steps = [int(name) for name in os.listdir(directory) if name.isdigit()]
  return sorted(s for s in steps if _is_complete(directory, s))


def _check_load_arguments(directory, step, optimizer, mesh) -> tuple[str, int]:
  """The absolute directory and the step to load; ValueErrors naming the
  argument otherwise (before orbax is imported)."""
  if not isinstance(directory, (str, os.PathLike)):
    raise TypeError(f"`directory` must be a path (str or os.PathLike), got"
                    f" {directory!r}")
  path = os.path.abspath(os.fspath(directory))
  if not os.path.exists(path):
    raise ValueError(f"`directory` does not exist: {path} (got {directory=})")
  if not os.path.isdir(path):
    raise ValueError(f"`directory` must be a directory, but {path} is a file")
  steps = checkpoint_steps(path)
  if not steps:
    raise ValueError(
        f"`directory` {path} holds no complete checkpoint (fit(...,"
        f" checkpoint_dir=...) writes one step directory per save)")
  if step is None:
    step = steps[-1]
  elif (not isinstance(step, (int, np.integer)) or isinstance(step, bool)
        or step not in steps):
    raise ValueError(f"`step` must be one of the saved steps {steps} of"
                     f" {path}, got {step=}")
  if optimizer is not None and not hasattr(optimizer, "init"):
    raise TypeError(f"`optimizer` must be an optax.GradientTransformation or"
                    f" None, got {optimizer!r}")
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"`mesh` must be a jax.sharding.Mesh or None, got {mesh!r}")
  return path, int(step)


def load_checkpoint(directory: str, step: int | None = None, *,
                    optimizer=None, mesh: jax.sharding.Mesh | None = None,
                    parameter_sharding: str | sharding_lib.ParameterShardingFn
                    = "replicated") -> Checkpoint:
  """Loads what `fit(..., checkpoint_dir=directory)` saved, for inference.

  Only the parameters and the Haiku state are read (and the optimizer
  state with `optimizer`), not the rest of the training state.

  Args:
    directory: a `fit()` checkpoint directory (holding one directory per
      saved step).
    step: the step to load; None: the newest complete one.
    optimizer: the optax optimizer the fit used; given, the optimizer state
      is loaded too, in the structure `optimizer.init` makes (ready to pass
      to `optimizer.update`). None: it is not read.
    mesh: None: every array on one device (the first local one). A mesh:
      the parameters placed on it as `parameter_sharding` says (as in
      `fit()`; the optimizer state follows them), the Haiku state
      replicated. orbax reads only the slices each device holds.
    parameter_sharding: 'replicated', 'fsdp' or a callable `(path, leaf) ->
      PartitionSpec | None`, as in `fit()`; used with `mesh`.

  Returns:
    A `Checkpoint` (params, state, step, opt_state, history).

  Raises:
    ValueError: `directory` does not exist or holds no complete checkpoint;
      `step` is not one of its steps (the message lists them); `optimizer`
      makes a state of another structure than the saved one (the message
      names the leaves); a bad `parameter_sharding` (as in `fit()`).
  """
  path, step = _check_load_arguments(directory, step, optimizer, mesh)
  if mesh is not None:
    sharding_lib.check_parameter_sharding(parameter_sharding)
  ocp = _ocp()
  manager = ocp.CheckpointManager(
      path, options=ocp.CheckpointManagerOptions(create=False),
      item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})
  try:
    meta = manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    saved = manager.item_metadata(step)["state"]
    saved = getattr(saved, "tree", saved)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                            {"params": saved["params"], "state": saved["state"]})
    if optimizer is not None:
      abstract["opt_state"] = jax.eval_shape(optimizer.init, abstract["params"])
      # orbax's partial restore would hand back a leaf it does not find as
      # the target's ShapeDtypeStruct: compare the trees first.
      mismatch = describe_mismatch(_leaves_by_path(saved["opt_state"]),
                                   _leaves_by_path(abstract["opt_state"]),
                                   "the optimizer's state")
      if mismatch:
        raise ValueError(
            f"`optimizer` makes a state unlike the one saved at {path}/{step}"
            f" (pass the optimizer the fit used, or None): {mismatch}")
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract, _load_shardings(abstract, mesh, parameter_sharding))
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True)))["state"]
  finally:
    manager.close()
  has_state = meta.get("has_state", bool(jax.tree.leaves(restored["state"])))
  history = {k: np.asarray([np.nan if v is None else v for v in values])
             for k, values in meta["history"].items()}
  return Checkpoint(
      params=restored["params"],
      state=restored["state"] if has_state else None, step=step,
      opt_state=restored.get("opt_state"), history=history,
      directory=os.path.join(path, str(step)))


def _leaves_by_path(tree) -> dict[str, tuple[tuple[int, ...], str]]:
  """{'0/mu/linear/w': (shape, dtype)}: the same names for a saved tree
  (orbax's metadata: NamedTuples as dicts, tuples as lists) and a live one."""
  return {sharding_lib.path_name(p): (tuple(x.shape), str(np.dtype(x.dtype)))
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _load_shardings(abstract, mesh, parameter_sharding):
  """The sharding of each leaf of `abstract` ({'params', 'state'[,
  'opt_state']}): one device without a mesh, else as `fit()` places them."""
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda _: device, abstract)
  param_specs = sharding_lib.parameter_specs(abstract["params"],
                                             parameter_sharding, mesh)
  specs = {"params": param_specs,
           "state": jax.tree.map(lambda _: jax.sharding.PartitionSpec(),
                                 abstract["state"])}
  if "opt_state" in abstract:
    specs["opt_state"] = sharding_lib.optimizer_state_specs(
        abstract["opt_state"], abstract["params"], param_specs)
  return sharding_lib.Layout.of(specs).shardings(mesh)
