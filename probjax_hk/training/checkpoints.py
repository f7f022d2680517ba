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
(a process killed mid-save) is never the one resumed from.

A resume reads the newest step before trusting it (`unreadable_reason`: its
metadata and every stored value, synchronously through tensorstore, so that a
truncated, overwritten or deleted file is found without orbax's asynchronous
read failing half-way). An unreadable step (or one missing an item) is
skipped with one warning naming it and why, the fit resumes from the newest
readable one and moves the unreadable ones into `<checkpoint_dir>/unreadable/`,
so that they neither count among the kept checkpoints nor block the save of
their step number. Whatever orbax or tensorstore still raises while reading
reaches the caller as one `CheckpointReadError` naming the step's path.

`fit(resume=False)` in a directory holding checkpoints starts a fresh run
whose steps replace the old run's: the old steps stay where they are (a
`load_checkpoint` or a resume still finds them) until the new run's first
save, which moves them into `<checkpoint_dir>/replaced.<time>/`, writes the
new step and then deletes them, so the directory never mixes two runs and the
old run is lost only once the new one has a durable step.

`fit()` never saves non-finite parameters: its step rejects any update whose
loss, gradient or update is not finite, and a fit stopped by one saves the
state of the last finite step under that step's number (see `runner.py`).

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

import collections
import contextlib
import dataclasses
import itertools
import json
import os
import re
import shutil
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from probjax_hk.training import sharding as sharding_lib

# The two items of a step directory and orbax's own metadata file.
_ITEMS = ("state", "meta")
_METADATA_FILE = "_CHECKPOINT_METADATA"
# Folders of a checkpoint directory for steps no fit resumes from. orbax reads
# a name ending in `_<digits>` as a step: these names never do.
_UNREADABLE_DIR = "unreadable"
_REPLACED_PREFIX = "replaced."
# Stored values read at once while checking a step (bounds the host memory).
_READS_IN_FLIGHT = 8
_MOVES = itertools.count()  # names the barrier after each move

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


class CheckpointReadError(ValueError):
  """A checkpoint step that cannot be read.

  Attributes:
    path: the step's directory.
    reason: why, in one line (the underlying error's type and first line).
  """

  def __init__(self, path: str, reason: str):
    super().__init__(f"cannot read the checkpoint at {path}: {reason}")
    self.path = path
    self.reason = reason


def _reason(error: BaseException) -> str:
  """An exception in one line: tensorstore's messages carry a JSON spec and
  source locations after the sentence that says what failed."""
  text = str(error).strip().split("\n")[0]
  text = re.split(r" \[(?:tensorstore_spec|source locations)=", text)[0]
  if len(text) > 300:
    text = text[:297] + "..."
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextlib.contextmanager
def _reading(path: str):
  """Turns whatever orbax or tensorstore raises while reading the step at
  `path` into one CheckpointReadError naming it."""
  try:
    yield
  except CheckpointReadError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointReadError(path, _reason(e)) from e


def _top_key(key: bytes) -> str:
  """'params.mlp/~/linear_0.w/0' -> 'params': the train state's entry."""
  return re.split(r"[./]", key.decode(errors="replace"), maxsplit=1)[0]


def _read_values(item_path: str, entries) -> None:
  """Reads every value orbax stored under `item_path` (an OCDBT database)
  whose top-level entry is in `entries` (None: all), a few at a time; raises
  what tensorstore raises for a missing, truncated or garbled file."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  store = ts.KvStore.open({"driver": "ocdbt",
                           "base": {"driver": "file", "path": item_path}}).result()
  keys = [k for k in store.list().result()
          if entries is None or _top_key(k) in entries]
  pending = collections.deque()

  def check(key, read):
    if read.result().state != "value":
      raise FileNotFoundError(f"{key.decode(errors='replace')} is missing")

  for key in keys:
    pending.append((key, store.read(key)))
    if len(pending) >= _READS_IN_FLIGHT:
      check(*pending.popleft())
  while pending:
    check(*pending.popleft())


def unreadable_reason(directory: str, step: int, entries=None) -> str | None:
  """Why step `step` of `directory` cannot be read, in one line; None if it can.

  Reads what a restore reads, synchronously: orbax's files of the step, the
  JSON of `meta` and of `state`'s tree, and every stored array value of
  `state` (of the train-state entries `entries`, e.g. {'params', 'state'};
  None: all). A checkpoint with a garbled value of the right size passes
  (orbax stores no checksum).
  """
  path = os.path.join(directory, str(step))
  missing = [name for name in (_METADATA_FILE,) + _ITEMS
             if not os.path.exists(os.path.join(path, name))]
  if missing:
    return f"incomplete: no {', '.join(missing)}"
  for name in (os.path.join("meta", "metadata"),
               os.path.join("state", "_METADATA")):
    try:
      with open(os.path.join(path, name)) as f:
        json.load(f)
    except Exception as e:  # pylint: disable=broad-except
      return f"{name}: {_reason(e)}"
  state = os.path.join(path, "state")
  try:  # tensorstore's messages name the file
    if os.path.exists(os.path.join(state, "manifest.ocdbt")):
      _read_values(state + os.sep, entries)
  except Exception as e:  # pylint: disable=broad-except
    return _reason(e)
  return None


def _step_dirs(directory: str) -> list[int]:
  """The step numbers of `directory`'s step directories, complete or not."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory)
                if name.isdigit() and os.path.isdir(os.path.join(directory, name)))


