"""`fit()`: one training loop for every model, on arrays and on streams.

```python
net = hk.transform(lambda batch: loss_of_my_model(batch))
params = net.init(jax.random.key(0), example_batch)
result = probjax_hk.fit(net.apply, params, (x, y), batch_size=64, epochs=10)
result.params, result.history["loss"]
```

The loop splits each batch over a `jax.sharding.Mesh` (default: every
device) and replicates or shards the parameters and optimizer state over it
(`parameter_sharding`; see `sharding.py`), dispatches each compiled step while the host reads the previous step's
metrics (a multi-step call's are read when it ends; see `runner.py`), reuses
its compiled step across calls (see `step.py`), checkpoints with orbax (see
`checkpoints.py`) and never keeps a non-finite update. This module checks the
arguments and sets the fit up; `runner.py` runs it.

Glossary of shapes: N in-memory examples, B batch size.
"""

import difflib
import inspect
import numbers
import os
from typing import Any, Callable, Iterable, Sequence

from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from probjax_hk import arguments
from probjax_hk.training import callbacks as callbacks_lib
from probjax_hk.training import checkpoints as checkpoints_lib
from probjax_hk.training import data as data_lib
from probjax_hk.training import programs
from probjax_hk.training import runner as runner_lib
from probjax_hk.training import sharding as sharding_lib
from probjax_hk.training import step as step_lib
from probjax_hk.training.runner import FitResult

# One object, so that the default optimizer finds its compiled step without
# tracing it (see step.py).
DEFAULT_OPTIMIZER = optax.adam(1e-3)
# steps_per_call=None: states up to this size (parameters, optimizer and Haiku
# state) run AUTO_STEPS_PER_CALL steps per compiled call. Their steps are
# short next to the host's per-step work; a bigger state's step is long
# enough to hide it, and the copies a multi-step call keeps would cost memory.
# Each call also copies its input state (kept for a roll-back) and reads its
# final state once: 64 steps spread those thin enough on the CPU for fit to
# keep pace with a bare loop, and 10 do not (BUILD_NOTES.md, fit()).
AUTO_STEPS_PER_CALL = 64
AUTO_STATE_BYTES = 256 * 2**20
# A stream's K batches travel stacked, two items ahead: the automatic K keeps
# an item within this size.
AUTO_STREAM_ITEM_BYTES = 64 * 2**20

# fit()'s arguments that must be positive integers (or None).
_POSITIVE_ARGUMENTS = (
    "batch_size", "num_steps", "epochs", "eval_every", "checkpoint_every",
    "keep_checkpoints", "log_every", "steps_per_call")

# fit()'s arguments that must be bools.
_FLAG_ARGUMENTS = ("resume", "donate", "progress")

_FIT_ARGUMENTS = (
    "optimizer", "batch_size", "num_steps", "epochs", "rng", "state",
    "validation_data", "eval_every", "callbacks", "checkpoint_dir",
    "checkpoint_every", "keep_checkpoints", "resume", "mesh",
    "parameter_sharding", "sequence_axis", "donate",
    "progress", "log_every", "last_batch", "on_nonfinite", "steps_per_call")


def _check_unknown(unknown: dict, valid: Sequence[str], where: str) -> None:
  if not unknown:
    return
  parts = []
  for name in unknown:
    close = difflib.get_close_matches(name, valid, n=1)
    parts.append(f"`{name}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
  raise ValueError(f"{where} got unknown argument(s) {', '.join(parts)};"
                   f" valid keyword arguments: {', '.join(valid)}")


def _check_positive(**values) -> None:
  for name, value in values.items():
    if value is not None and (not isinstance(value, (int, np.integer))
                              or isinstance(value, bool) or value < 1):
      raise ValueError(f"`{name}` must be a positive integer or None, got"
                       f" {name}={value!r}")


def _check_checkpoint_dir(checkpoint_dir) -> None:
  """A path (or None) that is, or can be created as, a directory: orbax would
  otherwise fail only at the first save, after the training steps."""
  if checkpoint_dir is None:
    return
  if not isinstance(checkpoint_dir, (str, os.PathLike)):
    raise TypeError(f"`checkpoint_dir` must be a path (str or os.PathLike) or"
                    f" None, got {checkpoint_dir!r}")
  path = os.path.abspath(os.fspath(checkpoint_dir))
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  if not os.path.isdir(path):
    raise ValueError(f"`checkpoint_dir` must be a directory, but {path} is a"
                     f" file (got {checkpoint_dir=})")


def _check_types(loss_fn, optimizer, callbacks, mesh) -> None:
  """TypeErrors for arguments of the wrong kind (before anything is traced)."""
  if not callable(loss_fn):
    raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}")
  if optimizer is not None and not (hasattr(optimizer, "init")
                                    and hasattr(optimizer, "update")):
    raise TypeError(f"`optimizer` must be an optax.GradientTransformation (with"
                    f" `init` and `update`), got {optimizer!r}")
  if (callable(callbacks) or isinstance(callbacks, (str, bytes, callbacks_lib.Callback))
      or not isinstance(callbacks, Iterable)):
    raise TypeError(f"`callbacks` must be a sequence of Callbacks or functions"
                    f" (wrap a single one in a list), got {callbacks!r}")
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"`mesh` must be a jax.sharding.Mesh or None, got {mesh!r}")


