"""Fault injection: what fit() and load_checkpoint() do when a run is replaced,
a checkpoint is damaged, a process is killed mid-save, or a loss turns NaN.

Every fit here has the arguments of test_checkpoints.py (the module-level loss
and optimizer of common.py, one step per call), so they share its compiled step.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import probjax_hk
from probjax_hk.training import checkpoints
from tests import simulated_devices
from tests.training import common

_KW = dict(batch_size=16, optimizer=common.OPTIMIZER, progress=False, rng=7)
_TOTAL = 6  # steps, one epoch; checkpoints at 2, 4 and 6

load_checkpoint = probjax_hk.training.load_checkpoint


def _fit(directory, num_steps=_TOTAL, data=None, **kwargs):
  return probjax_hk.fit(common.loss_fn, common.init_params(),
                        common.make_data() if data is None else data,
                        num_steps=num_steps, checkpoint_dir=str(directory),
                        **dict(_KW, **kwargs))


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _warnings(caplog, text):
  return [r.getMessage() for r in caplog.records
          if r.levelname == "WARNING" and text in r.getMessage()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """An uninterrupted fit checkpointed at 2, 4 and 6: (its directory, result).
  Tests damage copies of the directory."""
  directory = tmp_path_factory.mktemp("run")
  return str(directory), _fit(directory, checkpoint_every=2)


def _copy(run, tmp_path):
  directory = str(tmp_path / "ckpt")
  shutil.copytree(run[0], directory)
  return directory


def test_resume_false_replaces_the_earlier_run(run, tmp_path, caplog):
  directory = _copy(run, tmp_path)
  seen = []  # the directory while the new run has saved nothing yet
  other = common.make_data(seed=1)
  replaced = _fit(directory, 3, data=other, resume=False,
                  callbacks=[lambda step, _: seen.append(
                      checkpoints.checkpoint_steps(directory))])
  assert seen[0] == [2, 4, 6]  # the old run stays until the first save
  assert len(_warnings(caplog, directory)) == 1  # announced once
  assert sorted(os.listdir(directory)) == ["3"]  # then only the new run
  loaded = load_checkpoint(directory)
  assert loaded.step == 3
  _assert_trees_equal(loaded.params, replaced.params)
  np.testing.assert_array_equal(loaded.history["loss"],
                                replaced.history["loss"])
  # ... which a resume continues.
  resumed = _fit(directory, 4, data=other)
  np.testing.assert_array_equal(resumed.history["step"], [1, 2, 3, 4])


def test_resume_with_nothing_left_says_so(run, tmp_path, caplog):
  directory = _copy(run, tmp_path)
  for num_steps in (_TOTAL, _TOTAL - 2):  # the run's own length; fewer steps
    caplog.clear()
    again = _fit(directory, num_steps)
    assert again.step == _TOTAL
    np.testing.assert_array_equal(again.history["loss"], run[1].history["loss"])
    [message] = _warnings(caplog, "nothing to train")
    assert f"{directory} already holds step {_TOTAL}" in message
    assert f"num_steps={num_steps}" in message and "resume=False" in message
  caplog.clear()
  _fit(directory, _TOTAL + 1)  # a step left: trained, no warning
  assert not _warnings(caplog, "nothing to train")


def _truncate_arrays(step_dir):
  for path in glob.glob(os.path.join(step_dir, "state", "d", "*")):
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)


def _garble_meta(step_dir):
  with open(os.path.join(step_dir, "meta", "metadata"), "w") as f:
    f.write('{"step": 6, "hist')


def _delete_arrays(step_dir):
  shutil.rmtree(os.path.join(step_dir, "state", "d"))


def _half_copied(step_dir):  # orbax's metadata and the `meta` item missing
  os.remove(os.path.join(step_dir, "_CHECKPOINT_METADATA"))
  shutil.rmtree(os.path.join(step_dir, "meta"))


def _delete_step(step_dir):
  shutil.rmtree(step_dir)


@pytest.mark.parametrize("damage,reason", [
    (_truncate_arrays, "OUT_OF_RANGE"), (_garble_meta, "JSONDecodeError"),
    (_delete_arrays, "NOT_FOUND"), (_half_copied, "incomplete"),
    (_delete_step, None)])
def test_damaged_newest_step_is_skipped(run, tmp_path, caplog, capfd, damage,
                                        reason):
  directory = _copy(run, tmp_path)
  newest = os.path.join(directory, "6")
  damage(newest)
  loaded = load_checkpoint(directory)  # the newest readable step
  assert loaded.step == 4
  if reason is None:  # a deleted step is simply not there
    assert not _warnings(caplog, "cannot be read")
    resumed = _fit(directory)
  else:
    (warning,) = _warnings(caplog, "cannot be read")
    assert newest in warning and reason in warning, warning
    with pytest.raises(checkpoints.CheckpointReadError,
                       match=f"{newest}.*{reason}"):
      load_checkpoint(directory, step=6)
    caplog.clear()
    resumed = _fit(directory)
    (warning,) = _warnings(caplog, "cannot be read")
    assert newest in warning and reason in warning and "from step 4" in warning
    # Set aside, so that the resumed run saves its own step 6.
    assert os.listdir(os.path.join(directory, "unreadable")) == ["6"]
  _assert_trees_equal(resumed.params, run[1].params)  # resumed at 4
  np.testing.assert_array_equal(resumed.history["loss"],
                                run[1].history["loss"])
  assert load_checkpoint(directory).step == _TOTAL
  assert "Event loop is closed" not in capfd.readouterr().err


def test_no_readable_step_names_the_directory_and_the_ways_out(run, tmp_path):
  directory = _copy(run, tmp_path)
  for step in (2, 4, 6):
    _garble_meta(os.path.join(directory, str(step)))
  with pytest.raises(ValueError, match=re.escape(directory) + r" can be read"
                     r" \(step 6: meta/metadata: JSONDecodeError.*resume=False"):
    _fit(directory)
  with pytest.raises(ValueError, match="holds no readable checkpoint"):
    load_checkpoint(directory)
  assert sorted(os.listdir(directory)) == ["2", "4", "6"]  # nothing moved


# Killed at the commit of step 4's save: its arrays and metadata are written
# into orbax's temporary directory, which is not yet renamed into place.
_KILLED_AT_SAVE = r'''
import os, signal, sys
from orbax.checkpoint._src.path import atomicity
import probjax_hk
from tests.training import common

finalize = atomicity.AtomicRenameTemporaryPath.finalize


async def killed_at_step_4(self, *args, **kwargs):
  if self.get_final().name == "4":
    os.kill(os.getpid(), signal.SIGKILL)
  return await finalize(self, *args, **kwargs)


atomicity.AtomicRenameTemporaryPath.finalize = killed_at_step_4
probjax_hk.fit(common.loss_fn, common.init_params(), common.make_data(),
               num_steps=6, checkpoint_dir=sys.argv[1], checkpoint_every=2,
               batch_size=16, optimizer=common.OPTIMIZER, progress=False, rng=7)
'''


def test_sigkill_during_a_save_resumes_from_the_step_before(run, tmp_path):
  directory = str(tmp_path)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cache = os.environ.get("PROBJAX_HK_TEST_COMPILE_CACHE")
  if cache:  # the run's compilation cache (conftest.py): the step is in it
    env.update(JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  done = subprocess.run([sys.executable, "-c", _KILLED_AT_SAVE, directory],
                        cwd=simulated_devices.ROOT, env=env, timeout=300,
                        capture_output=True, text=True)
  assert done.returncode == -9, done.stderr[-2000:]
  assert any(".orbax-checkpoint-tmp" in name for name in os.listdir(directory))
  assert checkpoints.checkpoint_steps(directory) == [2]
  assert load_checkpoint(directory).step == 2
  resumed = _fit(directory)
  _assert_trees_equal(resumed.params, run[1].params)
  assert checkpoints.checkpoint_steps(directory) == [2, _TOTAL]


def test_nan_at_a_step_checkpoints_the_last_finite_step(run, tmp_path):
  directory = str(tmp_path)
  data = common.make_data()
  data["x"][40, 0] = np.nan  # one row: the batch of some step k of epoch 0
  with pytest.raises(probjax_hk.training.NonFiniteLossError) as info:
    _fit(directory, data=data)
  k = info.value.step
  assert 2 <= k < _TOTAL  # a finite step before it, one in flight after it
  result = info.value.result
  assert result.step == k - 1
  np.testing.assert_array_equal(result.history["step"], np.arange(1, k + 1))
  assert np.isnan(result.history["loss"][-1])
  saved = load_checkpoint(directory)
  assert saved.step == k - 1  # the step of the parameters it holds
  np.testing.assert_array_equal(saved.history["loss"],
                                run[1].history["loss"][:k - 1])
  _assert_trees_equal(saved.params, result.params)
  # With the row repaired, a resume runs step k again and ends where an
  # uninterrupted run does: no batch skipped, no update frozen.
  resumed = _fit(directory)
  _assert_trees_equal(resumed.params, run[1].params)
  np.testing.assert_array_equal(resumed.history["loss"],
                                run[1].history["loss"])


def test_nan_in_validation_data_warns(caplog):
  validation = common.make_data(16, seed=2)
  validation["y"][3] = np.nan
  result = probjax_hk.fit(common.loss_fn, common.init_params(),
                          common.make_data(), num_steps=2, steps_per_call=1,
                          validation_data=validation, **_KW)
  assert np.isnan(result.history["val_loss"]).all()
  (warning,) = _warnings(caplog, "validation loss")
  assert "step 2" in warning and "nan" in warning
