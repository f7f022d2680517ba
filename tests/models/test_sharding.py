"""The models run their kernels per shard on a mesh: no gather in front of any.

As tests/ops/test_sharding.py checks each op, with the same script helpers:
on 8 simulated CPU devices, every model of the library with its kernels
forced on (interpret mode) is differentiated with its batch split over an
Auto mesh and over an Explicit one (the causal Transformer over the Auto
one); the compiled program must hold no
all-gather, and the values and gradients must equal one device's. One
subprocess for the file; its parameters are drawn on the host
(tests/models/random_params.py).
"""

import pytest

from tests import simulated_devices
from tests.ops import test_sharding

# Flex attention splits a batch alike causal or not (its plan does not read
# is_causal): the causal Transformer runs on the Auto mesh only.
_AUTO_ONLY = ("Transformer_causal",)

_SCRIPT = test_sharding.PRELUDE + f"_AUTO_ONLY = {_AUTO_ONLY!r}\n" + r'''
# The models with their kernels forced on, batch 8 over 8 devices.
flex = functools.partial(pk.dot_product_attention, implementation="flex")
models = {
    "Transformer": lambda x: pk.Transformer(64, 4, 2, attention_fn=flex)(x),
    "Transformer_causal": lambda x: pk.Transformer(64, 4, 1, attention_fn=flex, is_causal=True)(x),
    "Mamba2Cell": lambda x: pk.SSMModel(64, 64, 64, 1, cell=pk.Mamba2Cell, cell_kwargs=dict(
        head_dim=16, state_dim=16, implementation="pallas"))(x),
    "MambaCell": lambda x: pk.SSMModel(64, 32, 64, 1, cell=pk.MambaCell, cell_kwargs=dict(
        state_dim=8, implementation="pallas"))(x),
    "GatedDeltaNetCell": lambda x: pk.SSMModel(64, 32, 64, 1, cell=pk.GatedDeltaNetCell,
        cell_kwargs=dict(num_heads=2, head_dim=16, implementation="pallas"))(x),
    "LRUCell": lambda x: pk.SSMModel(64, 32, 64, 1, cell=pk.LRUCell, cell_kwargs=dict(
        state_dim=32, implementation="pallas"))(x),
}
# Inputs and parameters from NumPy: an eager init would compile op by op,
# each interpret-mode kernel included, on 8 devices.
from tests.models.random_params import random_params
x = np.random.default_rng(2).normal(size=(8, 16, 64)).astype(np.float32)
explicit_data = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
for name, forward in models.items():
  model = hk.without_apply_rng(hk.transform(forward))
  params = random_params(model, x)
  check(f"model/{name}", lambda p, x: jnp.sum(jnp.sin(model.apply(p, x))),
        [params, x], [P(), P("data")], auto,
        also_explicit=None if name in _AUTO_ONLY else explicit_data)
print("RESULT" + json.dumps(out))
'''

_MODELS = ("Transformer", "Transformer_causal", "Mamba2Cell", "MambaCell",
           "GatedDeltaNetCell", "LRUCell")


@pytest.fixture(scope="module")
def results():
  return simulated_devices.run(_SCRIPT, timeout=900)


@pytest.mark.parametrize("case", [f"model/{name}" for name in _MODELS] + [
    f"explicit/model/{name}" for name in _MODELS if name not in _AUTO_ONLY])
def test_runs_per_shard_and_matches_one_device(results, case):
  assert results[case]["gathers"] == 0, results[case]
  assert results[case]["err"] < 2e-5, results[case]
