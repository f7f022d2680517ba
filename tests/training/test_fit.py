"""Tests of fit(): data kinds, compile caching, non-finite steps, arguments."""

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import probjax_hk
from probjax_hk.training import loop as fit_lib
from probjax_hk.training import runner as runner_lib
from tests.training import common

fit = probjax_hk.fit


def _assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_public_surface():
  assert probjax_hk.fit is fit_lib.fit
  assert probjax_hk.fit_model is fit_lib.fit_model
  assert probjax_hk.FitResult is fit_lib.FitResult
  assert issubclass(probjax_hk.EarlyStopping, probjax_hk.training.Callback)


def test_arrays_loss_falls_and_history():
  data = common.make_data()
  result = fit(common.loss_fn, common.init_params(), data, batch_size=16,
               epochs=8, optimizer=common.OPTIMIZER, progress=False, rng=1)
  steps_per_epoch = common.NUM_EXAMPLES // 16
  assert result.step == 8 * steps_per_epoch
  np.testing.assert_array_equal(result.history["step"],
                                np.arange(1, result.step + 1))
  loss = result.history["loss"]
  assert loss.shape == (result.step,)
  assert np.all(np.isfinite(loss))
  assert loss[-steps_per_epoch:].mean() < 0.5 * loss[:steps_per_epoch].mean()
  assert result.steps_per_sec > 0
  assert result.history["finite"].min() == 1.0
  assert result.state is None
  # The caller's params were copied, not donated.
  init = common.init_params()
  jax.tree.map(lambda a: a.block_until_ready(), init)


def test_second_call_compiles_nothing():
  def fresh_loss(params, rng, batch):  # a new function: a new cache entry
    return common.NET.apply(params, rng, batch)
  optimizer = optax.sgd(0.1)
  data = common.make_data()
  kwargs = dict(batch_size=32, num_steps=5, optimizer=optimizer,
                progress=False, validation_data=common.make_data(40, seed=1),
                eval_every=2)
  with common.count_compiles() as first:
    r1 = fit(fresh_loss, common.init_params(), data, **kwargs)
  with common.count_compiles() as second:
    r2 = fit(fresh_loss, r1.params, data, **kwargs)
  with common.count_compiles() as third:  # same start: same result
    r3 = fit(fresh_loss, common.init_params(), data, **kwargs)
  assert len(first) > 0
  assert len(second) == 0, second
  assert len(third) == 0, third
  assert r2.history["loss"][-1] < r1.history["loss"][0]
  np.testing.assert_array_equal(r1.history["loss"], r3.history["loss"])


def test_stream_equals_in_memory_on_same_batches():
  data = common.make_data()
  params = common.init_params()
  # One epoch of in-memory data, in its own shuffled order ...
  r_mem = fit(common.loss_fn, params, data, batch_size=16, epochs=1,
              optimizer=common.OPTIMIZER, progress=False, rng=3)
  perm = np.asarray(jax.random.permutation(
      jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(3), 0), 0),
      common.NUM_EXAMPLES))
  shuffled = {k: v[perm] for k, v in data.items()}
  # ... equals a stream of the same batches in the same order.
  with common.count_compiles():
    r_stream = fit(common.loss_fn, params,
                   common.stream(shuffled, 16), optimizer=common.OPTIMIZER,
                   progress=False, rng=3)
  assert r_stream.step == r_mem.step == 6
  np.testing.assert_allclose(r_stream.history["loss"], r_mem.history["loss"],
                             rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6),
               r_stream.params, r_mem.params)


def test_stream_num_steps_and_end():
  data = common.make_data()
  params = common.init_params()
  r = fit(common.loss_fn, params, common.stream(data, 16), num_steps=3,
          optimizer=common.OPTIMIZER, progress=False)
  assert r.step == 3
  r = fit(common.loss_fn, params, list(common.stream(data, 16)),
          optimizer=common.OPTIMIZER, progress=False)
  assert r.step == 6  # a list of batches is a stream; it ends cleanly


