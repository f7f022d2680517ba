"""The host side of one `fit()`: dispatching compiled steps, reading each
call's metrics one call behind, and the events between steps (evaluation,
checkpoints, callbacks, the progress bar, the non-finite guard).

`fit()` (`loop.py`) checks its arguments, builds the data source, the step
spec and the train state on the mesh, then hands them to a `Runner`, whose
`run_arrays` or `run_stream` drives the steps and whose `result()` is what
`fit()` returns (or raises, as `NonFiniteLossError`).
"""

import collections
import dataclasses
import math
import time
from typing import Any, NamedTuple

from absl import logging
import jax
import numpy as np
import tqdm

from probjax_hk.training import callbacks as callbacks_lib
from probjax_hk.training import data as data_lib
from probjax_hk.training import sharding as sharding_lib
from probjax_hk.training import step as step_lib


@dataclasses.dataclass
class FitResult:
  """What `fit()` returns.

  Attributes:
    params: the trained parameters, on the mesh as `fit()`'s
      `parameter_sharding` placed them (replicated, or sharded).
    opt_state: the optimizer state, each leaf placed like the parameter it
      mirrors.
    state: the Haiku state (None when `fit()` got none).
    step: batches consumed in total (a resumed fit counts the earlier ones).
    history: numpy arrays: `step`, `loss`, `grad_norm`, `finite` and every
      scalar of the loss's aux dict, one entry per step (a resumed fit holds the
      earlier steps too); `val_step`, `val_loss` per validation pass;
      `nonfinite_steps`; `steps_per_sec` (one value: this call's steady-state
      throughput, the first step's compile excluded).
    stopped_early: a callback stopped the fit.
    checkpoint_dir: where checkpoints were written, if anywhere.
  """
  params: Any
  opt_state: Any
  state: Any
  step: int
  history: dict[str, np.ndarray]
  stopped_early: bool = False
  checkpoint_dir: str | None = None

  @property
  def steps_per_sec(self) -> float:
    return float(self.history["steps_per_sec"][0])


class NonFiniteLossError(FloatingPointError):
  """A step's loss, gradient or update was NaN or infinite.

  Attributes:
    step: the first such step k (1-based).
    result: the `FitResult` with the last finite parameters: its `step` is
      theirs (k - 1, as is the checkpoint's) and its history ends with step
      k's row, whose loss is the non-finite one.
  """

  def __init__(self, message: str, step: int, result: FitResult):
    super().__init__(message)
    self.step = step
    self.result = result


class Call(NamedTuple):
  """A dispatched call whose metrics the host has not read yet."""
  first: int           # its first step
  steps: int
  metrics: Any         # device metrics [steps, M]
  check: Any           # optimistic calls: (input state, final-state ok, replay)
  undo: Any            # streams: hands the call's batches back (else None)


# History entries with one value per validation pass (the others: one per
# step, except `nonfinite_steps`, a list of steps).
_EVAL_KEYS = ("val_step", "val_loss")


def _history_until(history: dict[str, list], step: int,
                  eval_step: int | None = None) -> dict[str, list]:
  """The rows of `history` of the steps up to `step`, and of the validation
  passes up to `eval_step` (default `step`)."""
  eval_step = step if eval_step is None else eval_step
  rows = sum(1 for s in history["step"] if s <= step)  # ascending
  evals = sum(1 for s in history.get("val_step", ()) if s <= eval_step)
  out = {}
  for key, values in history.items():
    if key == "nonfinite_steps":
      out[key] = [s for s in values if s <= step]
    else:
      out[key] = list(values[:evals if key in _EVAL_KEYS else rows])
  return out


def _jsonable(history: dict[str, list]) -> dict[str, list]:
  return {k: [None if isinstance(v, float) and not math.isfinite(v) else v
              for v in values] for k, values in history.items()}


def _copy_metrics_early() -> bool:
  """On an accelerator, each step's metrics start their copy to the host as
  soon as the step is dispatched, so that reading them a step later does not
  wait for a transfer that could have overlapped. On CPU there is no transfer
  to hide, so the extra call would only add host work to every step."""
  return jax.default_backend() != "cpu"


def eval_params_copy(spec, ts):
  """(params, Haiku state or None): a copy of the train state's, for
  `Callback.on_eval_params`, in their shardings (the next step may donate
  the originals)."""
  shardings = spec.layout.shardings(spec.mesh)
  keep = ("params", "state") if spec.has_state else ("params",)
  copy = sharding_lib.copy_to({k: ts[k] for k in keep},
                              {k: shardings[k] for k in keep})
  return copy["params"], copy.get("state")


