"""`Callback.on_eval_params`: the parameters at fit()'s validation passes."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk
from probjax_hk.training import callbacks as callbacks_lib
from probjax_hk.training import runner as runner_lib
from tests.training import common

fit = probjax_hk.fit


class _Keep(probjax_hk.training.Callback):
  """Keeps what `on_eval_params` gets and the order of the eval hooks."""

  def __init__(self, stop_at=None):
    self.kept = []    # (step, params, state)
    self.events = []  # ("params" | "end", step)
    self.stop_at = stop_at

  def on_eval_params(self, step, params, state):
    self.kept.append((step, params, state))
    self.events.append(("params", step))
    return self.stop_at is not None and step >= self.stop_at

  def on_eval_end(self, step, metrics):
    self.events.append(("end", step))


@pytest.fixture
def copies(monkeypatch):
  """Counts the runner's copies of the parameters for `on_eval_params`."""
  made = []
  copy = runner_lib.eval_params_copy

  def counting(spec, ts):
    made.append(int(ts["step"]))
    return copy(spec, ts)

  monkeypatch.setattr(runner_lib, "eval_params_copy", counting)
  return made


def _fit(callbacks, num_steps=10, eval_every=4, **kwargs):
  return fit(common.loss_fn, common.init_params(), common.make_data(),
             batch_size=16, num_steps=num_steps, optimizer=common.OPTIMIZER,
             progress=False, validation_data=common.make_data(32, seed=1),
             eval_every=eval_every, callbacks=callbacks, **kwargs)


@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_the_hook_gets_copies_that_outlive_the_next_steps(steps_per_call):
  keep = _Keep()
  # donate=True: each step deletes its input buffers, fit()'s own arrays.
  r = _fit([keep], donate=True, steps_per_call=steps_per_call)
  # Every validation pass, the final one at step 10 included, params first.
  assert [step for step, _, _ in keep.kept] == [4, 8, 10]
  np.testing.assert_array_equal(r.history["val_step"], [4, 8, 10])
  assert keep.events == [(kind, step) for step in (4, 8, 10)
                         for kind in ("params", "end")]
  # Read after the fit: the copies were not donated with the runner's arrays.
  host = [jax.tree.map(np.asarray, params) for _, params, _ in keep.kept]
  jax.tree.map(np.testing.assert_array_equal, host[-1],
               jax.tree.map(np.asarray, r.params))
  # Snapshots, not views of the moving state: step 4's differ from step 10's.
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(host[0]), jax.tree.leaves(host[-1])))
  assert jax.tree.structure(keep.kept[0][1]) == jax.tree.structure(r.params)
  for kept, final in zip(jax.tree.leaves(keep.kept[-1][1]),
                         jax.tree.leaves(r.params)):
    assert kept.sharding == final.sharding and kept.dtype == final.dtype
  assert all(state is None for _, _, state in keep.kept)  # fit got no state


def test_the_hook_gets_the_haiku_state():
  def f(batch):
    pred = hk.nets.MLP([8, 1])(batch["x"])[:, 0]
    count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
    hk.set_state("count", count + 1)
    return jnp.mean((pred - batch["y"]) ** 2)

  keep = _Keep()
  r = probjax_hk.fit_model(hk.transform_with_state(f), common.make_data(),
                           batch_size=32, num_steps=5, progress=False,
                           validation_data=common.make_data(32, seed=1),
                           eval_every=2, callbacks=[keep])
  assert [step for step, _, _ in keep.kept] == [2, 4, 5]
  # The state after each pass's steps (validation does not count).
  assert [int(state["~"]["count"]) for _, _, state in keep.kept] == [2, 4, 5]
  assert int(r.state["~"]["count"]) == 5


def test_returning_true_stops_the_fit_at_that_pass():
  keep = _Keep(stop_at=6)
  r = _fit([keep], num_steps=30, eval_every=3)
  assert r.stopped_early and r.step == 6
  np.testing.assert_array_equal(r.history["val_step"], [3, 6])
  assert keep.events[-1] == ("end", 6)  # on_eval_end still sees that pass


def test_no_copy_without_a_callback_that_overrides_the_hook(copies):
  seen = []

  class OnlyEnd(probjax_hk.training.Callback):
    def on_eval_end(self, step, metrics):
      seen.append(("class", step, metrics["val_loss"]))

  def record(step, metrics):
    value = metrics.get("val_loss", metrics.get("loss"))
    seen.append(("function", step, value))

  r = _fit([record, OnlyEnd(), probjax_hk.EarlyStopping(patience=100)])
  assert copies == []
  # The function sees each step's loss and each pass's val_loss, as before.
  assert [s for kind, s, _ in seen if kind == "function"] == [
      1, 2, 3, 4, 4, 5, 6, 7, 8, 8, 9, 10, 10]
  np.testing.assert_array_equal(
      [v for kind, _, v in seen if kind == "class"], r.history["val_loss"])

  # One copy per pass, shared by every callback that takes the parameters.
  first, second = _Keep(), _Keep()
  _fit([record, first, second])
  assert copies == [4, 8, 10]
  for (_, a, _), (_, b, _) in zip(first.kept, second.kept):
    assert all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_overrides_sees_subclasses_and_instance_functions():
  base = probjax_hk.training.Callback()
  assert not callbacks_lib.overrides(base, "on_eval_params")
  function = callbacks_lib.as_callback(lambda step, metrics: None)
  assert not callbacks_lib.overrides(function, "on_eval_params")
  assert callbacks_lib.overrides(_Keep(), "on_eval_params")
  assert not callbacks_lib.overrides(_Keep(), "on_step_end")
  base.on_eval_params = lambda step, params, state: None
  assert callbacks_lib.overrides(base, "on_eval_params")


def test_a_fit_without_validation_data_never_calls_the_hook(copies):
  keep = _Keep()
  r = fit(common.loss_fn, common.init_params(), common.make_data(),
          batch_size=16, num_steps=5, optimizer=common.OPTIMIZER,
          progress=False, eval_every=2, callbacks=[keep])
  assert r.step == 5 and keep.kept == [] and copies == []