def _check_trees(params, state) -> None:
  """`params` must be a non-empty pytree of floating-point arrays (the
  gradient is taken of them), `state` None or a pytree of numeric arrays."""
  for arg, tree in (("params", params), ("state", state)):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if arg == "params" and not leaves:
      raise ValueError(f"`params` must be a pytree of floating-point arrays, got {params!r}")
    for path, leaf in leaves:
      dtype = _dtype(leaf) if isinstance(leaf, (np.ndarray, jax.Array, numbers.Number)) else None
      fits = dtype is not None and (jnp.issubdtype(dtype, jnp.inexact) if arg == "params"
                                    else jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_)
      if not fits:
        kind = "floating-point" if arg == "params" else "numeric"
        raise TypeError(f"`{arg}` must be a pytree of {kind} arrays, got leaf "
                        f"{jax.tree_util.keystr(path) or '<root>'} = {leaf!r}")


def _auto_steps_per_call(params, state, optimizer, callbacks, checkpoint_dir) -> int:
  """`steps_per_call=None`: several steps per call for a small state, unless
  callbacks are given (a stop they ask for would take effect only at a call's
  end) or checkpoints are written (a resumed run must equal an uninterrupted
  one bit for bit, and a K-step scan can differ from K single steps in the
  last bit, so both runs take one step per call)."""
  if callbacks or checkpoint_dir is not None:
    return 1
  shapes = jax.eval_shape(lambda p: (p, state, optimizer.init(p)), params)
  size = sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))
  return AUTO_STEPS_PER_CALL if size <= AUTO_STATE_BYTES else 1


def _as_raw_key(rng) -> jax.Array:
  """None/int/typed key/raw key -> a raw uint32 [2] key."""
  if rng is None:
    rng = 0
  if isinstance(rng, (int, np.integer)):
    return jax.random.PRNGKey(int(rng))
  try:
    rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
  except TypeError:
    raise TypeError(f"`rng` must be an int seed or a JAX key, got {rng!r}") from None
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(rng)
  if rng.dtype != jnp.uint32 or rng.shape != (2,):
    raise ValueError(f"`rng` must be an int seed or a JAX key, got {rng!r}")
  return rng


def _accepts_mask(fn: Callable) -> bool:
  try:
    parameters = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return True  # cannot tell (a C function, a partial of one): trust it
  return any(p.name == "mask" or p.kind == p.VAR_KEYWORD for p in parameters)


_structure_cache: dict = {}


def _dtype(x):
  return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _signature(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((tuple(np.shape(x)), str(np.dtype(_dtype(x))))
                        for x in leaves)


def _abstract(tree, shardings=None):
  """ShapeDtypeStructs of `tree`'s leaves, placed by `shardings` (a
  matching tree) or nowhere: the arrays' own placement (another mesh's)
  must not clash with the mesh in context."""
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x)), tree)
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(np.shape(x), _dtype(x), sharding=s),
      tree, shardings)


def _failing_module(error: BaseException) -> str:
  """Where `error` was raised: the innermost Haiku module in its traceback,
  as " in <class> '<module name>'" ('' outside any module)."""
  frame, name = error.__traceback__, ""
  while frame is not None:
    module = frame.tb_frame.f_locals.get("self")
    if isinstance(module, hk.Module):
      name = f" in {type(module).__name__} '{module.module_name}'"
    frame = frame.tb_next
  return name