def test_stream_error_propagates():
  def broken():
    yield common.make_data(16)
    raise RuntimeError("disk on fire")
  with pytest.raises(RuntimeError, match="disk on fire"):
    fit(common.loss_fn, common.init_params(), broken(),
        optimizer=common.OPTIMIZER, progress=False)


def test_partial_last_batch_drop_and_pad():
  data = common.make_data(40)
  params = common.init_params()
  dropped = fit(common.loss_fn, params, data, batch_size=16, epochs=2,
                optimizer=common.OPTIMIZER, progress=False)
  assert dropped.step == 2 * 2  # 40 // 16
  padded = fit(common.masked_loss_fn, params, data, batch_size=16, epochs=2,
               optimizer=common.OPTIMIZER, progress=False, last_batch="pad")
  assert padded.step == 2 * 3  # ceil(40 / 16)
  # Streams: the short last batch (8 rows) is dropped or padded and masked.
  s_drop = fit(common.loss_fn, params, common.stream(data, 16),
               optimizer=common.OPTIMIZER, progress=False)
  assert s_drop.step == 2
  s_pad = fit(common.masked_loss_fn, params, common.stream(data, 16),
              optimizer=common.OPTIMIZER, progress=False, last_batch="pad")
  assert s_pad.step == 3
  # The masked last batch's loss is the loss of its 8 real rows only.
  rng = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), 1), 2)
  last = {k: v[32:] for k, v in data.items()}
  before = jax.tree.map(np.asarray, fit(
      common.masked_loss_fn, params, common.stream(data, 16),
      optimizer=common.OPTIMIZER, progress=False, last_batch="pad",
      num_steps=2).params)
  expected = common.loss_fn(before, rng, last)
  np.testing.assert_allclose(s_pad.history["loss"][2], expected, rtol=1e-5)
  with pytest.raises(ValueError, match="mask"):
    fit(common.loss_fn, params, data, batch_size=16, epochs=1,
        last_batch="pad", progress=False)


def test_validation_history_and_early_stopping():
  data = common.make_data()
  val = common.make_data(40, seed=1)
  r = fit(common.loss_fn, common.init_params(), data, batch_size=16,
          num_steps=12, optimizer=common.OPTIMIZER, progress=False,
          validation_data=val, eval_every=4)
  np.testing.assert_array_equal(r.history["val_step"], [4, 8, 12])
  assert np.all(np.isfinite(r.history["val_loss"]))
  assert r.history["val_loss"][-1] < r.history["val_loss"][0]
  # Batches of a list are re-iterable validation data, evaluated exactly.
  r2 = fit(common.loss_fn, common.init_params(), data, batch_size=16,
           num_steps=12, optimizer=common.OPTIMIZER, progress=False,
           validation_data=list(common.stream(val, 16)), eval_every=4)
  np.testing.assert_allclose(r2.history["val_loss"], r.history["val_loss"],
                             rtol=1e-5)

  # A learning rate of zero never improves: patience 2 stops at the 3rd eval.
  stopper = probjax_hk.EarlyStopping(patience=2)
  r = fit(common.loss_fn, common.init_params(), data, batch_size=16,
          num_steps=100, optimizer=_ZERO_LR, progress=False,
          validation_data=val, eval_every=2, callbacks=[stopper])
  assert r.stopped_early
  assert r.step == 6 and stopper.stopped_step == 6
  np.testing.assert_array_equal(r.history["val_step"], [2, 4, 6])

  with pytest.raises(ValueError, match="validation_data"):
    fit(common.loss_fn, common.init_params(), data, batch_size=16,
        num_steps=1, progress=False, validation_data=iter([val]))


_ZERO_LR = optax.sgd(0.0)


def test_early_metric_copies_give_the_same_history(monkeypatch):
  # The accelerator path (copy_to_host_async after each dispatch) on CPU.
  args = (common.loss_fn, common.init_params(), common.make_data())
  kwargs = dict(batch_size=16, num_steps=8, optimizer=common.OPTIMIZER, progress=False)
  plain = fit(*args, **kwargs)
  monkeypatch.setattr(runner_lib, "_copy_metrics_early", lambda: True)
  early = fit(*args, **kwargs)
  np.testing.assert_array_equal(early.history["loss"], plain.history["loss"])
  np.testing.assert_array_equal(early.history["step"], plain.history["step"])


