"""The compiled training step of `fit()` and the cache that keeps it.

`fit()` asks this module for its compiled functions by a `StepSpec`: the loss
function, the optimizer and the static options (Haiku state or not, aux or not,
row mask or not, non-finite policy, mesh, the training state's layout,
donation). Two caches keep them:

- the spec keys a process-wide cache of `programs.Program`s, so a second
  `fit()` with the same loss function and optimizer objects finds its
  functions and their executables at once (no tracing);
- a new spec (an optimizer written inline again, a loss function defined
  again, a new `hk.transform` of the same model) makes new Programs, which
  trace once and take the executable another Program compiled when the
  traced program is the same (`programs.program_key`): same equations,
  literals (an optimizer's hyperparameters), closed-over values, shapes,
  shardings and static options. Anything that changes the program (another
  learning rate, width or optimizer) compiles.

Every function here is traced and compiled under `jax.set_mesh(mesh)`, so
that the ops inside see the mesh and run their Pallas kernels per shard
(ops/_sharding.py) instead of gathering the batch in front of them.

The training state is a dict of pytrees, placed on the mesh by
`StepSpec.layout` (parameters and their optimizer state as `fit()`'s
`parameter_sharding` asks, everything else replicated):

  params, opt_state, state   the model's parameters, optimizer and Haiku state
  step                       int32, batches consumed so far
  rng                        the base key (raw uint32 [2]); step s uses
                             fold_in(fold_in(rng, 1), s), epochs fold_in(rng, 0)
  nonfinite                  int32, steps whose loss, gradient or update was
                             not finite (their update was rejected)
  first_nonfinite            int32, the first such step (1-based), or -1

Glossary of shapes: B batch size, N in-memory examples.
"""

import collections
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from probjax_hk.training import programs
from probjax_hk.training import sharding as sharding_lib

NONFINITE_MODES = ("raise", "skip")
_CACHE_SIZE = 32


class StepSpec(NamedTuple):
  """Everything a compiled step depends on beyond array shapes (hashable)."""
  loss_fn: Callable[..., Any]
  optimizer: optax.GradientTransformation
  has_state: bool   # loss_fn(params, state, rng, batch) -> (out, new_state)
  has_aux: bool     # out is (loss, aux) rather than loss
  use_mask: bool    # loss_fn takes mask=[B] bool (last_batch='pad')
  on_nonfinite: str  # 'raise': the first non-finite step freezes the state
  mesh: jax.sharding.Mesh
  donate: bool
  # The step's metrics, packed into one f32 vector in this order (one
  # device-to-host copy per step); None: a dict (see `metric_names`).
  metric_names: tuple[str, ...] | None = None
  # How a rejected update is kept out of the state: 'select', 'cond' or
  # 'auto' (cond on the CPU for steps without the update check, else
  # select); see `_train_step`.
  guard: str = "auto"
  # The training state's PartitionSpecs (sharding.train_state_layout);
  # None: all replicated.
  layout: sharding_lib.Layout | None = None
  # The Explicit mesh axis that splits each batch leaf's time axis (axis 1 of
  # leaves of rank >= 2); None: batches are split along their rows only.
  sequence_axis: str | None = None
  # The mesh axis a tensor-parallel layout splits heads over, along which
  # each batch stays whole; None: the batch's rows are split over it too.
  tensor_axis: str | None = None
  # The loss sees whole parameters, gathered from their layout ('fsdp' on a
  # mesh with Explicit axes, whose types would otherwise carry the split into
  # every layer); gradients are reduced back onto the layout.
  gather_params: bool = False


BASE_METRICS = ("loss", "grad_norm", "finite")


def _aux_name(key) -> str:
  """An aux scalar's metric name: its key, or `aux/<key>` where the key is a
  base metric's name (an aux 'loss' must not replace the loss)."""
  name = str(key)
  return f"aux/{name}" if name in BASE_METRICS else name