def _loss_structure(loss_fn, params, state, rng, batch, mask, has_state, mesh,
                    sequence_axis=None, param_specs=None, tensor_axis=None):
  """Traces `loss_fn` under `jax.set_mesh(mesh)`, as the step will be (no
  compile; cached); checks the loss. On a mesh with Explicit axes the
  parameters and the batch carry their layouts (`param_specs`, and
  `sharding.batch_spec` with `sequence_axis` and `tensor_axis`), which those
  axes make part of the arrays' types, so a model that cannot take them
  fails here.

  Returns:
    (has_aux, the step's metric names).
  """
  key = (loss_fn, has_state, mesh, sequence_axis, tensor_axis,
         None if param_specs is None else sharding_lib.Layout.of(param_specs),
         _signature((params, state, rng, batch, mask)))
  if key not in _structure_cache:
    if len(_structure_cache) > 64:
      _structure_cache.clear()
    typed = sharding_lib.has_explicit_axes(mesh)
    abstract_params = _abstract(params, (
        sharding_lib.Layout.of(param_specs).shardings(mesh)
        if typed and param_specs is not None else None))
    abstract_batch = _abstract(batch, sharding_lib.batch_shardings(
        batch, mesh, sequence_axis=sequence_axis, tensor_axis=tensor_axis)
                               if typed else None)
    with jax.set_mesh(mesh):
      _structure_cache[key] = _trace_loss_structure(
          loss_fn, abstract_params, *_abstract((state, rng)), abstract_batch,
          _abstract(mask), has_state, sequence_axis)
  return _structure_cache[key]


def _trace_loss_structure(loss_fn, params, state, rng, batch, mask, has_state,
                          sequence_axis=None):
  args = (params, state, rng, batch) if has_state else (params, rng, batch)
  kwargs = {} if mask is None else {"mask": mask}
  try:
    out = jax.eval_shape(lambda a, k: loss_fn(*a, **k), args, kwargs)
  except Exception as e:  # pylint: disable=broad-except
    # An op refusing the split raises a ValueError; JAX's sharding rules a
    # ShardingTypeError (not public) or a TypeError.
    if sequence_axis is None or not (
        isinstance(e, (ValueError, TypeError))
        or type(e).__name__ == "ShardingTypeError"):
      raise
    # The split is what is new to the model: say so, and where it failed.
    raise ValueError(
        f"`sequence_axis`={sequence_axis!r}: `loss_fn` cannot take batches"
        f" whose time axis (axis 1) is split over mesh axis {sequence_axis!r}"
        f"{_failing_module(e)}: {type(e).__name__}: {e}") from e
  if has_state:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise ValueError("`loss_fn` with a Haiku `state` must return"
                       " (loss, new_state) or ((loss, aux), new_state)")
    out = out[0]
  has_aux = isinstance(out, (tuple, list)) and len(out) == 2
  loss = out[0] if has_aux else out
  if not hasattr(loss, "shape") or loss.shape != ():
    raise ValueError(f"`loss_fn` must return a scalar loss (or (loss, aux)),"
                     f" got {jax.tree.map(lambda x: x.shape, loss)}")
  return has_aux, step_lib.metric_names(out[1] if has_aux else None)


def _check_validation_fits(validation_data, batch_size, loss_fn, params, state,
                           rng, use_mask, has_state, mesh, sequence_axis=None,
                           param_specs=None, tensor_axis=None) -> None:
  """Traces the loss (no compile; cached) on a batch like the first
  validation batch, so that a batch the loss cannot take fails now, not at
  the first evaluation after training steps."""
  if data_lib.is_in_memory(validation_data):
    n = min(batch_size, data_lib.leading_dim(validation_data, "validation_data"))
    first = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n,) + x.shape[1:], x.dtype),
                         validation_data)
  else:
    first = next(iter(validation_data))
    n = data_lib.leading_dim(first, "validation_data batch")
  example = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", None)
                                     or np.asarray(x).dtype), first)
  mask = jax.ShapeDtypeStruct((n,), jnp.bool_) if use_mask else None
  if not sharding_lib.splits_evenly(example, mesh, sequence_axis, tensor_axis):
    sequence_axis = None  # evaluated replicated (runner.py)
  try:
    _loss_structure(loss_fn, params, state, rng, example, mask, has_state,
                    mesh, sequence_axis, param_specs, tensor_axis)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"`validation_data` batches do not fit `loss_fn` (the"
                     f" training batches do): {type(e).__name__}: {e}") from e