def test_callback_sees_metrics_and_stops():
  seen = []
  def callback(step, metrics):
    seen.append((step, metrics["loss"]))
    return step >= 3
  r = fit(common.loss_fn, common.init_params(), common.make_data(),
          batch_size=16, num_steps=50, optimizer=common.OPTIMIZER,
          progress=False, callbacks=[callback])
  assert r.stopped_early
  # Metrics are read one step behind: the stop takes effect after step 4.
  assert r.step == 4
  assert [s for s, _ in seen] == [1, 2, 3, 4]
  np.testing.assert_allclose([l for _, l in seen], r.history["loss"])


def _nan_on_big_x(params, rng, batch):
  loss = common.NET.apply(params, rng, batch)
  return jnp.where(jnp.max(batch["x"]) > 100.0, jnp.nan, loss)


def _poisoned_stream(poison_step, num_batches=6):
  data = common.make_data()
  for i, batch in enumerate(common.stream(data, 16)):
    if i + 1 == poison_step:
      batch = dict(batch, x=batch["x"] + 1000.0)
    if i < num_batches:
      yield batch


def test_nonfinite_raise_keeps_last_finite_params(tmp_path):
  params = common.init_params()
  clean = fit(_nan_on_big_x, params, _poisoned_stream(None, 2),
              optimizer=common.OPTIMIZER, progress=False)
  with pytest.raises(probjax_hk.training.NonFiniteLossError,
                     match="step 3") as info:
    fit(_nan_on_big_x, params, _poisoned_stream(3), progress=False,
        optimizer=common.OPTIMIZER, checkpoint_dir=str(tmp_path))
  err = info.value
  assert err.step == 3
  # The result and the checkpoint hold the parameters after step 2.
  _assert_trees_equal(err.result.params, clean.params)
  assert np.isnan(err.result.history["loss"][2])
  restored = probjax_hk.fit(_nan_on_big_x, params, _poisoned_stream(None, 1),
                            optimizer=common.OPTIMIZER, progress=False,
                            checkpoint_dir=str(tmp_path), num_steps=1)
  _assert_trees_equal(restored.params, clean.params)


def test_nonfinite_raise_inside_a_multi_step_call_keeps_last_finite_params():
  # Step 3 of the first 4-step call is non-finite: steps 3 and 4 are rejected
  # on the device, the error names step 3, the result holds step 2's params.
  params = common.init_params()
  clean = fit(_nan_on_big_x, params, _poisoned_stream(None, 2),
              optimizer=common.OPTIMIZER, progress=False)
  with pytest.raises(probjax_hk.training.NonFiniteLossError, match="step 3") as info:
    fit(_nan_on_big_x, params, _poisoned_stream(3), progress=False,
        optimizer=common.OPTIMIZER, steps_per_call=4)
  assert info.value.step == 3
  chex.assert_trees_all_close(info.value.result.params, clean.params, rtol=1e-6)


def _nan_update_at(step):
  """An optimizer whose update is NaN at `step` (1-based) from a finite
  gradient: only the update check can catch it."""
  def init(params):
    del params
    return jnp.zeros((), jnp.int32)

  def update(updates, count, params=None):
    del params
    count = count + 1
    return jax.tree.map(lambda u: jnp.where(count == step, jnp.nan, -0.1 * u),
                        updates), count
  return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("kind,bad", [("memory", 3), ("stream", 3),
                                      ("memory", 4), ("stream", 4)])
