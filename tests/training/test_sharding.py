"""fit() on 8 simulated CPU devices: the batch is split, the result agrees.

The 8-device run is a subprocess (`tests/simulated_devices.py`).
"""

from tests import simulated_devices

_SCRIPT = r'''
import json
import jax
import numpy as np
import probjax_hk
from probjax_hk.training import sharding, step as step_lib
from tests.training import common

assert jax.device_count() == 8, jax.devices()
out = {}
data = common.make_data()
kw = dict(batch_size=16, num_steps=9, optimizer=common.OPTIMIZER,
          progress=False, rng=2)
one = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
r1 = probjax_hk.fit(common.loss_fn, common.init_params(), data, mesh=one, **kw)
r8 = probjax_hk.fit(common.loss_fn, common.init_params(), data, **kw)
out["max_param_diff"] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
    jax.tree.leaves(r1.params), jax.tree.leaves(r8.params)))
out["max_loss_diff"] = float(np.max(np.abs(r1.history["loss"] - r8.history["loss"])))
leaf = jax.tree.leaves(r8.params)[0]
out["param_devices"] = len(leaf.sharding.device_set)
out["param_replicated"] = bool(leaf.sharding.is_fully_replicated)

# Streams: each batch lands split over the 8 devices, 2 rows each.
mesh = sharding.default_mesh()
placed = sharding.put_batch(
    {k: v[:16] for k, v in data.items()}, mesh)
out["stream_shard_rows"] = sorted(
    {s.data.shape[0] for s in placed["x"].addressable_shards})
rs = probjax_hk.fit(common.loss_fn, common.init_params(),
                    common.stream(data, 16), optimizer=common.OPTIMIZER,
                    progress=False)
rs1 = probjax_hk.fit(common.loss_fn, common.init_params(),
                     common.stream(data, 16), optimizer=common.OPTIMIZER,
                     progress=False, mesh=one)
out["stream_max_param_diff"] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
    jax.tree.leaves(rs.params), jax.tree.leaves(rs1.params)))

# The compiled in-memory step reduces gradients across devices.
spec = step_lib.StepSpec(common.loss_fn, common.OPTIMIZER, False, False,
                         False, "raise", mesh, True)
ts = sharding.copy_to(dict(
    params=common.init_params(), state={}, step=np.int32(0),
    rng=jax.random.PRNGKey(0), nonfinite=np.int32(0),
    first_nonfinite=np.int32(-1)), sharding.replicated(mesh))
ts["opt_state"] = step_lib.init_optimizer(spec)(ts["params"])
hlo = step_lib.array_step(spec).lower(
    ts, sharding.put_replicated(data, mesh),
    sharding.put_replicated(np.arange(96, dtype=np.int32), mesh), 16, 6,
    96).compile().as_text()
out["all_reduce"] = "all-reduce" in hlo

try:
  probjax_hk.fit(common.loss_fn, common.init_params(), data, batch_size=12,
                 num_steps=1, progress=False)
  out["indivisible"] = "no error"
except ValueError as e:
  out["indivisible"] = str(e)
print("RESULT" + json.dumps(out))
'''


def test_eight_devices_match_one_device():
  out = simulated_devices.run(_SCRIPT, timeout=300)
  # A different reduction order (per-device partial sums) moves the last bits.
  assert out["max_loss_diff"] < 1e-5, out
  assert out["max_param_diff"] < 1e-4, out
  assert out["stream_max_param_diff"] < 1e-4, out
  assert out["param_devices"] == 8 and out["param_replicated"], out
  assert out["stream_shard_rows"] == [2], out
  assert out["all_reduce"], out
  assert "batch_size" in out["indivisible"] and "8 devices" in out[
      "indivisible"], out
