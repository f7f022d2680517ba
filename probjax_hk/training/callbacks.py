"""Callbacks of `fit()`: see each step's metrics, stop the fit early, use the
parameters at each validation pass.

A callback is a `Callback` (override any of its hooks) or a plain function
`fn(step, metrics) -> bool | None`, called after every training step and every
validation pass. Returning True asks `fit()` to stop; None or False goes on.

Metrics are host floats. After a training step: `loss`, `grad_norm`,
`finite` (1.0 or 0.0), and every scalar of the loss's `aux` dict; after a
validation pass (`on_eval_end`): `val_loss`.

Parameters: at every validation pass (every `eval_every` steps and the one at
the end of the fit), `on_eval_params(step, params, state)` gets the current
parameters and Haiku state, before `on_eval_end` gets `val_loss`: to sample
from the model, score it on another task, or keep a snapshot. They are copies
that stay valid after the fit's next steps (which donate fit()'s own arrays),
made only when some callback overrides the hook.
A fit without `validation_data` has no validation passes and never calls it.

Timing: `fit()` reads a step's metrics while the next step already runs (it
keeps the device busy), so a stop asked by `on_step_end` at step s ends the fit
after step s + 1; with `fit(steps_per_call=K)`, at the end of the call holding
step s (at most K - 1 steps later: a multi-step call's metrics are read as
soon as it ends). `on_eval_end` runs between steps: a stop there ends the fit
at exactly that step.
"""

import math
from typing import Callable, Mapping

from absl import logging

from probjax_hk import arguments

Metrics = Mapping[str, float]


class Callback:
  """Base class: every hook does nothing and never stops the fit."""

  def on_train_begin(self, step: int) -> None:
    """Called once before the first step (`step` > 0 after a resume)."""

  def on_step_end(self, step: int, metrics: Metrics) -> bool | None:
    """Called with the metrics of training step `step` (1-based); True stops."""

  def on_eval_params(self, step: int, params, state) -> bool | None:
    """Called at each validation pass at `step`, before `on_eval_end`, with
    the parameters; True stops.

    Only at validation passes: every `eval_every` steps and at the end of the
    fit, never in a fit without `validation_data`. The arrays are a copy of
    fit()'s own (whose buffers the next step donates), so that a callback
    may keep them; the copy is made only when some callback overrides this
    hook.

    Args:
      step: the steps taken so far (the validation pass's step).
      params: the parameters, a pytree like `fit()`'s `params` (the structure
        and shapes `FitResult.params` has), placed on the fit's mesh with its
        `parameter_sharding` (replicated, or sharded).
      state: the Haiku state, replicated on the mesh (None when `fit()` got
        no `state`).
    """

  def on_eval_end(self, step: int, metrics: Metrics) -> bool | None:
    """Called after a validation pass at `step` (after `on_eval_params`);
    True stops."""

  def on_train_end(self, step: int) -> None:
    """Called once when the fit ends (also on an error or a stop)."""


class _FunctionCallback(Callback):

  def __init__(self, fn: Callable[[int, Metrics], bool | None]):
    self._fn = fn

  def on_step_end(self, step, metrics):
    return self._fn(step, metrics)

  def on_eval_end(self, step, metrics):
    return self._fn(step, metrics)


def overrides(callback: Callback, hook: str) -> bool:
  """Whether `callback` replaces the base class's `hook` (a method name such
  as 'on_eval_params'), in its class or on the instance; the base class's
  hooks do nothing."""
  method = getattr(callback, hook)  # bound, or a function set on the instance
  return getattr(method, "__func__", method) is not getattr(Callback, hook)


def as_callback(obj) -> Callback:
  """A `Callback` as is; a function `fn(step, metrics)` wrapped in one."""
  if isinstance(obj, Callback):
    return obj
  if callable(obj):
    return _FunctionCallback(obj)
  raise ValueError(f"`callbacks` entries must be Callbacks or functions"
                   f" (step, metrics) -> bool | None, got {obj!r}")


class EarlyStopping(Callback):
  """Stops the fit when a monitored metric has stopped improving.

  Args:
    patience: how many evaluations without improvement are tolerated; the fit
      stops at the `patience`-th one in a row.
    monitor: the metric to watch: 'val_loss' (checked after each validation
      pass) or a training metric such as 'loss' (checked after each step).
    min_delta: an improvement must lower the best value by more than this.
    mode: 'min' (lower is better) or 'max'.

  Raises:
    TypeError: `patience` is not an integer, `monitor` not a string or
      `min_delta` not a number.
    ValueError: `patience` is below 1, `min_delta` negative, or `mode`
      neither 'min' nor 'max'.
  """

  def __init__(self, patience: int, *, monitor: str = "val_loss",
               min_delta: float = 0.0, mode: str = "min"):
    arguments.check_positive_ints(patience=patience)
    if not isinstance(monitor, str) or not monitor:
      raise TypeError(f"`monitor` must be a metric's name ('val_loss', 'loss', ...), "
                      f"got {monitor=}")
    arguments.check_nonnegative_numbers(min_delta=min_delta)
    arguments.check_choice("mode", mode, ("min", "max"))
    self.patience = patience
    self.monitor = monitor
    self.min_delta = min_delta
    self.sign = 1.0 if mode == "min" else -1.0
    self.best = math.inf
    self.best_step = None
    self.bad_evaluations = 0
    self.stopped_step = None

  def on_train_begin(self, step):
    self.best, self.best_step, self.bad_evaluations = math.inf, None, 0
    self.stopped_step = None

  def _update(self, step, metrics):
    if self.monitor not in metrics:
      return None
    value = self.sign * float(metrics[self.monitor])
    if value < self.best - self.min_delta:
      self.best, self.best_step, self.bad_evaluations = value, step, 0
      return None
    self.bad_evaluations += 1
    if self.bad_evaluations >= self.patience:
      self.stopped_step = step
      logging.info("EarlyStopping: %s has not improved for %d evaluations"
                   " (best %.6g at step %s); stopping at step %d",
                   self.monitor, self.bad_evaluations, self.sign * self.best,
                   self.best_step, step)
      return True
    return None

  def on_step_end(self, step, metrics):
    if self.monitor.startswith("val_"):
      return None
    return self._update(step, metrics)

  def on_eval_end(self, step, metrics):
    return self._update(step, metrics)
