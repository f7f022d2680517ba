"""`tensor_parameter_sharding`: the spec of every Transformer and
DiffusionTransformer parameter, and how fit() reads its axis.

On one device: the rule's specs from the models' parameter shapes, and the
arguments fit() refuses before anything is compiled. Training with it on 8
devices: tests/training/test_fit_sharding.py.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import probjax_hk as pk
from probjax_hk.training import sharding

X = jax.ShapeDtypeStruct((2, 8, 32), jnp.float32)  # [B, T, D]


def _shapes(model):
  """The model's parameter shapes (traced, nothing runs)."""
  return jax.eval_shape(hk.transform(model).init, jax.random.PRNGKey(0), X)


def _specs(params, rule):
  """{'<module>/<leaf>': spec} for the parameters the rule splits."""
  return {f"{module}/{name}": rule(f"{module}/{name}", leaf)
          for module, leaves in params.items() for name, leaf in leaves.items()
          if rule(f"{module}/{name}", leaf) is not None}


@pytest.mark.parametrize("scan_layers", [False, True])
def test_transformer_heads_and_hidden_units_split(scan_layers):
  params = _shapes(lambda x: pk.Transformer(32, 4, 2, scan_layers=scan_layers)(x))
  rule = pk.tensor_parameter_sharding("model")
  stack = (None,) if scan_layers else ()  # [L, ...]: the layer axis stays whole
  block = "transformer/blocks/block" if scan_layers else "transformer/block_0"
  specs = _specs(params, rule)
  assert {k: v for k, v in specs.items() if k.startswith(block + "/")} == {
      f"{block}/attention/query/w": P(*stack, None, "model"),     # [D, N*H]: heads out
      f"{block}/attention/key/w": P(*stack, None, "model"),
      f"{block}/attention/value/w": P(*stack, None, "model"),
      f"{block}/attention/output/w": P(*stack, "model", None),    # [N*H, D]: heads in
      f"{block}/mlp/w_in/w": P(*stack, None, "model"),            # [D, F]
      f"{block}/mlp/w_in/b": P(*stack, "model"),                  # [F]
      f"{block}/mlp/w_out/w": P(*stack, "model", None)}           # [F, D]
  # Norms, the output projection's bias and the final norm stay whole.
  assert all("/attention/" in k or "/mlp/" in k for k in specs), specs
  assert rule.tensor_axis == "model"
  assert sharding.tensor_axis_of(rule) == "model"


def test_diffusion_transformer_keeps_adaln_whole():
  params = jax.eval_shape(
      hk.transform(lambda x: pk.DiffusionTransformer(32, 4, 1)(x, jnp.zeros(2))).init,
      jax.random.PRNGKey(0), X)
  specs = _specs(params, pk.tensor_parameter_sharding("tp"))
  assert sorted(k.split("/", 2)[-1] for k in specs) == [
      "attention/key/w", "attention/output/w", "attention/query/w", "attention/value/w",
      "mlp/w_in/b", "mlp/w_in/w", "mlp/w_out/w"], specs
  assert specs["diffusion_transformer/block_0/attention/output/w"] == P("tp", None)


def test_paths_as_key_paths_and_tuples():
  rule = pk.tensor_parameter_sharding("model")
  leaf = np.zeros((32, 64))
  key_path = (jax.tree_util.DictKey("transformer/block_0/mlp/w_out"),
              jax.tree_util.DictKey("w"))
  assert rule(key_path, leaf) == P("model", None)
  assert rule(("transformer", "block_0", "attention", "query", "w"), leaf) == P(None, "model")
  # A layer named like a projection outside attention or an MLP is left whole.
  assert rule("head/output/w", leaf) is None
  assert rule("moe_layer/w_in", np.zeros((4, 32, 64))) is None


def test_fit_refuses_a_tensor_axis_not_in_the_mesh():
  params = {"w": np.zeros((3,), np.float32)}
  data = {"x": np.ones((8, 3), np.float32)}
  loss = lambda p, rng, batch: jnp.mean(batch["x"] @ p["w"])
  one = Mesh(np.asarray(jax.devices()[:1]), ("data",))
  with pytest.raises(ValueError, match="'model'.*not an axis of the mesh"):
    pk.fit(loss, params, data, num_steps=1, progress=False, mesh=one,
           parameter_sharding=pk.tensor_parameter_sharding("model"))
  with pytest.raises(ValueError, match="`tensor_axis` and `sequence_axis`"):
    pk.fit(loss, params, data, num_steps=1, progress=False,
           mesh=jax.make_mesh((1,), ("data",),
                              axis_types=(jax.sharding.AxisType.Explicit,)),
           parameter_sharding=pk.tensor_parameter_sharding("data"), sequence_axis="data")


def test_the_batch_is_whole_along_the_tensor_axis():
  mesh = jax.sharding.AbstractMesh((2, 2, 2), ("data", "context", "model"))
  spec = functools.partial(sharding.batch_spec, 3, mesh)
  assert spec() == P(("data", "context", "model"))
  assert spec(tensor_axis="model") == P(("data", "context"))
  assert spec(tensor_axis="model", sequence_axis="context") == P("data", "context")