def metric_names(aux) -> tuple[str, ...]:
  """The metric names of a step whose loss returns `aux` (arrays or
  ShapeDtypeStructs): the base metrics, then the aux dict's scalars."""
  names = BASE_METRICS
  if isinstance(aux, dict):
    names += tuple(_aux_name(k) for k, v in aux.items() if not np.shape(v))
  return tuple(dict.fromkeys(names))


_cache: collections.OrderedDict = collections.OrderedDict()


def state_shardings(spec: StepSpec):
  """The training state's shardings: a tree, or one replicated sharding."""
  if spec.layout is None:
    return sharding_lib.replicated(spec.mesh)
  return spec.layout.shardings(spec.mesh)


def _cached(kind: str, spec, build: Callable[[], Any]):
  key = (kind, spec)
  if key in _cache:
    _cache.move_to_end(key)
    return _cache[key]
  value = _cache[key] = build()
  while len(_cache) > _CACHE_SIZE:
    _cache.popitem(last=False)
  return value


def step_key(rng, step):
  """The key the loss sees at (0-based) step `step`."""
  return jax.random.fold_in(jax.random.fold_in(rng, 1), step)


def data_key(rng):
  """The key of the in-memory data order (epoch e: fold_in(data_key, e))."""
  return jax.random.fold_in(rng, 0)


def eval_key(rng):
  return jax.random.fold_in(rng, 2)


def call_loss(spec: StepSpec, params, state, rng, batch, mask):
  """Calls the user's loss; returns (loss f32 scalar, new_state, aux)."""
  if spec.gather_params:
    params = jax.sharding.reshard(params, jax.sharding.PartitionSpec())
  args = (params, state, rng, batch) if spec.has_state else (params, rng, batch)
  kwargs = {"mask": mask} if spec.use_mask else {}
  out = spec.loss_fn(*args, **kwargs)
  new_state = state
  if spec.has_state:
    out, new_state = out
  loss, aux = out if spec.has_aux else (out, None)
  return jnp.asarray(loss, jnp.float32), new_state, aux


def _scalar_aux(aux) -> dict[str, jax.Array]:
  if not isinstance(aux, dict):
    return {}
  return {_aux_name(k): jnp.asarray(v, jnp.float32) for k, v in aux.items()
          if not np.shape(v)}


def _guard_kind(spec: StepSpec, check_update: bool) -> str:
  if spec.guard != "auto":
    return spec.guard
  cpu = spec.mesh.devices.flat[0].platform == "cpu"
  return "cond" if cpu and not check_update else "select"


