"""load_checkpoint: what fit() saved, back for inference (one device or a mesh)."""

import os

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import probjax_hk as pk
from tests import simulated_devices
from tests.training import common

load_checkpoint = pk.training.load_checkpoint


def _counted_loss(batch):
  """The MLP's loss, with a Haiku state: the number of calls."""
  count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
  hk.set_state("count", count + 1)
  pred = hk.nets.MLP([16, 1])(batch["x"])[:, 0]  # [B]
  return jnp.mean((pred - batch["y"]) ** 2)


NET = hk.transform_with_state(_counted_loss)
_KW = dict(batch_size=32, optimizer=common.OPTIMIZER, progress=False, rng=5)


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A fit with a Haiku state, saved at steps 2 and 4."""
  directory = str(tmp_path_factory.mktemp("run"))
  result = pk.fit_model(NET, common.make_data(), num_steps=4,
                        checkpoint_dir=directory, checkpoint_every=2, **_KW)
  return directory, result


def test_latest_step_applies_like_the_fit_result(run):
  directory, result = run
  loaded = load_checkpoint(directory)
  assert loaded.step == result.step == 4
  _assert_trees_equal(loaded.params, result.params)
  _assert_trees_equal(loaded.state, result.state)
  assert int(loaded.state["~"]["count"]) == 4
  assert loaded.opt_state is None
  np.testing.assert_array_equal(loaded.history["loss"], result.history["loss"])
  assert loaded.directory == os.path.join(os.path.abspath(directory), "4")
  leaf = jax.tree.leaves(loaded.params)[0]
  assert len(leaf.sharding.device_set) == 1
  batch = common.make_data(8, seed=3)
  out, _ = NET.apply(loaded.params, loaded.state, None, batch)
  expected, _ = NET.apply(result.params, result.state, None, batch)
  np.testing.assert_array_equal(out, expected)


def test_earlier_step_and_optimizer_state(run, tmp_path):
  directory, result = run
  loaded = load_checkpoint(directory, optimizer=common.OPTIMIZER)
  _assert_trees_equal(loaded.opt_state, result.opt_state)
  assert isinstance(loaded.opt_state[0], optax.ScaleByAdamState)
  # Step 2 is what a fit of 2 steps returns (one step per call either way).
  early = load_checkpoint(directory, step=2)
  two = pk.fit_model(NET, common.make_data(), num_steps=2,
                     checkpoint_dir=str(tmp_path), **_KW)
  assert early.step == 2
  _assert_trees_equal(early.params, two.params)
  assert int(early.state["~"]["count"]) == 2


def test_a_fit_without_state_onto_a_mesh(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # a relative directory
  mesh = pk.training.default_mesh()
  result = pk.fit(common.loss_fn, common.init_params(), common.make_data(),
                  num_steps=3, checkpoint_dir="ckpt", **_KW)
  loaded = load_checkpoint("ckpt", mesh=mesh,
                           parameter_sharding=lambda path, leaf: None)
  assert loaded.state is None
  _assert_trees_equal(loaded.params, result.params)
  leaf = jax.tree.leaves(loaded.params)[0]
  assert leaf.sharding == jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec())


def test_bad_arguments_name_themselves(run, tmp_path):
  directory, _ = run
  missing = str(tmp_path / "missing")
  with pytest.raises(ValueError, match="`directory` does not exist"):
    load_checkpoint(missing)
  assert not os.path.exists(missing)  # loading creates nothing
  with pytest.raises(ValueError, match="`directory` .* holds no complete"):
    load_checkpoint(str(tmp_path))
  with pytest.raises(ValueError, match=r"`step` must be one of the saved"
                     r" steps \[2, 4\].*step=3"):
    load_checkpoint(directory, step=3)
  with pytest.raises(ValueError, match=r"`step`.*step=True"):
    load_checkpoint(directory, step=True)
  with pytest.raises(ValueError, match="`optimizer` makes a state unlike"):
    load_checkpoint(directory, optimizer=optax.sgd(0.1, momentum=0.9))
  with pytest.raises(ValueError, match="`parameter_sharding`"):
    load_checkpoint(directory, mesh=pk.training.default_mesh(),
                    parameter_sharding="tensor")
  with pytest.raises(TypeError, match="`directory` must be a path"):
    load_checkpoint(None)


_SCRIPT = r'''
import json, tempfile
import haiku as hk
import jax
import numpy as np
import optax
import probjax_hk as pk
from probjax_hk.training import checkpoints, sharding
from tests.training import common

assert jax.device_count() == 8, jax.devices()
net = hk.transform(lambda b: ((hk.nets.MLP([256, 1])(b["x"])[:, 0] - b["y"]) ** 2).mean())
opt = optax.adam(1e-2)
out = {}
with tempfile.TemporaryDirectory() as directory:
  result = pk.fit_model(net, common.make_data(), num_steps=2, batch_size=16, optimizer=opt,
                        progress=False, parameter_sharding="fsdp", checkpoint_dir=directory)
  mesh = sharding.default_mesh()
  sharded = checkpoints.load_checkpoint(directory, optimizer=opt, mesh=mesh,
                                        parameter_sharding="fsdp")
  single = checkpoints.load_checkpoint(directory)
equal = lambda a, b: all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
out["sharded_equal"] = equal(sharded.params, result.params) and equal(sharded.opt_state, result.opt_state)
out["single_equal"] = equal(single.params, result.params)
out["sharded_like_fit"] = all(a.sharding == b.sharding for a, b in zip(
    jax.tree.leaves((sharded.params, sharded.opt_state)), jax.tree.leaves((result.params, result.opt_state))))
out["shard_fraction"] = min(s.data.size / x.size for x in jax.tree.leaves(sharded.params)
                            for s in x.addressable_shards)
out["single_devices"] = sorted({len(x.sharding.device_set) for x in jax.tree.leaves(single.params)})
print("RESULT" + json.dumps(out))
'''


def test_fsdp_checkpoint_loads_onto_a_mesh_or_one_device():
  out = simulated_devices.run(_SCRIPT, timeout=300)
  assert out["sharded_equal"] and out["single_equal"], out
  assert out["sharded_like_fit"], out
  assert out["shard_fraction"] == 1 / 8, out  # the 4 x 256 kernel, split
  assert out["single_devices"] == [1], out