def test_nonfinite_update_inside_a_multi_step_call_keeps_last_finite_params(
    tmp_path, kind, bad):
  # The loss and gradient of step `bad` are finite, its update is not: the
  # optimistic 4-step call is re-run with the full guard, which stops there.
  # Step 4 is the call's last: only the check of the final state sees it.
  data = common.make_data()
  source = lambda: data if kind == "memory" else common.stream(data, 16)
  kwargs = dict(batch_size=16, progress=False)
  if kind == "memory":
    kwargs["num_steps"] = 8
  clean = fit(common.loss_fn, common.init_params(), source(),
              optimizer=_nan_update_at(-1), **dict(kwargs, num_steps=bad - 1))
  with pytest.raises(probjax_hk.training.NonFiniteLossError,
                     match=f"step {bad}") as info:
    fit(common.loss_fn, common.init_params(), source(),
        optimizer=_nan_update_at(bad), steps_per_call=4,
        checkpoint_dir=str(tmp_path), **kwargs)
  result = info.value.result
  assert info.value.step == bad
  assert result.step == bad - 1  # the step of the parameters it holds
  np.testing.assert_array_equal(result.history["step"], np.arange(1, bad + 1))
  np.testing.assert_array_equal(result.history["finite"][-1], 0)
  np.testing.assert_array_equal(result.history["loss"][:-1], clean.history["loss"])
  _assert_trees_equal(result.params, clean.params)
  # The checkpoint of the stop is step bad - 1: nothing left to run.
  restored = fit(common.loss_fn, common.init_params(), source(),
                 optimizer=_nan_update_at(-1), checkpoint_dir=str(tmp_path),
                 **dict(kwargs, num_steps=bad - 1))
  assert restored.step == bad - 1
  np.testing.assert_array_equal(restored.history["step"], np.arange(1, bad))
  _assert_trees_equal(restored.params, clean.params)


def test_nonfinite_skip_rejects_the_update_and_reports_it():
  params = common.init_params()
  r = fit(_nan_on_big_x, params, _poisoned_stream(3), progress=False,
          optimizer=common.OPTIMIZER, on_nonfinite="skip")
  assert r.step == 6
  np.testing.assert_array_equal(r.history["nonfinite_steps"], [3])
  assert r.history["finite"].tolist() == [1, 1, 0, 1, 1, 1]
  for leaf in jax.tree.leaves(r.params):
    assert np.all(np.isfinite(leaf))
  # Identical to a run that never saw batch 3 (Adam's count included).
  def without_3():
    for i, b in enumerate(_poisoned_stream(3)):
      if i != 2:
        yield b
  ref = fit(_nan_on_big_x, params, without_3(), progress=False,
            optimizer=common.OPTIMIZER)
  # Step keys differ after the gap (the loss ignores them): params agree.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               r.params, ref.params)


def test_haiku_state_and_aux():
  def f(batch):
    pred = hk.nets.MLP([8, 1])(batch["x"])[:, 0]
    counter = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
    hk.set_state("count", counter + 1)
    loss = jnp.mean((pred - batch["y"]) ** 2)
    return loss, {"mae": jnp.mean(jnp.abs(pred - batch["y"])),
                  "pred": pred}
  net = hk.transform_with_state(f)
  r = probjax_hk.fit_model(net, common.make_data(), batch_size=32,
                           num_steps=7, progress=False)
  assert int(r.state["~"]["count"]) == 7
  assert r.history["mae"].shape == (7,)
  assert "pred" not in r.history  # only scalars are recorded


def test_fit_model_matches_fit():
  data = common.make_data()
  r1 = probjax_hk.fit_model(common.NET, data, batch_size=16, num_steps=4,
                            optimizer=common.OPTIMIZER, progress=False, rng=5)
  params = common.NET.init(jax.random.fold_in(jax.random.PRNGKey(5), 3),
                           {k: v[:16] for k, v in data.items()})
  r2 = fit(common.NET.apply, params, data, batch_size=16, num_steps=4,
           optimizer=common.OPTIMIZER, progress=False, rng=5)
  _assert_trees_equal(r1.params, r2.params)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=97, epochs=1), "batch_size"),
    (dict(batch_size=16), "num_steps"),
    (dict(batch_size=16, epochs=1, num_steps=2), "num_steps"),
    (dict(batch_size=16, epochs=1, num_step=2), "num_step.*num_steps"),
    (dict(batch_size=16, epochs=1, last_batch="keep"), "last_batch"),
    (dict(batch_size=16, epochs=1, on_nonfinite="ignore"), "on_nonfinite"),
    (dict(batch_size=0, epochs=1), "batch_size"),
    (dict(batch_size=16, epochs=1, checkpoint_every=2), "checkpoint_dir"),
])
def test_bad_arguments_raise_before_compiling(kwargs, match):
  # Built outside the count: making them compiles small programs the first
  # time a worker process does it.
  params, data = common.init_params(), common.make_data()
  with common.count_compiles() as compiles:
    with pytest.raises(ValueError, match=match):
      fit(common.loss_fn, params, data, progress=False, **kwargs)
  assert not compiles