def fit(loss_fn: Callable[..., Any], params, data, *,
        optimizer: optax.GradientTransformation | None = None,
        batch_size: int | None = None,
        num_steps: int | None = None,
        epochs: int | None = None,
        rng=None,
        state=None,
        validation_data=None,
        eval_every: int | None = None,
        callbacks: Sequence[Any] = (),
        checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 3,
        resume: bool = True,
        mesh: jax.sharding.Mesh | None = None,
        parameter_sharding: str | sharding_lib.ParameterShardingFn = "replicated",
        sequence_axis: str | None = None,
        donate: bool = True,
        progress: bool = True,
        log_every: int | None = None,
        last_batch: str = "drop",
        on_nonfinite: str = "raise",
        steps_per_call: int | None = None,
        **unknown) -> FitResult:
  """Trains `params` to minimise `loss_fn` over `data`.

  Args:
    loss_fn: `loss_fn(params, rng, batch) -> loss | (loss, aux)`, or with a
      Haiku `state`: `loss_fn(params, state, rng, batch) -> (loss | (loss,
      aux), new_state)` (the signature of `hk.transform(...).apply` and
      `hk.transform_with_state(...).apply`). `loss` is a scalar; scalars in an
      `aux` dict are recorded in the history (as `aux/<key>` where the key is
      'loss', 'grad_norm' or 'finite'). With `last_batch='pad'` it is
      also called with `mask=` ([B] bool, True on real rows).
    params: the initial parameters (copied onto the mesh; the caller's arrays
      are never donated, aliased or deleted).
    data: in-memory data, a pytree of arrays [N, ...] (a dict, tuple or array;
      not a list), or a stream: any iterable of batches (a list, a generator),
      each a pytree of arrays [B, ...] (numpy or JAX).
    optimizer: any `optax.GradientTransformation`; default Adam(1e-3).
    batch_size: rows per step. In-memory: default all N. Stream: default the
      first batch's size. Must be divisible by the mesh's device count.
    num_steps: steps to train in total (a resumed fit counts earlier steps).
    epochs: passes over in-memory data (exactly one of `num_steps`/`epochs`
      for in-memory data; streams take neither or `num_steps`, and end when
      the stream ends).
    rng: an int seed or a JAX key; drives the data order and the loss's key.
    state: the initial Haiku state, for a `loss_fn` that takes one.
    validation_data: in-memory arrays, or a re-iterable collection of batches
      (a list), evaluated with the same loss and a fixed key (a non-finite
      validation loss is logged as a warning).
    eval_every: evaluate every this many steps (default: each epoch for
      in-memory data, else only at the end; always also at the end).
    callbacks: `Callback` objects or functions `(step, metrics) -> bool | None`;
      True stops the fit. fit() reads a step's metrics while the next step
      runs, so a stop asked after step s ends the fit after step s + 1 (with
      `steps_per_call`, at the end of the call holding step s); one asked by
      `on_eval_end` ends it at that step. A `Callback`'s
      `on_eval_params(step, params, state)` also sees copies of the
      parameters at every validation pass.
    checkpoint_dir: where to write orbax checkpoints (None: no checkpoints).
    checkpoint_every: also save every this many steps (the end, a stop and
      Ctrl-C always save when `checkpoint_dir` is set).
    keep_checkpoints: how many of the newest checkpoints to keep.
    resume: True: continue from the newest checkpoint in `checkpoint_dir`
      that can be read (its state, step and key replace `params`, `state`
      and `rng`; a newer one that cannot is skipped with a warning and moved
      into `<checkpoint_dir>/unreadable/`; one that already holds the steps
      asked for trains nothing, and a warning says so). False: start a fresh run from
      `params`; the checkpoints already in `checkpoint_dir` belong to an
      earlier run, which this one replaces (a warning says so): they stay
      until this run's first save and are deleted once it is written, so
      the directory never mixes two runs.
    mesh: the device mesh; the batch is split over all its axes but
      `sequence_axis` and a tensor-parallel `parameter_sharding`'s
      `tensor_axis` (and the compiled steps run under `jax.set_mesh(mesh)`,
      so that the Pallas kernels run per shard). Its axes may be Auto (the
      partitioner places what the batch and parameters do not fix) or
      Explicit (`jax.make_mesh(..., axis_types=(AxisType.Explicit, ...))`:
      every array's layout is part of its type; 'fsdp' then hands the loss
      the gathered parameters, its gradients reduced back onto their
      shards). Default: one Auto axis over `jax.devices()`.
    parameter_sharding: how the parameters and their optimizer state are
      placed on the mesh (Haiku state is always replicated; D devices; P, O
      the bytes of the parameters and optimizer state):

      - 'replicated': a full copy on every device (data parallelism; P + O per
        device; one gradient all-reduce per step).
      - 'fsdp' (ZeRO-3): each parameter of at least `training.FSDP_MIN_SIZE`
        (1024) elements is split over all the mesh's devices along its
        largest dimension divisible by D (the last such on a tie; see
        `training.fsdp_spec`, which a callable can reuse), its
        optimizer state alike; smaller leaves (and leaves with no such
        dimension) are replicated. About (P + O) / D per device, plus the
        whole parameters of the layers being computed: XLA all-gathers each
        sharded parameter where it is used (per layer inside the scan under
        `scan_layers=True`) and reduces each gradient onto its shards.
      - A callable `(path, leaf) -> jax.sharding.PartitionSpec | None`: the
        spec of each parameter (None: replicated), for tensor or expert
        parallelism; `path` is the parameter's keys joined by '/'
        ('transformer/block_0/attention/query/w'); the optimizer state
        follows. Memory: each leaf's size over the product of the sizes of
        the mesh axes its spec names. A callable with a `tensor_axis`
        attribute (`probjax_hk.tensor_parameter_sharding(tensor_axis)`:
        Megatron-style tensor parallelism, attention heads and MLP hidden
        units split over that mesh axis) also keeps each batch whole
        along that axis: every device along it sees the same rows.

      `FitResult.params` and `opt_state` come back with these shardings.
    sequence_axis: None, or the name of a mesh axis of size C to split time
      over (context parallelism, for sequences too long for one device):
      every batch leaf of rank >= 2 is [B, T, ...] with time on axis 1, and
      is placed with B over the mesh's other axes (`batch_size` divisible by
      their D / C devices) and T over this one (each device holds T / C
      steps of B * C / D rows); leaves of rank 1 ([B]) are split by rows
      only. Every mesh axis must be Explicit and T divisible by C. The
      model sees arrays [B, T, ...] whose types say how they are split:
      `ops.linear_scan`, `ops.ssd`, `ops.selective_scan` and
      `ops.gated_delta_rule` then run each device's steps and pass the
      states between devices, the short convolutions of the Mamba cells
      exchange their W - 1 boundary steps, `dot_product_attention` runs
      ring attention, and layers that work per step (projections, norms,
      MLPs, embeddings) need no communication. A model or loss that cannot
      take the split (cuDNN attention asked for by name, a slice such
      as `x[:, 1:]` along time: shift targets in the data instead) is a
      ValueError naming `sequence_axis` and the module where it failed,
      raised before anything is compiled.
    donate: donate the training state's buffers to the step (saves memory;
      the state is fit()'s own copy, never the caller's arrays).
    progress: show a tqdm bar with the loss and steps/s.
    log_every: `absl.logging.info` a line every this many steps.
    last_batch: 'drop' or 'pad' the last partial batch (pad: a row mask).
    on_nonfinite: 'raise': the first step with a non-finite loss, gradient or
      update ends the fit with `NonFiniteLossError` (naming the step k; its
      `result` and the checkpoint hold the last finite parameters, those of
      step k - 1, and are labelled with that step, so that a resumed fit runs
      step k again). 'skip':
      such steps are rejected (parameters unchanged), logged, listed in
      `history['nonfinite_steps']`, and the fit goes on.
    steps_per_call: run up to this many steps in one compiled call (a
      `lax.scan`; a stream's batches are stacked [K, B, ...] on the host and
      sent at once), so that the host dispatches and reads metrics once per
      call. For small models whose step takes less time than the loop's
      per-step host work (well under a millisecond on a GPU). None (the
      default): `AUTO_STEPS_PER_CALL` (64; for a stream, fewer where 64
      batches would pass `AUTO_STREAM_ITEM_BYTES`, 64 MiB) when no callbacks
      and no `checkpoint_dir` are given and the parameters, optimizer state
      and Haiku state take at most `AUTO_STATE_BYTES` (256 MiB), else 1 (a
      K-step call can differ from K single steps in the last bit; with
      checkpoints, one step per call keeps a resumed run bit-identical to an
      uninterrupted one). Calls never
      cross an evaluation, a checkpoint or the end; callbacks still see every
      step, but a stop they ask for takes effect at the end of the call.
      Such a call checks each step's loss and gradient and, once, its final
      state; the input state is kept (not donated: two copies of the state
      during a call, three while the next call runs and this one is read)
      and a call with a non-finite step is re-run from it one fully guarded
      step at a time, so results equal K = 1's.

  Returns:
    A `FitResult`.

  Raises:
    ValueError: a bad argument, before anything is compiled (among them a
      `parameter_sharding` that is not a mode or a callable, or a spec it
      returns naming an axis not in `mesh` or not dividing its dimension:
      the message names the parameter's path; a `tensor_axis` not in
      `mesh` or equal to `sequence_axis`; a `sequence_axis` not in
      `mesh`, on a mesh with an axis that is not Explicit, or not dividing
      a batch leaf's time length, or a model that cannot take its split);
      a checkpoint to resume from
      that is from another model or optimizer, or none of whose steps can be
      read (the message names the directory and the ways out).
    NonFiniteLossError: see `on_nonfinite`.
  """
  _check_unknown(unknown, _FIT_ARGUMENTS, "fit()")
  if last_batch not in data_lib.LAST_BATCH_MODES:
    raise ValueError(f"`last_batch` must be one of {data_lib.LAST_BATCH_MODES},"
                     f" got {last_batch=}")
  if on_nonfinite not in step_lib.NONFINITE_MODES:
    raise ValueError(f"`on_nonfinite` must be one of"
                     f" {step_lib.NONFINITE_MODES}, got {on_nonfinite=}")
  _check_positive(batch_size=batch_size, num_steps=num_steps, epochs=epochs,
                  eval_every=eval_every, checkpoint_every=checkpoint_every,
                  keep_checkpoints=keep_checkpoints, log_every=log_every,
                  steps_per_call=steps_per_call)
  arguments.check_bools(resume=resume, donate=donate, progress=progress)
  _check_types(loss_fn, optimizer, callbacks, mesh)
  _check_trees(params, state)
  sharding_lib.check_parameter_sharding(parameter_sharding)
  _check_checkpoint_dir(checkpoint_dir)
  if last_batch == "pad" and not _accepts_mask(loss_fn):
    raise ValueError("`last_batch='pad'` passes `mask=` to `loss_fn`, which"
                     " takes no `mask` argument")
  if checkpoint_every is not None and checkpoint_dir is None:
    raise ValueError("`checkpoint_every` needs a `checkpoint_dir`")
  callbacks = [callbacks_lib.as_callback(c) for c in callbacks]
  optimizer = DEFAULT_OPTIMIZER if optimizer is None else optimizer
  auto_steps = steps_per_call is None
  if auto_steps:
    steps_per_call = _auto_steps_per_call(params, state, optimizer, callbacks,
                                          checkpoint_dir)
  mesh = sharding_lib.default_mesh() if mesh is None else mesh
  sharding_lib.check_sequence_axis(sequence_axis, mesh)
  tensor_axis = sharding_lib.tensor_axis_of(parameter_sharding)
  sharding_lib.check_tensor_axis(tensor_axis, mesh, sequence_axis)
  param_specs = sharding_lib.parameter_specs(params, parameter_sharding, mesh)
  rng = _as_raw_key(rng)

  in_memory = data_lib.is_in_memory(data)
  if in_memory:
    if (num_steps is None) == (epochs is None):
      raise ValueError(f"in-memory `data` needs exactly one of `num_steps` and"
                       f" `epochs`, got {num_steps=} {epochs=}")
    source = data_lib.ArrayData(data, batch_size=batch_size,
                                last_batch=last_batch, mesh=mesh,
                                steps_per_call=steps_per_call)
    total = num_steps if num_steps else epochs * source.steps_per_epoch
    example = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((source.batch_size,) + x.shape[1:],
                                       x.dtype), data)
  else:
    if epochs is not None:
      raise ValueError("`epochs` needs in-memory `data`; a stream trains until"
                       " it ends or for `num_steps`")
    if not isinstance(data, Iterable):
      raise ValueError(f"`data` must be a pytree of arrays or an iterable of"
                       f" batches, got {type(data)}")
    source = data_lib.StreamData(data, batch_size=batch_size,
                                 last_batch=last_batch, mesh=mesh,
                                 steps_per_call=steps_per_call,
                                 sequence_axis=sequence_axis,
                                 tensor_axis=tensor_axis)
    if auto_steps:
      source.limit_steps_per_call(AUTO_STREAM_ITEM_BYTES)
    total = num_steps
    example = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((source.batch_size,) + np.shape(x)[1:],
                                       np.asarray(x).dtype), source.first)
  sharding_lib.check_batch_size(source.batch_size, mesh, sequence_axis,
                                tensor_axis)
  sharding_lib.check_time_length(example, mesh, sequence_axis)
  validation = None
  if validation_data is not None:
    validation = data_lib.validation_batches(validation_data, source.batch_size)

  has_state = state is not None
  # Under Explicit axes the loss sees the parameters' layout in their types.
  gather_params = (parameter_sharding == "fsdp"
                   and sharding_lib.has_explicit_axes(mesh))
  loss_param_specs = None if gather_params else param_specs
  mask_example = (jax.ShapeDtypeStruct((source.batch_size,), jnp.bool_)
                  if last_batch == "pad" else None)
  has_aux, names = _loss_structure(loss_fn, params, state, rng, example,
                                   mask_example, has_state, mesh,
                                   sequence_axis, loss_param_specs, tensor_axis)
  if validation is not None:
    _check_validation_fits(validation_data, source.batch_size, loss_fn, params,
                           state, rng, last_batch == "pad", has_state, mesh,
                           sequence_axis, loss_param_specs, tensor_axis)
  initial = {
      "params": params, "state": state if has_state else {},
      "step": np.int32(0), "rng": rng, "nonfinite": np.int32(0),
      "first_nonfinite": np.int32(-1)}
  opt_shapes = jax.eval_shape(optimizer.init, params)
  layout = sharding_lib.train_state_layout(params, param_specs, opt_shapes,
                                           initial["state"])
  spec = step_lib.StepSpec(
      loss_fn=loss_fn, optimizer=optimizer, has_state=has_state,
      has_aux=has_aux, use_mask=last_batch == "pad",
      on_nonfinite=on_nonfinite, mesh=mesh, donate=donate,
      metric_names=names, layout=layout, sequence_axis=sequence_axis,
      tensor_axis=tensor_axis, gather_params=gather_params)
  shardings = layout.shardings(mesh)

  history: dict[str, list] = {"step": []}
  checkpointer, restored = None, None
  if checkpoint_dir is not None:
    checkpointer = checkpoints_lib.Checkpointer(
        checkpoint_dir, keep=keep_checkpoints, replace=not resume)
  if checkpointer is not None and resume:
    # The newest readable step, restored straight into this run's shardings.
    template = dict(jax.eval_shape(lambda t: t, initial), opt_state=opt_shapes)
    try:
      restored = checkpointer.restore_newest(template, shardings)
    except BaseException:
      checkpointer.close()
      raise
  if restored is not None:
    ts, meta = restored
    history = {k: [np.nan if v is None else v for v in values]
               for k, values in meta["history"].items()}
    if total is not None and int(ts["step"]) >= total:
      # Else a rerun of the same script returns the old result in silence.
      logging.warning(
          "fit: checkpoint_dir %s already holds step %d >= the %d steps asked"
          " for (%s): nothing to train; pass resume=False to start a fresh"
          " run there, more steps to continue it, or another checkpoint_dir",
          checkpoint_dir, int(ts["step"]), total,
          f"num_steps={num_steps}" if num_steps else f"epochs={epochs}")
  else:
    # Copies on the mesh, so that donating them never hits the caller.
    ts = sharding_lib.copy_to(
        initial, {k: v for k, v in shardings.items() if k != "opt_state"})
    ts["opt_state"] = step_lib.init_optimizer(spec)(ts["params"])
  loop = runner_lib.Runner(spec, ts, history, callbacks, checkpointer, checkpoint_every,
               progress, log_every, total, steps_per_call)
  try:
    if in_memory:
      loop.run_arrays(source, eval_every, validation)
    else:
      loop.run_stream(source, eval_every, validation)
  finally:
    if not in_memory:
      source.close()
    loop.finish()
    if checkpointer is not None:
      checkpointer.close()
  return loop.result(checkpoint_dir)