def _train_step(spec: StepSpec, ts, batch, mask, check_update: bool = True):
  """One optimizer step on `batch`; rejects non-finite updates.

  The step is accepted when its loss, its gradient's norm and (with
  `check_update`) its update's norm are finite (and, with
  on_nonfinite='raise', no earlier step failed). The update must be checked
  before the state is written: a donated state, once written, cannot be
  restored. That check is the guard's cost (the update is materialized and
  read again before the write: about one optimizer pass, see BUILD_NOTES.md,
  fit() section); the optimistic multi-step calls leave it out and check
  the final state instead (`array_step`). Two ways to keep the old state
  (`StepSpec.guard`; timed by experiments/benchmark_fit.py --pieces):
  'select' writes `where(accept, new, old)` per leaf; 'cond' writes the new
  state inside a `lax.cond`. 'auto': 'cond' on the CPU for steps without the
  update check (the update then runs inside the branch, in place, and XLA
  drops the copies it puts before an in-place update: measured faster than
  the bare step), else 'select' (with the check, both measured alike on the
  CPU; on a GPU a conditional reads its predicate on the host).
  """
  rng = step_key(ts["rng"], ts["step"])

  def loss_and_extras(params):
    loss, new_state, aux = call_loss(spec, params, ts["state"], rng, batch,
                                     mask)
    return loss, (new_state, aux)

  (loss, (new_state, aux)), grads = jax.value_and_grad(
      loss_and_extras, has_aux=True)(ts["params"])
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

  def update():
    updates, new_opt_state = spec.optimizer.update(
        grads, ts["opt_state"], ts["params"])
    return (optax.apply_updates(ts["params"], updates), new_opt_state,
            new_state), updates

  new = None
  if check_update:
    new, updates = update()
    finite &= jnp.isfinite(optax.tree.norm(updates))
  accept = finite
  if spec.on_nonfinite == "raise":
    accept = finite & (ts["nonfinite"] == 0)
  old = (ts["params"], ts["opt_state"], ts["state"])
  if _guard_kind(spec, check_update) == "cond":
    # Without the update check the update runs inside the branch, in place.
    params, opt_state, state = jax.lax.cond(
        accept, (lambda: new) if check_update else (lambda: update()[0]),
        lambda: old)
  else:
    new = update()[0] if new is None else new
    params, opt_state, state = jax.tree.map(
        lambda a, b: jnp.where(accept, a, b), new, old)
  step = ts["step"] + 1
  new_ts = {
      "params": params,
      "opt_state": opt_state,
      "state": state,
      "step": step,
      "rng": ts["rng"],
      "nonfinite": ts["nonfinite"] + (~finite).astype(jnp.int32),
      "first_nonfinite": jnp.where(
          (ts["first_nonfinite"] < 0) & ~finite, step, ts["first_nonfinite"]),
  }
  metrics = {"loss": loss, "grad_norm": grad_norm,
             "finite": finite.astype(jnp.float32), **_scalar_aux(aux)}
  if spec.metric_names is not None:  # [M] f32, one host copy
    metrics = jnp.stack([metrics[k] for k in spec.metric_names])
  return new_ts, metrics