def test_bad_data_raises():
  params = common.init_params()
  data = common.make_data()
  with pytest.raises(ValueError, match="mismatched leading"):
    fit(common.loss_fn, params, dict(data, y=data["y"][:-1]), epochs=1,
        progress=False)
  with pytest.raises(ValueError, match="empty stream"):
    fit(common.loss_fn, params, iter([]), progress=False)
  with pytest.raises(ValueError, match="epochs"):
    fit(common.loss_fn, params, common.stream(data, 16), epochs=1,
        progress=False)
  with pytest.raises(ValueError, match="fewer than `batch_size`"):
    fit(common.loss_fn, params, common.stream(data, 16), batch_size=32,
        progress=False)
  with pytest.raises(ValueError, match="scalar loss"):
    fit(lambda p, r, b: common.NET.apply(p, r, b) * jnp.ones(3), params, data,
        epochs=1, progress=False)
  with pytest.raises(ValueError, match="unknown argument"):
    probjax_hk.fit_model(common.NET, data, epochs=1, lerning_rate=1.0)


def _loss_with_aux(params, rng, batch):
  """(mse, aux): scalars are recorded, arrays are not; an aux 'loss' is
  recorded as 'aux/loss' beside the loss."""
  pred = common.NET.apply(params, rng, batch)
  return pred, {"twice": 2.0 * pred, "rows": batch["y"], "loss": pred + 1.0}


def test_scalar_aux_metrics_reach_the_history_and_callbacks():
  seen = []
  r = fit(_loss_with_aux, common.init_params(), common.make_data(),
          batch_size=16, num_steps=3, progress=False,
          callbacks=[lambda step, metrics: seen.append(sorted(metrics))])
  assert seen[0] == ["aux/loss", "finite", "grad_norm", "loss", "twice"]
  np.testing.assert_allclose(r.history["twice"], 2 * r.history["loss"], rtol=1e-6)
  np.testing.assert_allclose(r.history["aux/loss"], r.history["loss"] + 1, rtol=1e-6)
  assert "rows" not in r.history


def test_steps_per_call_trains_the_same_steps(tmp_path):
  # 13 steps, 6 per epoch (batch 16 of 96), evaluations every 5 steps and
  # checkpoints every 4: calls of 4 steps must stop at each of those.
  data, val = common.make_data(), common.make_data(32, seed=1)
  kwargs = dict(batch_size=16, num_steps=13, optimizer=common.OPTIMIZER,
                progress=False, validation_data=val, eval_every=5)
  one = fit(common.loss_fn, common.init_params(), data, **kwargs)
  many = fit(common.loss_fn, common.init_params(), data, steps_per_call=4,
             checkpoint_dir=str(tmp_path), checkpoint_every=4, **kwargs)
  np.testing.assert_array_equal(many.history["step"], np.arange(1, 14))
  np.testing.assert_allclose(many.history["loss"], one.history["loss"], rtol=1e-5)
  np.testing.assert_array_equal(many.history["val_step"], [5, 10, 13])
  np.testing.assert_allclose(many.history["val_loss"], one.history["val_loss"], rtol=1e-5)
  chex.assert_trees_all_close(many.params, one.params, rtol=1e-5, atol=1e-6)
  assert many.step == 13
  assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [8, 12, 13]


