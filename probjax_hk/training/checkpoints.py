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
"""

import os
from typing import Any

from absl import logging
import jax
import numpy as np

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


def describe_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str:
  """Lists parameter paths missing, extra or of another shape/dtype ('' if none)."""
  problems = []
  missing = sorted(set(saved) - set(current))
  extra = sorted(set(current) - set(saved))
  if missing:
    problems.append(f"in the checkpoint but not the model: {missing}")
  if extra:
    problems.append(f"in the model but not the checkpoint: {extra}")
  for path in sorted(set(saved) & set(current)):
    s_shape, s_dtype = tuple(saved[path][0]), saved[path][1]
    c_shape, c_dtype = tuple(current[path][0]), current[path][1]
    if (s_shape, s_dtype) != (c_shape, c_dtype):
      problems.append(f"{path}: checkpoint {s_shape} {s_dtype}, model"
                      f" {c_shape} {c_dtype}")
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
    path = os.path.join(self.directory, str(step))
    return all(os.path.exists(os.path.join(path, name))
               for name in ("_CHECKPOINT_METADATA", "state", "meta"))

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
