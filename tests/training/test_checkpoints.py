"""Tests of fit()'s checkpoints: resume, pruning, Ctrl-C, mismatches (damaged
checkpoints, killed saves and replaced runs: test_faults.py)."""

import os

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk
from tests.training import common

_KW = dict(batch_size=16, optimizer=common.OPTIMIZER, progress=False, rng=7)
_TOTAL = 10  # steps; one epoch is 6 steps, so the data order crosses an epoch


def _steps(directory):
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def _assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  # The same arguments as the resumed runs, a checkpoint directory included:
  # with one, fit takes one step per call (without, small models run several
  # per call, which can differ from single steps in the last bit).
  return probjax_hk.fit(common.loss_fn, common.init_params(),
                        common.make_data(), num_steps=_TOTAL,
                        checkpoint_dir=str(tmp_path_factory.mktemp("whole")), **_KW)


def test_resume_equals_uninterrupted_and_prunes(tmp_path, uninterrupted):
  directory = str(tmp_path / "ckpt")
  first = probjax_hk.fit(common.loss_fn, common.init_params(),
                         common.make_data(), num_steps=4, checkpoint_dir=directory,
                         checkpoint_every=1, keep_checkpoints=2, **_KW)
  assert first.step == 4
  assert _steps(directory) == [3, 4]  # keep_checkpoints=2 pruned 1 and 2
  # A different `rng` is overridden by the checkpoint's key; `params` too.
  resumed = probjax_hk.fit(common.loss_fn, common.init_params(seed=1),
                           common.make_data(), num_steps=_TOTAL,
                           checkpoint_dir=directory, keep_checkpoints=2,
                           **dict(_KW, rng=99))
  assert resumed.step == _TOTAL
  _assert_trees_equal(resumed.params, uninterrupted.params)
  _assert_trees_equal(resumed.opt_state, uninterrupted.opt_state)
  # The history spans both runs.
  np.testing.assert_array_equal(resumed.history["step"], np.arange(1, 11))
  np.testing.assert_array_equal(resumed.history["loss"],
                                uninterrupted.history["loss"])
  assert _steps(directory) == [4, _TOTAL]
  # resume=False starts over, replacing the earlier run's checkpoints.
  again = probjax_hk.fit(common.loss_fn, common.init_params(),
                         common.make_data(), num_steps=2, resume=False,
                         checkpoint_dir=directory, **_KW)
  assert again.step == 2
  assert _steps(directory) == [2]


class _Interrupt(probjax_hk.training.Callback):

  def __init__(self, at_step):
    self.at_step = at_step

  def on_step_end(self, step, metrics):
    if step == self.at_step:
      raise KeyboardInterrupt


def test_ctrl_c_saves_then_resume_equals_uninterrupted(tmp_path,
                                                       uninterrupted):
  directory = str(tmp_path)
  with pytest.raises(KeyboardInterrupt):
    probjax_hk.fit(common.loss_fn, common.init_params(), common.make_data(),
                   num_steps=_TOTAL, checkpoint_dir=directory,
                   callbacks=[_Interrupt(5)], **_KW)
  saved = _steps(directory)
  assert saved and 5 <= saved[-1] < _TOTAL, saved
  resumed = probjax_hk.fit(common.loss_fn, common.init_params(),
                           common.make_data(), num_steps=_TOTAL,
                           checkpoint_dir=directory, **_KW)
  _assert_trees_equal(resumed.params, uninterrupted.params)


def test_checkpoint_of_another_model_names_the_paths(tmp_path):
  directory = str(tmp_path)
  probjax_hk.fit(common.loss_fn, common.init_params(), common.make_data(),
                 num_steps=1, checkpoint_dir=directory, **_KW)
  wide = hk.transform(
      lambda b: jnp.mean((hk.nets.MLP([32, 1])(b["x"])[:, 0] - b["y"]) ** 2))
  params = wide.init(jax.random.PRNGKey(0), common.make_data(2))
  with common.count_compiles() as compiles:
    with pytest.raises(ValueError, match=r"different model.*linear_0.*w"):
      probjax_hk.fit(wide.apply, params, common.make_data(), num_steps=2,
                     checkpoint_dir=directory, **_KW)
  assert not compiles, compiles