def fit_model(transformed: hk.Transformed | hk.TransformedWithState, data, *,
              params=None, state=None, rng=None, **fit_kwargs) -> FitResult:
  """`fit()` for a transformed function that returns its own loss.

  `transformed.apply(params, [state,] rng, batch)` must return the loss (or
  `(loss, aux)`); `hk.transform_with_state` functions also return the state.
  Missing `params` (and `state`) are initialised with `transformed.init` on the
  first batch. `transformed.apply` is the loss function; repeated calls reuse
  the compiled step, also for a new `hk.transform` of the same model.

  Args:
    transformed: `hk.transform(f)` or `hk.transform_with_state(f)` where
      `f(batch)` returns the scalar loss.
    data: as in `fit()`.
    params, state: initial values (default: `transformed.init`; with a
      `parameter_sharding` other than 'replicated' it runs compiled, creating
      each parameter in its sharding, so that no device needs room for all
      of them).
    rng: as in `fit()`; the initialisation uses `fold_in(rng, 3)`.
    **fit_kwargs: the keyword arguments of `fit()` (`mesh`,
      `parameter_sharding`, ...).

  Returns:
    `fit()`'s `FitResult`.
  """
  _check_unknown({k: v for k, v in fit_kwargs.items()
                  if k not in _FIT_ARGUMENTS},
                 _FIT_ARGUMENTS + ("params",), "fit_model()")
  with_state = isinstance(transformed, hk.TransformedWithState)
  if not isinstance(transformed, (hk.Transformed, hk.TransformedWithState)):
    raise ValueError(f"`transformed` must be hk.transform(...) or"
                     f" hk.transform_with_state(...), got {type(transformed)}")
  # The arguments fit() checks cheaply, checked before `transformed.init` runs.
  _check_positive(**{k: fit_kwargs[k] for k in _POSITIVE_ARGUMENTS
                     if k in fit_kwargs})
  arguments.check_bools(**{k: fit_kwargs[k] for k in _FLAG_ARGUMENTS if k in fit_kwargs})
  _check_checkpoint_dir(fit_kwargs.get("checkpoint_dir"))
  parameter_sharding = fit_kwargs.get("parameter_sharding", "replicated")
  sharding_lib.check_parameter_sharding(parameter_sharding)
  mesh = fit_kwargs.get("mesh")
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"`mesh` must be a jax.sharding.Mesh or None, got {mesh!r}")
  if state is not None and not with_state:
    raise ValueError("`state` is for hk.transform_with_state(...) functions; "
                     "`transformed` is hk.transform(...), which keeps no state")
  if not (data_lib.is_in_memory(data) or isinstance(data, Iterable)):
    raise ValueError(f"`data` must be a pytree of arrays or an iterable of"
                     f" batches, got {type(data)}")
  key = _as_raw_key(rng)
  if params is None or (with_state and state is None):
    if data_lib.is_in_memory(data):
      size = fit_kwargs.get("batch_size") or data_lib.leading_dim(data, "data")
      example = jax.tree.map(lambda x: x[:size], data)
    else:
      iterator = iter(data)
      example = next(iterator, None)
      if example is None:
        raise ValueError("`data` is an empty stream: it yielded no batch")
      data = _chain_first(example, iterator)
    init_key = jax.random.fold_in(key, 3)
    if parameter_sharding == "replicated":
      init_out = transformed.init(init_key, example)
    else:
      init_out = _init_sharded(
          transformed.init, init_key, example, with_state, parameter_sharding,
          sharding_lib.default_mesh() if mesh is None else mesh)
    if with_state:
      init_params, init_state = init_out
      params = init_params if params is None else params
      state = init_state if state is None else state
    else:
      params = init_out
  return fit(transformed.apply, params, data, rng=key,
             state=state if with_state else None, **fit_kwargs)


def _init_sharded(init, key, example, with_state, parameter_sharding, mesh):
  """`init(key, example)` compiled, its parameters created straight in
  their shardings (the Haiku state replicated)."""
  with jax.set_mesh(mesh):
    shapes = jax.eval_shape(init, key, example)
    specs = sharding_lib.parameter_specs(shapes[0] if with_state else shapes,
                                         parameter_sharding, mesh)
    placed = sharding_lib.Layout.of(specs).shardings(mesh)
    if with_state:
      placed = (placed, sharding_lib.replicated(mesh))
  # A Program: a new hk.transform of the same model compiles nothing.
  return programs.Program(init, mesh, out_shardings=placed)(key, example)


def _chain_first(first, iterator):
  yield first
  yield from iterator