def _primary() -> bool:
  return jax.process_index() == 0


def _move_steps(directory: str, steps, folder: str) -> str:
  """Moves the step directories `steps` into `directory/folder` (on process
  0; every process waits for it) and returns that folder. A name already
  taken there gets the time appended."""
  target = os.path.join(directory, folder)
  if _primary():
    os.makedirs(target, exist_ok=True)
    for step in steps:
      destination = os.path.join(target, str(step))
      if os.path.exists(destination):
        destination += f".{time.time_ns()}"
      os.rename(os.path.join(directory, str(step)), destination)
  # Barrier names must be unique; every process moves in the same order.
  _ocp().multihost.sync_global_processes(
      f"probjax_hk_checkpoint_move_{next(_MOVES)}")
  return target


class Checkpointer:
  """Saves and restores `fit()` training states in `directory`.

  Args:
    directory: where the step directories live (created if missing).
    keep: how many of the newest checkpoints to keep (older ones are deleted).
    replace: the directory's steps belong to an earlier run that this one
      replaces: the first `save` moves them aside, writes its step, then
      deletes them (see the module docstring).
  """

  def __init__(self, directory: str, *, keep: int, replace: bool = False):
    ocp = _ocp()
    self.directory = os.path.abspath(os.fspath(directory))
    self._replaced = _step_dirs(self.directory) if replace else []
    self._replaced_into = None  # where they went, until this run's first save
    if self._replaced:
      logging.warning(
          "fit: resume=False: %s holds the checkpoints of an earlier run"
          " (steps %s); this run's first checkpoint replaces them (they are"
          " deleted once it is written)", self.directory, self._replaced)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def restore_newest(self, template, shardings) -> tuple[Any, dict] | None:
    """`restore` of the newest readable step; None when there is no step.

    Steps that cannot be read (`unreadable_reason`, or orbax failing) are
    skipped, each with one warning naming it and why, and moved into
    `<directory>/unreadable/` once a readable one is found.

    Raises:
      ValueError: every step is unreadable (the message gives each reason),
        or the newest readable one is from another model or optimizer.
    """
    skipped = []
    # Every step directory, also those orbax does not list (one copied
    # half-way): a save of that step number must not find it there.
    for step in reversed(_step_dirs(self.directory)):
      reason = unreadable_reason(self.directory, step)
      if reason is None:
        try:
          restored = self.restore(step, template, shardings)
          break
        except CheckpointReadError as e:
          reason = e.reason
      skipped.append((step, reason))
    else:
      if not skipped:
        return None
      raise ValueError(
          f"no checkpoint in {self.directory} can be read ("
          + "; ".join(f"step {s}: {r}" for s, r in skipped)
          + "): pass `resume=False` to start a fresh run that replaces them,"
          " or another `checkpoint_dir`")
    target = _move_steps(self.directory, [s for s, _ in skipped],
                         _UNREADABLE_DIR) if skipped else None
    for s, reason in skipped:
      logging.warning("fit: the checkpoint %s/%d cannot be read (%s); resumed"
                      " from step %d instead and moved it into %s",
                      self.directory, s, reason, step, target)
    if skipped:
      self._manager.reload()
    return restored

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
      ValueError: the checkpoint's parameters differ from the template's, or
        the rest of its state (another optimizer; the message names the
        paths).
      CheckpointReadError: orbax or tensorstore failed to read it.
    """
    ocp = _ocp()
    path = os.path.join(self.directory, str(step))
    with _reading(path):
      meta = self._manager.restore(
          step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
      saved = self._manager.item_metadata(step)["state"]
    saved = getattr(saved, "tree", saved)
    mismatch = describe_mismatch(meta["param_shapes"],
                                 _shapes(template["params"]))
    if mismatch:
      raise ValueError(
          f"the checkpoint at {path} is from a different model (pass"
          f" `resume=False` to start a fresh run that replaces it, or another"
          f" `checkpoint_dir`): {mismatch}")
    rest = lambda tree: {k: v for k, v in tree.items() if k != "params"}
    mismatch = describe_mismatch(_leaves_by_path(rest(saved)),
                                 _leaves_by_path(rest(template)), "this fit")
    if mismatch:
      raise ValueError(
          f"the checkpoint at {path} holds another optimizer or Haiku state"
          f" than this fit's (pass the optimizer and state of the run that"
          f" wrote it, `resume=False` to start a fresh run that replaces it,"
          f" or another `checkpoint_dir`): {mismatch}")
    if isinstance(shardings, jax.sharding.Sharding):
      shardings = jax.tree.map(lambda _: shardings, template)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        template, shardings)
    with _reading(path):
      restored = self._manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    logging.info("fit: resumed from %s", path)
    return restored["state"], meta

  def save(self, step: int, train_state, meta: dict) -> None:
    """Writes `train_state` (dict of pytrees) and the JSON `meta` at `step`.

    A step this fit already wrote (a resumed fit ending where it started, a
    stop right after a periodic save) holds the same state and is kept.
    """
    ocp = _ocp()
    if self._replaced:  # the earlier run's steps go aside before this one lands
      self._replaced_into = _move_steps(
          self.directory, self._replaced, f"{_REPLACED_PREFIX}{time.time_ns()}")
      self._replaced = []
      self._manager.reload()
    if step in self._manager.all_steps():
      return
    meta = dict(meta, param_shapes={
        k: [list(v[0]), v[1]] for k, v in _shapes(train_state["params"]).items()})
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state),
        meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()
    logging.info("fit: saved checkpoint %s/%d", self.directory, step)
    if self._replaced_into is not None:  # this run's first step is durable
      if _primary():  # (and any left by a replacing run that died before it)
        for name in os.listdir(self.directory):
          if name.startswith(_REPLACED_PREFIX):
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      logging.info("fit: deleted the earlier run's checkpoints (moved to %s)",
                   self._replaced_into)
      self._replaced_into = None

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


def _check_load_arguments(directory, step, optimizer,
                          mesh) -> tuple[str, int | None]:
  """The absolute directory and the step asked for (None: the newest
  readable); ValueErrors naming the argument otherwise (before orbax is
  imported)."""
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
  # A step directory that is not complete gets CheckpointReadError's reason.
  if step is not None and (
      not isinstance(step, (int, np.integer)) or isinstance(step, bool)
      or step not in _step_dirs(path)):
    raise ValueError(f"`step` must be one of the saved steps {steps} of"
                     f" {path}, got {step=}")
  if optimizer is not None and not hasattr(optimizer, "init"):
    raise TypeError(f"`optimizer` must be an optax.GradientTransformation or"
                    f" None, got {optimizer!r}")
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"`mesh` must be a jax.sharding.Mesh or None, got {mesh!r}")
  return path, None if step is None else int(step)


def _readable_step(path: str, step: int | None, entries) -> int:
  """`step` if it can be read; with None, the newest step that can (one
  warning for each newer one, naming it and why)."""
  if step is not None:
    reason = unreadable_reason(path, step, entries)
    if reason is not None:
      raise CheckpointReadError(os.path.join(path, str(step)), reason)
    return step
  skipped = []
  # Every step directory: a newer one copied half-way gets its warning too.
  for candidate in reversed(_step_dirs(path)):
    reason = unreadable_reason(path, candidate, entries)
    if reason is None:
      for s, why in skipped:
        logging.warning("load_checkpoint: the checkpoint %s/%d cannot be read"
                        " (%s); loading step %d instead", path, s, why,
                        candidate)
      return candidate
    skipped.append((candidate, reason))
  raise ValueError(f"`directory` {path} holds no readable checkpoint ("
                   + "; ".join(f"step {s}: {why}" for s, why in skipped) + ")")


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
    step: the step to load; None: the newest one that can be read (a newer
      one that cannot, its files truncated, garbled or deleted, is skipped
      with a warning naming it and why).
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
    ValueError: `directory` does not exist or holds no complete (or, with
      `step=None`, no readable) checkpoint; `step` is not one of its steps
      (the message lists them); `optimizer` makes a state of another
      structure than the saved one (the message names the leaves); a bad
      `parameter_sharding` (as in `fit()`).
    CheckpointReadError: (a ValueError) the step asked for cannot be read;
      the message names its path and why.
  """
  path, step = _check_load_arguments(directory, step, optimizer, mesh)
  if mesh is not None:
    sharding_lib.check_parameter_sharding(parameter_sharding)
  entries = {"params", "state"} | (set() if optimizer is None else {"opt_state"})
  step = _readable_step(path, step, entries)
  step_path = os.path.join(path, str(step))
  ocp = _ocp()
  manager = ocp.CheckpointManager(
      path, options=ocp.CheckpointManagerOptions(create=False),
      item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})
  try:
    with _reading(step_path):
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
            f"`optimizer` makes a state unlike the one saved at {step_path}"
            f" (pass the optimizer the fit used, or None): {mismatch}")
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract, _load_shardings(abstract, mesh, parameter_sharding))
    with _reading(step_path):
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
      directory=step_path)


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