def state_finite(ts) -> jax.Array:
  """True when every float of the parameters, optimizer and Haiku state is
  finite: one fused read of the state (x * 0 is 0 unless x is inf or NaN)."""
  leaves = [x for x in jax.tree.leaves((ts["params"], ts["opt_state"],
                                        ts["state"]))
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  total = sum((jnp.sum(x * 0, dtype=jnp.float32) for x in leaves),
              jnp.float32(0))
  return jnp.isfinite(total)


def _jit_steps(spec: StepSpec, steps, optimistic: bool, **kwargs):
  rep = sharding_lib.replicated(spec.mesh)
  placed = state_shardings(spec)
  if optimistic:  # the caller keeps the input state to roll back to
    return programs.Program(steps, spec.mesh,
                            out_shardings=(placed, rep, rep), **kwargs)
  return programs.Program(steps, spec.mesh,
                          donate_argnums=(0,) if spec.donate else (),
                          out_shardings=(placed, rep), **kwargs)


def _optimistic(one_step, ts, length, xs=None):
  """K steps that check loss and gradient only, then the final state:
  (ts, metrics [K, M], ok). ok False: some step's update was not finite (or
  a step was rejected); the caller re-runs the K steps with the full guard
  from the input state (the input is not donated)."""
  ts, metrics = jax.lax.scan(one_step, ts, xs, length=length)
  return ts, metrics, state_finite(ts)


def stream_step(spec: StepSpec, num_steps: int = 1, optimistic: bool = False):
  """jit(ts, batch [B, ...], mask [B] | None) -> (ts, metrics); with
  `num_steps` K > 1, batch [K, B, ...] and mask [K, B] | None run K steps (a
  `lax.scan`) and the metrics come stacked [K, M]. `optimistic` (K > 1):
  see `array_step`."""
  def steps(ts, batch, mask):
    if num_steps == 1:
      return _train_step(spec, ts, batch, mask)
    if optimistic:
      return _optimistic(
          lambda ts, xs: _train_step(spec, ts, *xs, check_update=False), ts,
          None, (batch, mask))
    return jax.lax.scan(lambda ts, xs: _train_step(spec, ts, *xs), ts, (batch, mask))

  return _cached("stream", (spec, num_steps, optimistic),
                 lambda: _jit_steps(spec, steps, optimistic))


def _array_step(spec: StepSpec, ts, data, perm, batch_size, steps_per_epoch,
                num_examples, check_update=True):
  """One step on the rows `perm` assigns to `ts['step']`, gathered on the device."""
  epoch_length = steps_per_epoch * batch_size
  epochs_in_block = perm.shape[0] // epoch_length
  start = (ts["step"] % steps_per_epoch) * batch_size  # within the epoch
  offset = ((ts["step"] // steps_per_epoch) % epochs_in_block) * epoch_length
  index = jax.lax.dynamic_slice_in_dim(perm, offset + start, batch_size)
  batch = jax.tree.map(lambda x: jnp.take(x, index, axis=0), data)
  batch = sharding_lib.constrain(batch, sharding_lib.batch_shardings(
      batch, spec.mesh, sequence_axis=spec.sequence_axis,
      tensor_axis=spec.tensor_axis))
  mask = None
  if spec.use_mask:
    mask = start + jnp.arange(batch_size) < num_examples  # [B]
  return _train_step(spec, ts, batch, mask, check_update)


def array_step(spec: StepSpec, num_steps: int = 1, optimistic: bool = False):
  """jit(ts, data [N, ...], perm [E * steps_per_epoch * B], batch_size,
  steps_per_epoch, num_examples) -> (ts, metrics); gathers on the device.

  `perm` holds the orders of E consecutive epochs (a block, see
  `data.ArrayData.permutation`), the one of ts['step'] among them. With
  `num_steps` K > 1 the call runs K consecutive steps (a `lax.scan`, all in
  the same block) and returns metrics stacked [K, M]: one dispatch and one
  host read per K steps.

  `optimistic` (K > 1): the steps check only their loss and gradient, the
  call then checks that the final state is finite, returns (ts, metrics,
  ok) and does not donate its input. Only a call whose `ok` or a step's
  `finite` is false needs the full guard: the caller re-runs it from the
  input state with single steps (`fit()` does), so the result is the full
  guard's, and the update check costs one read of the state per call
  instead of about an optimizer pass per step.
  """
  def steps(ts, data, perm, batch_size, steps_per_epoch, num_examples):
    args = (data, perm, batch_size, steps_per_epoch, num_examples)
    if num_steps == 1:
      return _array_step(spec, ts, *args)
    if optimistic:
      return _optimistic(lambda ts, _: _array_step(
          spec, ts, *args, check_update=False), ts, num_steps)
    return jax.lax.scan(lambda ts, _: _array_step(spec, ts, *args), ts,
                        length=num_steps)

  return _cached("array", (spec, num_steps, optimistic),
                 lambda: _jit_steps(spec, steps, optimistic,
                                    static_argnums=(3, 4, 5)))


def eval_step(spec: StepSpec):
  """jit(params, state, rng, batch [b, ...]) -> mean loss over the b rows."""
  def evaluate(params, state, rng, batch):
    mask = None
    if spec.use_mask:
      mask = jnp.ones((jax.tree.leaves(batch)[0].shape[0],), bool)
    return call_loss(spec, params, state, eval_key(rng), batch, mask)[0]
  return _cached("eval", spec, lambda: programs.Program(evaluate, spec.mesh))


def init_optimizer(spec: StepSpec):
  """jit(params) -> optimizer state, placed by `spec.layout` (each leaf
  where the parameter it mirrors is; replicated without a layout)."""
  def build():
    placed = state_shardings(spec)
    out = placed if spec.layout is None else placed["opt_state"]
    return programs.Program(spec.optimizer.init, spec.mesh, out_shardings=out)
  return _cached("init", (spec.optimizer, spec.mesh, spec.layout), build)