def test_steps_per_call_stops_at_the_end_of_a_call():
  seen = []
  def callback(step, metrics):
    seen.append(step)
    return step >= 2
  r = fit(common.loss_fn, common.init_params(), common.make_data(),
          batch_size=16, num_steps=50, optimizer=common.OPTIMIZER,
          progress=False, callbacks=[callback], steps_per_call=4)
  # A multi-step call's metrics are read when it ends: step 2's stop ends
  # the fit after the call of steps 1-4. The call of steps 5-8, dispatched
  # before steps 1-4 were read, is dropped: the params are step 4's.
  assert r.stopped_early and r.step == 4
  assert seen == list(range(1, 5))
  four = fit(common.loss_fn, common.init_params(), common.make_data(),
             batch_size=16, num_steps=4, optimizer=common.OPTIMIZER, progress=False)
  chex.assert_trees_all_close(r.params, four.params, rtol=1e-5, atol=1e-6)


def test_steps_per_call_must_be_positive():
  with pytest.raises(ValueError, match="steps_per_call"):
    fit(common.loss_fn, common.init_params(), common.make_data(),
        batch_size=16, num_steps=2, progress=False, steps_per_call=0)


@pytest.mark.parametrize("last_batch", ["drop", "pad"])
def test_steps_per_call_on_a_stream_trains_the_same_steps(tmp_path, last_batch):
  # 100 rows in batches of 16: 6 full batches and a short one (dropped or
  # padded); calls of 4 batches, checkpoints every 3 steps.
  data = common.make_data(100)
  loss = common.loss_fn if last_batch == "drop" else common.masked_loss_fn
  kwargs = dict(batch_size=16, optimizer=common.OPTIMIZER, progress=False,
                last_batch=last_batch)
  one = fit(loss, common.init_params(), common.stream(data, 16), **kwargs)
  many = fit(loss, common.init_params(), common.stream(data, 16), steps_per_call=4,
             checkpoint_dir=str(tmp_path), checkpoint_every=3, **kwargs)
  steps = 6 if last_batch == "drop" else 7
  np.testing.assert_array_equal(many.history["step"], np.arange(1, steps + 1))
  np.testing.assert_allclose(many.history["loss"], one.history["loss"], rtol=1e-5)
  chex.assert_trees_all_close(many.params, one.params, rtol=1e-5, atol=1e-6)
  saved = sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit())
  assert saved == ([3, 6] if last_batch == "drop" else [3, 6, 7])


def test_steps_per_call_default_is_several_for_small_states_only():
  params = common.init_params()
  auto = lambda **kw: fit_lib._auto_steps_per_call(
      **dict(dict(params=params, state=None, optimizer=common.OPTIMIZER,
                  callbacks=[], checkpoint_dir=None), **kw))
  assert auto() == fit_lib.AUTO_STEPS_PER_CALL > 1
  assert auto(callbacks=[lambda step, metrics: None]) == 1
  assert auto(checkpoint_dir="/tmp/anywhere") == 1
  big = {"w": jax.ShapeDtypeStruct((fit_lib.AUTO_STATE_BYTES // 8,), jnp.float32)}
  assert auto(params=big) == 1  # Adam: parameters + two moments > the limit


def test_skipped_step_on_a_stream_drops_no_batches():
  # Step 3's loss is non-finite and its update skipped. The optimistic call
  # of steps 1-4 is re-run one guarded step at a time while the call after
  # it, already dispatched, is dropped: its batches must go back to the
  # stream, so that every batch is trained on exactly as with one step per
  # call.
  kwargs = dict(optimizer=common.OPTIMIZER, on_nonfinite="skip", progress=False)
  one = fit(_nan_on_big_x, common.init_params(), _poisoned_stream(3, 12),
            steps_per_call=1, **kwargs)
  many = fit(_nan_on_big_x, common.init_params(), _poisoned_stream(3, 12),
             steps_per_call=4, **kwargs)
  assert one.step == many.step == 6  # make_data() holds 6 batches of 16
  np.testing.assert_array_equal(many.history["nonfinite_steps"], [3])
  np.testing.assert_array_equal(one.history["nonfinite_steps"], [3])
  np.testing.assert_allclose(many.history["loss"], one.history["loss"], rtol=1e-5)
  chex.assert_trees_all_close(many.params, one.params, rtol=1e-5, atol=1e-6)
