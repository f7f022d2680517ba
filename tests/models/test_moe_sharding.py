"""MoELayer on 8 simulated CPU devices: per-shard dispatch and expert parallelism.

pytest workers import JAX with one CPU device, so the checks run in one
subprocess with `XLA_FLAGS=--xla_force_host_platform_device_count=8`; it
prints what it measured as JSON and the assertions are made here.

The compiled fwd+bwd (`jax.jit(jax.value_and_grad(loss)).lower(...).compile()`)
is read for its collectives: under data parallelism a layer that dispatches
each shard's own tokens needs nothing but all-reduces (the loss, the aux
losses, the replicated weights' gradients); a global sort shows up as
all-gathers of tokens. Values and gradients are compared with the unsharded
layer's.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from probjax_hk import moe
from tests import simulated_devices

_SCRIPT = r'''
import json
import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from probjax_hk import moe

assert jax.device_count() == 8, jax.devices()
D, F, TOP_K = 16, 32, 2
COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-to-all|collective-permute|"
                        r"reduce-scatter|all-reduce)(?:-start)?\(")
out = {}


def make(num_experts, **kwargs):
  return hk.transform_with_state(
      lambda x: moe.MoELayer(num_experts, TOP_K, F, **kwargs)(x))


def value_and_grad(num_experts, **kwargs):
  fn = make(num_experts, **kwargs)

  def loss(params, x):
    y, state = fn.apply(params, {}, None, x)
    return jnp.sum(jnp.sin(y)) + state["moe_layer"]["aux_loss"], (y, state["moe_layer"])
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def compile_and_read(f, *args):
  """(the compiled program, [(kind, result shape)] of its every collective):
  the program is then run as read, with no second compile."""
  compiled = f.lower(*args).compile()
  return compiled, [(kind, shape) for shape, kind in COLLECTIVE.findall(compiled.as_text())]


def max_diff(got, want):
  """The largest difference over the leaves, relative to max(1, |want|)."""
  def diff(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b))) / max(1.0, float(np.max(np.abs(b))))
  return max(diff(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def shard_shapes(a):
  return sorted({tuple(s.data.shape) for s in a.addressable_shards})


# T = 64: 8 tokens a device.
x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8, D)), jnp.float32)
PALLAS = dict(grouped_matmul_implementation="pallas")  # interpret mode on CPU

# 1. Data parallel: the batch split over ('data',), the weights replicated.
# Every path is compared with the unsharded 'dense' reference.
params, _ = jax.jit(make(4).init)(jax.random.PRNGKey(1), x)  # one compile, not one per op
want = value_and_grad(4, dropless_impl="dense")(params, x)
cases = [("Auto", "dense", {}), ("Auto", "ragged_dot", {}), ("Auto", "sort", {}),
         ("Auto", "gmm", PALLAS), ("Explicit", "gmm", PALLAS)]
for axis_type, impl, extra in cases:
  f = value_and_grad(4, dropless_impl=impl, **extra)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType[axis_type],))
  with jax.set_mesh(mesh):
    xs, ps = jax.device_put(x, P("data")), jax.device_put(params, P())
    compiled, found = compile_and_read(f, ps, xs)
    got = compiled(ps, xs)
  out[f"data/{axis_type}/{impl}"] = dict(
      collectives=found, diff=max_diff(got, want), y_shards=shard_shapes(got[0][1][0]))

# 2. Capacity per shard: each device drops by the capacity of its own 8 tokens.
mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
for impl in ("sort", "dense"):
  f = value_and_grad(4, dropless_impl=impl, capacity_factor=1.0)
  chunks = [f(params, x[i:i + 1]) for i in range(8)]  # one device's tokens each
  whole = f(params, x)  # one shard: global capacity and global aux losses
  with jax.set_mesh(mesh):
    xs, ps = jax.device_put(x, P("data")), jax.device_put(params, P())
    compiled, found = compile_and_read(f, ps, xs)
    (_, (y, state)), _ = compiled(ps, xs)
  per_shard_y = np.concatenate([np.asarray(c[0][1][0]) for c in chunks])
  aux = ("load_balance_loss", "router_z_loss", "tokens_per_expert")
  out[f"capacity/{impl}"] = dict(
      collectives=found, y_diff=max_diff(y, per_shard_y),
      dropped=int(state["dropped_tokens"]),
      per_shard_dropped=sum(int(c[0][1][1]["dropped_tokens"]) for c in chunks),
      global_dropped=int(whole[0][1][1]["dropped_tokens"]),
      aux_diff=max_diff([state[k] for k in aux], [whole[0][1][1][k] for k in aux]))

# 3. Expert parallel: 8 experts placed with `expert_parameter_sharding`.
params8, _ = jax.jit(make(8).init)(jax.random.PRNGKey(1), x)
want = value_and_grad(8, dropless_impl="dense")(params8, x)
rule = moe.expert_parameter_sharding("expert")
cases = [(("expert",), (8,), "Auto", "gmm", PALLAS, P("expert")),
         (("data", "expert"), (2, 4), "Auto", "ragged_dot", {}, P(("data", "expert"))),
         (("data", "expert"), (2, 4), "Explicit", "sort", {}, P("data"))]
for names, shape, axis_type, impl, extra, x_spec in cases:
  f = value_and_grad(8, dropless_impl=impl, expert_axis="expert", **extra)
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType[axis_type],) * len(names))
  with jax.set_mesh(mesh):
    ps = jax.tree_util.tree_map_with_path(
        lambda path, leaf: jax.device_put(leaf, rule(path, leaf) or P()), params8)
    xs = jax.device_put(x, x_spec)
    compiled, found = compile_and_read(f, ps, xs)
    got = compiled(ps, xs)
  layer = ps["moe_layer"]
  out[f"expert/{'x'.join(names)}/{axis_type}/{impl}"] = dict(
      collectives=found, diff=max_diff(got, want), local_experts=8 // mesh.shape["expert"],
      w_in_shards=shard_shapes(layer["w_in"]), w_out_shards=shard_shapes(layer["w_out"]),
      router_shards=shard_shapes(layer["router"]))

# 4. What expert parallelism cannot split is refused before anything runs.
errors = {}
with jax.set_mesh(jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))):
  for name, experts, tokens in (("experts", 4, x), ("tokens", 8, x[:1, :6])):
    try:  # raised while tracing
      jax.eval_shape(make(experts, expert_axis="expert").init, jax.random.PRNGKey(1), tokens)
      errors[name] = "no error"
    except ValueError as e:
      errors[name] = str(e)
mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)
with jax.set_mesh(mesh):  # experts placed over the wrong axis: no silent regather
  misplaced = jax.tree.map(lambda leaf: jax.device_put(
      leaf, P("data") if leaf.ndim == 3 else P()), params8)
  try:
    jax.eval_shape(make(8, expert_axis="expert").apply, misplaced, {}, None, x)
    errors["misplaced"] = "no error"
  except ValueError as e:
    errors["misplaced"] = str(e)
out["errors"] = errors

# Run eagerly (as `init` runs outside jit) on a mesh with a size-1 axis: the
# experts' shard_map is manual over every axis, which JAX needs off jit.
mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(1, 8), ("data", "expert"))
eager = make(8, expert_axis="expert")
with jax.set_mesh(mesh):
  eager_params, eager_state = eager.init(jax.random.PRNGKey(1), x)
  y_eager, _ = eager.apply(eager_params, eager_state, None, x)
y_whole, _ = jax.jit(make(8).apply)(eager_params, {}, None, x)  # the reference, compiled
out["eager_size1_diff"] = float(jnp.max(jnp.abs(y_eager - y_whole)))
print("RESULT" + json.dumps(out))
'''

_D, _F = 16, 32


def _run_script():
  return simulated_devices.run(_SCRIPT, timeout=300)


def test_moe_sharding_on_8_cpu_devices():
  out = _run_script()
  assert out.pop("eager_size1_diff") < 2e-5, out  # eager, on a mesh with a size-1 axis
  for name, case in out.items():
    if name == "errors":
      continue
    kinds = {kind for kind, _ in case["collectives"]}
    if name.startswith(("data/", "capacity/")):
      # Each shard's own tokens: only reductions cross devices, no token moves.
      assert kinds <= {"all-reduce"}, (name, case["collectives"])
    if "diff" in case:  # values, aux state and gradients of params and x
      assert case["diff"] < 2e-5, (name, case)
    if name.startswith("data/"):
      assert case["y_shards"] == [[1, 8, _D]], (name, case)

  for impl in ("sort", "dense"):
    case = out[f"capacity/{impl}"]
    assert case["y_diff"] < 2e-5, (impl, case)  # = the layer on each shard alone
    assert case["dropped"] == case["per_shard_dropped"] > 0, (impl, case)
    assert case["dropped"] != case["global_dropped"], (impl, case)  # capacity is per shard
    assert case["aux_diff"] < 1e-5, (impl, case)  # aux losses stay global

  errors = out.pop("errors")
  assert "`num_experts`=4" in errors["experts"] and "8 devices" in errors["experts"], errors
  assert "token count 6" in errors["tokens"] and "8 devices" in errors["tokens"], errors
  assert "('data',)" in errors["misplaced"] and "expert_parameter_sharding" in errors[
      "misplaced"], errors

  expert_cases = [n for n in out if n.startswith("expert/")]
  assert len(expert_cases) == 3, out.keys()
  for name in expert_cases:
    case = out[name]
    local = case["local_experts"]
    assert case["w_in_shards"] == [[local, _D, _F]], (name, case)
    assert case["w_out_shards"] == [[local, _F, _D]], (name, case)
    assert case["router_shards"] == [[_D, 8]], (name, case)  # replicated
    kinds = [kind for kind, _ in case["collectives"]]
    assert "all-to-all" in kinds, (name, case)
    gathered = [shape for kind, shape in case["collectives"] if kind == "all-gather"]
    # No expert weight is gathered: no all-gather of a [., D, F] or [., F, D].
    weight = re.compile(rf"\[\d+,({_D},{_F}|{_F},{_D})\]")
    assert not any(weight.search(s) for s in gathered), (name, case)
    if "x".join(("data", "expert")) not in name or "Auto" in name:
      assert not gathered, (name, case)


def _leaf(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_expert_parameter_sharding_splits_expert_weights_only():
  rule = moe.expert_parameter_sharding("expert")
  params = {"moe_layer": {"router": _leaf(_D, 8), "w_in": _leaf(8, _D, _F),
                          "w_out": _leaf(8, _F, _D)},
            "block/~/mlp/~/w_in": {"w": _leaf(_D, _F), "b": _leaf(_F)},
            "stack/~/moe_3": {"w_in": _leaf(4, 8, _D, _F)}}  # hk.layer_stack: [L, E, ...]
  specs = jax.tree_util.tree_map_with_path(rule, params)
  assert specs["moe_layer"] == {"router": None, "w_in": P("expert"), "w_out": P("expert")}
  assert specs["block/~/mlp/~/w_in"] == {"w": None, "b": None}  # an MLP's Linear
  assert specs["stack/~/moe_3"]["w_in"] == P(None, "expert")
  # Paths given as names work alike.
  assert rule("moe_layer/w_out", _leaf(8, _F, _D)) == P("expert")
  assert rule(("moe_layer", "router"), _leaf(_D, 8)) is None


@pytest.mark.parametrize("axis", ["", None, ("data", "expert")])
def test_expert_parameter_sharding_bad_axis_raises(axis):
  with pytest.raises(ValueError, match="expert_axis"):
    moe.expert_parameter_sharding(axis)