class Runner:
  """The host side of one fit: dispatch, metrics one step behind, events."""

  def __init__(self, spec, ts, history, callbacks, checkpointer,
               checkpoint_every, progress, log_every, total, steps_per_call=1):
    self.spec = spec
    self.ts = ts
    self.history = history
    self.callbacks = callbacks
    self.checkpointer = checkpointer
    self.checkpoint_every = checkpoint_every
    self.log_every = log_every
    self.total = total
    self.steps_per_call = steps_per_call
    self.step = int(ts["step"])
    self.pending: list[Call] = []  # at most 2: one read, one in flight
    self.copy_metrics_early = _copy_metrics_early()
    self.stop = False
    self.stopped_early = False
    self.nonfinite_step = None
    self.rewound = False
    self.last_eval_step = None
    self.timer_start = None  # after the first processed step (compile)
    self.timer_steps = 0
    self.bar = tqdm.tqdm(total=total, initial=self.step, unit="step",
                         disable=not progress, dynamic_ncols=True)
    for callback in callbacks:
      callback.on_train_begin(self.step)

  # --- the two drivers -------------------------------------------------------

  def run_arrays(self, source: data_lib.ArrayData, eval_every, validation):
    step_fns = {1: step_lib.array_step(self.spec)}
    if self.steps_per_call > 1:
      step_fns[self.steps_per_call] = step_lib.array_step(
          self.spec, self.steps_per_call, optimistic=True)
    key = step_lib.data_key(self.ts["rng"])
    steps_per_epoch = source.steps_per_epoch
    steps_per_block = steps_per_epoch * source.epochs_per_block
    if eval_every is None:
      eval_every = steps_per_epoch
    # A multi-step call must end at or before every step where the host acts
    # between steps: evaluations, checkpoints, the end, a new block of orders.
    boundaries = [steps_per_block, self.checkpoint_every,
                  eval_every if validation is not None else None]
    order = {}  # block -> the orders of its epochs (one block at a time)

    def dispatch():
      block = self.step // steps_per_block
      if block not in order:
        order.clear()
        order[block] = source.permutation(key, block)
      n = self.steps_per_call
      if n > 1 and not self._call_fits(n, boundaries):
        n = 1
      args = (source.arrays, order[block], source.batch_size, steps_per_epoch,
              source.num_examples)
      out = step_fns[n](self.ts, *args)
      # (No undo: a dropped call's rows are the next call's, by step index.)
      if n == 1:
        return out, n, None, None
      def replay():  # the same n steps, fully guarded, from the input state
        for _ in range(n):
          if not self.stop:
            self._replay_step(step_fns[1](self.ts, *args))
      return out[:2], n, (self.ts, out[2], replay), None
    self._guard(self._run(dispatch, eval_every, validation))

  def _call_fits(self, n: int, boundaries) -> bool:
    """Whether steps `step + 1 .. step + n` cross no boundary before the last."""
    start, end = self.step, self.step + n
    if self.total is not None and end > self.total:
      return False
    return all(not every or (end - 1) // every == start // every
               for every in boundaries)

  def run_stream(self, source: data_lib.StreamData, eval_every, validation):
    step_fns = {n: step_lib.stream_step(self.spec, n, optimistic=n > 1)
                for n in {1, source.steps_per_call}}
    boundaries = [self.checkpoint_every,
                  eval_every if validation is not None else None]
    batches = iter(source)
    ready = collections.deque()  # StreamItems taken from the prefetcher

    def dispatch():
      if not ready:
        item = next(batches, None)
        if item is None:
          return None
        ready.extend(item if isinstance(item, list) else [item])
      item = ready.popleft()
      if item.count > 1 and not self._call_fits(item.count, boundaries):
        ready.extendleft(reversed(item.split()))  # one step at a time up to it
        item = ready.popleft()
      out = step_fns[item.count](self.ts, item.batch, item.mask)
      undo = lambda: ready.appendleft(item)  # a dropped call's batches go back
      if item.count == 1:
        return out, 1, None, undo
      def replay():  # the same batches, fully guarded, from the input state
        for single in item.split():
          if not self.stop:
            self._replay_step(step_fns[1](self.ts, single.batch, single.mask))
      return out[:2], item.count, (self.ts, out[2], replay), undo
    self._guard(self._run(dispatch, eval_every, validation))

  # --- the loop --------------------------------------------------------------

  def _guard(self, run):
    """Runs the loop; Ctrl-C saves a checkpoint before it propagates."""
    try:
      run()
    except KeyboardInterrupt:
      logging.warning("fit: interrupted at step %d", self.step)
      self._flush()
      self._save()
      raise

  def _run(self, dispatch, eval_every, validation):
    def run():
      while not self.stop and (self.total is None or self.step < self.total):
        out = dispatch()
        if out is None:  # the stream ended
          break
        (self.ts, metrics), steps, check, undo = out
        if self.copy_metrics_early:
          metrics.copy_to_host_async()
          if check is not None:
            check[1].copy_to_host_async()
        self.pending.append(Call(self.step + 1, steps, metrics, check, undo))
        self.step += steps
        # Read each call while the next one runs, so the device never waits
        # for the host's reading and dispatching. A roll-back or a stop then
        # drops the call in flight (`_drop_in_flight`).
        while len(self.pending) > 1:
          self._process_oldest()
          if self.stop:
            self._drop_in_flight()
            break
        if validation is not None and eval_every and self.step % eval_every == 0:
          self._flush()
          self._evaluate(validation)
        if self.checkpoint_every and self.step % self.checkpoint_every == 0:
          self._flush()
          self._save()
      self._flush()
      self._rewind_nonfinite()
      if validation is not None and self.last_eval_step != self.step:
        self._evaluate(validation)
      self._save()
    return run

  def _rewind_nonfinite(self):
    """After a non-finite stop at step k (on_nonfinite='raise'), labels the
    state with the step of the parameters it holds, k - 1: the step and the
    rejected steps k and later (the one in flight) are undone in its
    counters, the history keeps the steps up to k (k's non-finite row
    explains the stop; a checkpoint keeps those up to k - 1) and the
    validation passes up to k - 1, so that a resumed fit runs step k again
    and skips no batch. Idempotent."""
    if self.nonfinite_step is None or self.rewound:
      return
    self.rewound = True
    first = int(self.ts["first_nonfinite"])
    self.nonfinite_step, self.step = first, first - 1
    put = lambda value, like: jax.device_put(np.int32(value), like.sharding)
    self.ts = dict(self.ts, step=put(first - 1, self.ts["step"]),
                   nonfinite=put(0, self.ts["nonfinite"]),
                   first_nonfinite=put(-1, self.ts["first_nonfinite"]))
    self.history = _history_until(self.history, first, first - 1)
    evals = self.history.get("val_step")
    self.last_eval_step = evals[-1] if evals else None

  def _flush(self):
    while self.pending:
      self._process_oldest()

  def _process_oldest(self):
    call = self.pending.pop(0)
    self._process(call.first, call.steps, call.metrics, call.check)

  def _process(self, first: int, steps: int, device_metrics, check=None):
    rows = np.asarray(device_metrics).reshape(steps, -1).tolist()  # one host copy
    if check is not None:  # an optimistic call (step.array_step)
      ts_in, state_ok, replay = check
      finite = self.spec.metric_names.index("finite")
      if not (bool(state_ok) and all(values[finite] for values in rows)):
        logging.info("fit: steps %d-%d: a non-finite step; re-running them"
                     " with the full guard", first, first + steps - 1)
        self._discard_pending()  # a later call in flight started from this one
        self.ts, self.step = ts_in, first - 1
        replay()
        return
    # Throughput counts from the end of the first call (its compile excluded).
    now = time.perf_counter()
    if self.timer_start is None:
      self.timer_start = now
    else:
      self.timer_steps += steps
    self.timer_end = now
    names = self.spec.metric_names
    if (steps > 1 and not self.callbacks and not self.log_every
        and all(values[names.index("finite")] for values in rows)):
      self._process_quiet(first, steps, rows)
      return
    for i, values in enumerate(rows):
      self._process_step(first + i, dict(zip(names, values)))

  def _drop_in_flight(self):
    """After a stop: discards the call dispatched after the stopping one when
    its input, the state the stop should keep, still exists (an optimistic
    call does not donate it) and goes back to that state. A single step
    donates its input: it stays, and the stop takes effect after it, as with
    one step per call. Costs one more state kept while an optimistic call is
    in flight (its input, its output, and the previous call's input)."""
    if self.pending and self.pending[0].check is not None:
      in_flight = self.pending[0]
      self.ts, self.step = in_flight.check[0], in_flight.first - 1
      self._discard_pending()

  def _discard_pending(self):
    """Drops the calls still pending, newest first, handing a stream's
    batches back so that they are trained on next, in order."""
    for call in reversed(self.pending):
      if call.undo is not None:
        call.undo()
    self.pending.clear()

  def _replay_step(self, out):
    """Takes one re-run step's (ts, metrics) and processes it at once."""
    self.ts, metrics = out
    self.step += 1
    self._process(self.step, 1, metrics)

  def _process_quiet(self, first: int, steps: int, rows: list):
    """`_process_step` for a call's finite steps when no callback or log line
    needs each step: the history grows by columns, the bar once per call."""
    last = first + steps - 1
    self.history["step"].extend(range(first, last + 1))
    for name, column in zip(self.spec.metric_names, zip(*rows)):
      self.history.setdefault(name, []).extend(column)
    self.bar.update(steps)
    shown = [s for s in (last - last % 10, self.total) if s and first <= s <= last]
    if shown:
      loss = rows[max(shown) - first][self.spec.metric_names.index("loss")]
      self.bar.set_postfix(loss=f"{loss:.4g}", refresh=False)

  def _process_step(self, step: int, metrics: dict):
    self.history["step"].append(step)
    for name, value in metrics.items():
      self.history.setdefault(name, []).append(value)
    if not metrics["finite"]:
      self.history.setdefault("nonfinite_steps", []).append(step)
      logging.warning("fit: step %d: non-finite loss/gradient/update (loss=%s);"
                      " its update was rejected", step, metrics["loss"])
      if self.spec.on_nonfinite == "raise" and self.nonfinite_step is None:
        self.nonfinite_step = step
        self.stop = True
    self.bar.update(1)
    if step % 10 == 0 or step == self.total:
      self.bar.set_postfix(loss=f"{metrics['loss']:.4g}", refresh=False)
    if self.log_every and step % self.log_every == 0:
      logging.info("fit: step %d loss %.6g grad_norm %.4g %.1f steps/s", step,
                   metrics["loss"], metrics["grad_norm"], self._rate())
    for callback in self.callbacks:
      if callback.on_step_end(step, metrics):
        self.stop = True
        self.stopped_early = True

  def _rate(self) -> float:
    if not self.timer_steps:
      return float("nan")
    return self.timer_steps / max(self.timer_end - self.timer_start, 1e-9)

  def _evaluate(self, validation):
    eval_fn = step_lib.eval_step(self.spec)
    mesh = self.spec.mesh
    total, rows = 0.0, 0
    for batch in validation():
      n = data_lib.leading_dim(batch, "validation_data batch")
      axes = dict(sequence_axis=self.spec.sequence_axis,
                  tensor_axis=self.spec.tensor_axis)
      if sharding_lib.splits_evenly(batch, mesh, **axes):
        batch = sharding_lib.put_batch(batch, mesh, **axes)
      else:
        batch = jax.device_put(batch, sharding_lib.replicated(mesh))
      loss = eval_fn(self.ts["params"], self.ts["state"], self.ts["rng"], batch)
      total += float(loss) * n
      rows += n
    val_loss = total / max(rows, 1)
    if not math.isfinite(val_loss):
      logging.warning("fit: step %d: the validation loss is %s (a non-finite"
                      " loss on some validation batch)", self.step, val_loss)
    self.last_eval_step = self.step
    self.history.setdefault("val_step", []).append(self.step)
    self.history.setdefault("val_loss", []).append(val_loss)
    logging.info("fit: step %d val_loss %.6g", self.step, val_loss)
    takers = [c for c in self.callbacks
              if callbacks_lib.overrides(c, "on_eval_params")]
    if takers:
      params, state = eval_params_copy(self.spec, self.ts)
      for callback in takers:
        if callback.on_eval_params(self.step, params, state):
          self.stop = True
          self.stopped_early = True
    for callback in self.callbacks:
      if callback.on_eval_end(self.step, {"val_loss": val_loss}):
        self.stop = True
        self.stopped_early = True

  def _save(self):
    if self.checkpointer is None:
      return
    self._rewind_nonfinite()
    history = _history_until(self.history, self.step)
    self.checkpointer.save(self.step, self.ts, {
        "step": self.step, "history": _jsonable(history),
        "has_state": self.spec.has_state})  # an empty Haiku state is not None

  def finish(self):
    self.bar.close()
    for callback in self.callbacks:
      callback.on_train_end(self.step)

  def result(self, checkpoint_dir) -> FitResult:
    self._rewind_nonfinite()
    history = {k: np.asarray(v) for k, v in self.history.items()}
    history["steps_per_sec"] = np.asarray([self._rate()])
    result = FitResult(
        params=self.ts["params"], opt_state=self.ts["opt_state"],
        state=self.ts["state"] if self.spec.has_state else None,
        step=self.step, history=history, stopped_early=self.stopped_early,
        checkpoint_dir=checkpoint_dir)
    if self.nonfinite_step is not None:
      first = self.nonfinite_step
      raise NonFiniteLossError(
          f"fit: non-finite loss, gradient or update at step {first}; its"
          f" update was rejected and the fit stopped. The error's `result` (and"
          f" the checkpoint, if any) holds the last finite parameters, those"
          f" of step {first - 1}; a resumed fit runs step {first} again.",
          first, result)
    return result
