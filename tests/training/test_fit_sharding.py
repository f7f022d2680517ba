"""fit() with `parameter_sharding` on 8 simulated CPU devices.

A small Transformer whose attention is the Pallas flex kernel (interpret mode
on the CPU) trains under 'replicated', 'fsdp' and a tensor-parallel callable;
the checks read the compiled step's HLO (which all-gathers it holds), the
arrays' addressable shards, a resume from 8 devices onto 4, and the caller's
arrays after repeated fits. On meshes with Explicit axes: data parallelism
and 'fsdp', and `sequence_axis` (an LRU and a Mamba-2 model, then a causal
Transformer with the rotary embedding, with the batch over 'data' and time
over 'context', 20 steps against one device; a DiffusionTransformer's
predictions so), with its errors, and the temporary memory of a compiled step
at T = 32,768 split 8 ways against one device.
Tensor parallelism on Explicit axes (`tensor_parameter_sharding`): heads
and hidden units over 'model', the batch over 'data' only, against the
replicated fit, with no gathered parameter, and its error for indivisible heads.
All 8-device checks run in one subprocess (pytest workers have already
imported JAX with one device; see test_sharding.py).
"""


from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import probjax_hk
from tests.training import common
from tests import simulated_devices

_SCRIPT = r'''
import functools
import json
import re
import sys
import time

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import optax

import probjax_hk as pk
from probjax_hk.ssm import causal_conv
from probjax_hk.training import checkpoints
from probjax_hk.training import data as data_lib
from probjax_hk.training import programs
from probjax_hk.training import sharding
from probjax_hk.training import step as step_lib
from tests.training import common

assert jax.device_count() == 8, jax.devices()
out = {}
traced_meshes = []  # the context mesh each trace of the loss saw
traced_batch_specs = []  # and the layout of its batch


def _loss(batch, num_layers=1, scan_layers=False, num_kv_heads=None, implementation="flex"):
  traced_meshes.append(dict(jax.sharding.get_abstract_mesh().shape))
  traced_batch_specs.append(str(jax.typeof(batch["x"]).sharding.spec))
  attention = functools.partial(pk.dot_product_attention, implementation=implementation)
  y = pk.Transformer(32, 2, num_layers, num_kv_heads=num_kv_heads, attention_fn=attention,
                     scan_layers=scan_layers)(batch["x"])  # [B, T, D]
  return jnp.mean((y - batch["y"]) ** 2)


NET = hk.transform(_loss)
SCANNED = hk.transform(functools.partial(_loss, num_layers=2, scan_layers=True))
OPT = optax.adam(1e-2)
rs = np.random.RandomState(0)
data = {"x": rs.randn(32, 8, 32).astype(np.float32),
        "y": rs.randn(32, 8, 32).astype(np.float32)}
params = NET.init(jax.random.PRNGKey(0), {k: v[:2] for k, v in data.items()})
kw = dict(batch_size=16, optimizer=OPT, progress=False, rng=1, steps_per_call=1)


def host(tree):
  return jax.tree.map(np.array, tree)


def spec_entries(x):
  return [list(e) if isinstance(e, tuple) else e for e in x.sharding.spec]


def equal(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def largest_shard_fraction(tree, min_size):
  """Per leaf of at least min_size elements: max shard size / leaf size."""
  return {jax.tree_util.keystr(p): max(s.data.size for s in x.addressable_shards) / x.size
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if x.size >= min_size}


# Two fits per mode from the same parameter tree, then one from the first
# fit's own (sharded) result: the caller's arrays stay readable and unchanged.
before = host(params)
traced_meshes.clear()
results = {}
for mode in ("replicated", "fsdp"):
  first = pk.fit(NET.apply, params, data, num_steps=4, parameter_sharding=mode, **kw)
  second = pk.fit(NET.apply, params, data, num_steps=4, parameter_sharding=mode, **kw)
  trained = host(first.params)
  pk.fit(NET.apply, first.params, data, num_steps=1, parameter_sharding=mode, **kw)
  out[mode + "_caller_unchanged"] = equal(params, before)
  out[mode + "_result_reused_unchanged"] = equal(first.params, trained)
  out[mode + "_repeat_equal"] = equal(first.params, second.params)
  results[mode] = first
out["traced_meshes"] = list(traced_meshes)
out["fsdp_vs_replicated"] = max_diff(results["fsdp"].params, results["replicated"].params)

fsdp = results["fsdp"]
out["min_size"] = sharding.FSDP_MIN_SIZE
out["param_fraction"] = largest_shard_fraction(fsdp.params, sharding.FSDP_MIN_SIZE)
out["opt_fraction"] = largest_shard_fraction(fsdp.opt_state, sharding.FSDP_MIN_SIZE)
out["small_replicated"] = all(x.sharding.is_fully_replicated for x in jax.tree.leaves(
    (fsdp.params, fsdp.opt_state)) if x.size < sharding.FSDP_MIN_SIZE)
out["replicated_mode_replicated"] = all(x.sharding.is_fully_replicated for x in jax.tree.leaves(
    (results["replicated"].params, results["replicated"].opt_state)))

# The compiled step fit ran (the step cache's entry): its all-gathers.
mesh = sharding.default_mesh()
source = data_lib.ArrayData(data, batch_size=16, last_batch="drop", mesh=mesh)


def compiled_step(net, mode, params, opt_state=None, step_mesh=mesh, step_source=source):
  """(fit's StepSpec for `net`, the HLO of its compiled one-step call)."""
  specs = sharding.parameter_specs(params, mode, step_mesh)
  layout = sharding.train_state_layout(params, specs, jax.eval_shape(OPT.init, params), {})
  spec = step_lib.StepSpec(net.apply, OPT, False, False, False, "raise", step_mesh, True,
                           metric_names=step_lib.BASE_METRICS, layout=layout,
                           tensor_axis=sharding.tensor_axis_of(mode))
  placed = layout.shardings(step_mesh)
  ts = sharding.copy_to(dict(params=params, state={}, step=np.int32(0),
                             rng=jax.random.PRNGKey(1), nonfinite=np.int32(0),
                             first_nonfinite=np.int32(-1)),
                        {k: v for k, v in placed.items() if k != "opt_state"})
  ts["opt_state"] = (step_lib.init_optimizer(spec)(ts["params"]) if opt_state is None
                     else sharding.copy_to(opt_state, placed["opt_state"]))
  with jax.set_mesh(step_mesh):  # as fit() traces it
    hlo = step_lib.array_step(spec).lower(
        ts, step_source.arrays, step_source.permutation(jax.random.PRNGKey(1), 0), 16,
        step_source.steps_per_epoch, 32).compile().as_text()
  return spec, ts, hlo


def gathers(hlo):
  """[shape, dimension] of every all-gather, and the number of all-gathers."""
  found = [[m.group(1), int(m.group(2))] for m in re.finditer(
      r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(.*?dimensions=\{(\d+)\}", hlo)]
  return found, len(re.findall(r" all-gather(?:-start)?\(", hlo))


def sharded_params(tree, drop_leading=False):
  """[shape, split dimension] of every sharded leaf (without a stack's layer axis)."""
  k = int(drop_leading)
  return sorted([",".join(map(str, x.shape[k:])), [i for i, e in enumerate(x.sharding.spec) if e][0] - k]
                for x in jax.tree.leaves(tree) if not x.sharding.is_fully_replicated)


for mode in ("replicated", "fsdp"):
  result = results[mode]
  spec, _, hlo = compiled_step(NET, mode, result.params, result.opt_state)
  out[mode + "_step_is_fits"] = ("array", (spec, 1, False)) in step_lib._cache
  out[mode + "_gathers"], out[mode + "_gather_ops"] = gathers(hlo)
  out[mode + "_sharded_params"] = sharded_params(result.params)

# scan_layers: each layer's slice is gathered inside the scan, never a stack.
scanned = SCANNED.init(jax.random.PRNGKey(0), {k: v[:2] for k, v in data.items()})
_, ts, hlo = compiled_step(SCANNED, "fsdp", scanned)
out["scan_gathers"], out["scan_gather_ops"] = gathers(hlo)
out["scan_sharded_layers"] = sharded_params(ts["params"], drop_leading=True)

# fit_model: the parameters are created sharded and train like fit()'s.
init_params = NET.init(jax.random.fold_in(jax.random.PRNGKey(1), 3),
                       {k: v[:16] for k, v in data.items()})
via_model = pk.fit_model(NET, data, num_steps=2, parameter_sharding="fsdp", **kw)
via_fit = pk.fit(NET.apply, init_params, data, num_steps=2, parameter_sharding="fsdp", **kw)
out["fit_model_diff"] = max_diff(via_model.params, via_fit.params)
out["fit_model_specs"] = [spec_entries(x) for x in jax.tree.leaves(via_model.params)]

# A callable: tensor parallelism over 'model', the batch over every device.
mesh2 = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "model"))


def tensor_parallel(path, leaf):
  if path.endswith(("query/w", "key/w", "value/w", "w_in/w")):
    return P(None, "model")
  if path.endswith(("output/w", "w_out/w")):
    return P("model", None)
  return None


tp = pk.fit(NET.apply, params, data, num_steps=4, parameter_sharding=tensor_parallel,
            mesh=mesh2, validation_data=data, **kw)
out["tp_val_loss"] = [float(tp.history["val_loss"][-1]),
                      float(NET.apply(host(tp.params), None, data))]
out["tp_vs_replicated"] = max_diff(tp.params, results["replicated"].params)
query = tp.params["transformer/block_0/attention/query"]["w"]
out["tp_query"] = [spec_entries(query), list(query.addressable_shards[0].data.shape)]
mu = tp.opt_state[0].mu["transformer/block_0/attention/query"]["w"]
out["tp_query_mu"] = [spec_entries(mu), list(mu.addressable_shards[0].data.shape)]
errors = {}
for name, fn, m in [
    ("unknown_axis", lambda path, leaf: P("model"), mesh),
    ("indivisible", lambda path, leaf: P("data"), Mesh(np.asarray(jax.devices()[:3]), ("data",))),
    ("not_a_spec", lambda path, leaf: "data", mesh)]:
  try:
    pk.fit(NET.apply, params, data, num_steps=1, parameter_sharding=fn, mesh=m, **kw)
    errors[name] = "no error"
  except ValueError as e:
    errors[name] = str(e)
out["errors"] = errors

# Resume: N steps on 8 devices (checkpointed), then on 4 devices up to 2N,
# against the uninterrupted 2N-step run on 8 (results['fsdp']).
directory = sys.argv[1]
half = pk.fit(NET.apply, params, data, num_steps=2, parameter_sharding="fsdp",
              checkpoint_dir=directory, **kw)
mesh4 = Mesh(np.asarray(jax.devices()[:4]), ("data",))
specs4 = sharding.parameter_specs(params, "fsdp", mesh4)
layout4 = sharding.train_state_layout(params, specs4, jax.eval_shape(OPT.init, params), {})
target = jax.eval_shape(lambda p: dict(
    params=p, opt_state=OPT.init(p), state={}, step=jnp.int32(0),
    rng=jax.random.PRNGKey(0), nonfinite=jnp.int32(0), first_nonfinite=jnp.int32(0)), params)
checkpointer = checkpoints.Checkpointer(directory, keep=3)
restored, _ = checkpointer.restore(2, target, layout4.shardings(mesh4))
checkpointer.close()
wanted = jax.tree.leaves(layout4.shardings(mesh4))
out["restored_placed"] = all(
    x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(jax.tree.leaves(restored), wanted))
out["restored_equal"] = equal(restored["params"], half.params)
resumed = pk.fit(NET.apply, params, data, num_steps=4, parameter_sharding="fsdp",
                 checkpoint_dir=directory, mesh=mesh4, **kw)
out["resumed_step"] = resumed.step
out["resumed_vs_whole"] = max_diff(resumed.params, results["fsdp"].params)
out["resumed_devices"] = sorted({len(x.sharding.device_set) for x in jax.tree.leaves(resumed.params)})
out["resumed_param_fraction"] = largest_shard_fraction(resumed.params, sharding.FSDP_MIN_SIZE)

# Explicit mesh axes: the batch is resharded (a sharding constraint there is
# an assertion). Data parallel here; 'fsdp' with sequence_axis below.
explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
one = Mesh(np.asarray(jax.devices()[:1]), ("data",))
mlp_kw = dict(kw, optimizer=common.OPTIMIZER, num_steps=3)
out["explicit_dp_losses"] = [
    pk.fit(common.loss_fn, common.init_params(), common.make_data(), mesh=m, **mlp_kw)
    .history["loss"].tolist() for m in (one, explicit)]

# Tensor parallelism on Explicit axes: NET's 2 heads and 128 hidden units
# over 'model', the batch over 'data' only; the flex kernel runs per head
# shard. Against the replicated fit above (the same steps, data and key).
tp_started = time.perf_counter()
tp_mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
tp_rule = pk.tensor_parameter_sharding("model")
traced_batch_specs.clear()
tp_split = pk.fit(NET.apply, params, data, num_steps=4, mesh=tp_mesh,
                  parameter_sharding=tp_rule, **kw)
out["tp_explicit_losses"] = [r.history["loss"].tolist() for r in (results["replicated"], tp_split)]
out["tp_explicit_vs_replicated"] = max_diff(tp_split.params, results["replicated"].params)
out["tp_explicit_batch_specs"] = sorted(set(traced_batch_specs))
out["tp_explicit_fractions"] = {
    name: max(s.data.size for s in w.addressable_shards) / w.size
    for name, w in ((name, tp_split.params[f"transformer/block_0/{name}"]["w"])
                    for name in ("attention/query", "attention/key", "attention/value",
                                 "attention/output", "mlp/w_in", "mlp/w_out"))}
_, _, hlo = compiled_step(NET, tp_rule, params, step_mesh=tp_mesh,
                          step_source=data_lib.ArrayData(data, batch_size=16, last_batch="drop",
                                                         mesh=tp_mesh))
out["tp_explicit_gathers"] = gathers(hlo)
# The all-reduced [B / 4, T, D] activations, alone or in a tuple.
out["tp_explicit_activation_reduces"] = sum(
    line.split(" all-reduce(")[0].count("f32[4,8,32]") for line in hlo.splitlines()
    if " all-reduce(" in line)
# One key/value head (MQA) cannot be split over 2 devices: traced, not compiled.
mqa = hk.transform(functools.partial(_loss, num_kv_heads=1))
mqa_params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), jax.eval_shape(
    mqa.init, jax.random.PRNGKey(0), {k: v[:2] for k, v in data.items()}))
compiles = programs.stats().get("compiles", 0)
try:
  pk.fit(mqa.apply, mqa_params, data, num_steps=1, mesh=tp_mesh, parameter_sharding=tp_rule,
         **kw)
  out["tp_explicit_error"] = ["no error", 0]
except ValueError as e:
  out["tp_explicit_error"] = [str(e), programs.stats().get("compiles", 0) - compiles]
out["tp_explicit_seconds"] = time.perf_counter() - tp_started

# sequence_axis: the batch over 'data', time over 'context'; 'fsdp' hands the
# loss gathered parameters.
seen_specs = []  # the layout of the batch each trace of the loss saw


def _long_loss(batch):
  """An LRU cell (ops.linear_scan), then a Mamba-2 model (its short
  convolution, ops.ssd, norms and MLP): [B, T, 4] -> mean squared error."""
  seen_specs.append(str(jax.typeof(batch["x"]).sharding.spec))
  h = pk.LRUCell(8, model_dim=4)(batch["x"])
  y = pk.SSMModel(4, 16, 4, 1, cell=pk.Mamba2Cell,
                  cell_kwargs=dict(head_dim=8, state_dim=4))(h)
  return jnp.mean((y - batch["y"]) ** 2)


LONG = hk.transform(_long_loss)
seq_data = {"x": rs.randn(8, 16, 4).astype(np.float32),
            "y": rs.randn(8, 16, 4).astype(np.float32)}
seq_params = jax.jit(LONG.init)(jax.random.PRNGKey(0), seq_data)
seq_mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(AxisType.Explicit,) * 2)
seq_kw = dict(kw, batch_size=4, num_steps=20, validation_data=seq_data)
whole = pk.fit(LONG.apply, seq_params, seq_data, mesh=one, **seq_kw)
seen_specs.clear()
split = pk.fit(LONG.apply, seq_params, seq_data, mesh=seq_mesh, sequence_axis="context",
               parameter_sharding="fsdp", **seq_kw)
out["sequence_losses"] = [r.history["loss"].tolist() for r in (whole, split)]
out["sequence_val_losses"] = [r.history["val_loss"].tolist() for r in (whole, split)]
out["sequence_seen_specs"] = sorted(set(seen_specs))
out["sequence_sharded_params"] = len(sharded_params(split.params))

# The convolution's split path, with a state to continue from: outputs and
# final state as on one device.
x, state = rs.randn(2, 16, 6).astype(np.float32), rs.randn(2, 3, 6).astype(np.float32)
w, b = rs.randn(4, 6).astype(np.float32), rs.randn(6).astype(np.float32)
expected = causal_conv.causal_conv(x, w, b, state)
with jax.set_mesh(seq_mesh):
  got = jax.jit(causal_conv.causal_conv)(
      jax.device_put(x, NamedSharding(seq_mesh, P("data", "context"))), w, b, state)
out["conv_split"] = [max_diff(expected, got), spec_entries(got[0])]

# A causal Transformer with the rotary embedding under sequence_axis: the
# zig-zag ring, with global positions.
def _causal_loss(batch, width=16):
  y = pk.Transformer(width, 2, 1, is_causal=True, use_rope=True)(batch["x"])  # [B, T, D]
  return jnp.mean((y - batch["y"]) ** 2)


CAUSAL = hk.transform(_causal_loss)
causal_data = {"x": rs.randn(8, 64, 16).astype(np.float32),
               "y": rs.randn(8, 64, 16).astype(np.float32)}
causal_params = jax.jit(CAUSAL.init)(jax.random.PRNGKey(0), causal_data)
causal_kw = dict(kw, batch_size=4, num_steps=20)
out["causal_losses"] = [r.history["loss"].tolist() for r in (
    pk.fit(CAUSAL.apply, causal_params, causal_data, mesh=one, **causal_kw),
    pk.fit(CAUSAL.apply, causal_params, causal_data, mesh=seq_mesh,
           sequence_axis="context", **causal_kw))]


# A DiffusionTransformer on a batch placed as fit() places it (the full ring;
# its time embedding per row): one device's predictions. Random parameters:
# its output projection starts at zero.
def _diffusion(batch):
  return pk.DiffusionTransformer(16, 2, 1)(batch["x"], batch["t"])  # [B, T, 16]


DIFFUSION = hk.without_apply_rng(hk.transform(_diffusion))
diffusion_data = dict(causal_data, t=rs.rand(8).astype(np.float32))  # t [B]: rows only
diffusion_params = jax.tree.map(
    lambda a: (0.1 * rs.randn(*a.shape)).astype(a.dtype),
    jax.eval_shape(DIFFUSION.init, jax.random.PRNGKey(0), diffusion_data))
diffusion_whole = jax.jit(DIFFUSION.apply)(diffusion_params, diffusion_data)
with jax.set_mesh(seq_mesh):
  diffusion_split = jax.jit(DIFFUSION.apply)(diffusion_params, sharding.put_batch(
      diffusion_data, seq_mesh, sequence_axis="context"))
out["diffusion_split"] = [max_diff(diffusion_whole, diffusion_split),
                          float(np.max(np.abs(diffusion_whole))), spec_entries(diffusion_split)]

# Memory: the gradient of each loss at T = 32,768 (compiled, never run), one
# sequence on one device against the same split 8 ways over 'context', placed
# as fit() places them (parameters replicated, the batch by batch_spec).
LONG_T = 32768
context_mesh = jax.make_mesh((8,), ("context",), axis_types=(AxisType.Explicit,))


def _mamba2_loss(batch):
  y = pk.SSMModel(32, 32, 32, 1, cell=pk.Mamba2Cell)(batch["x"])
  return jnp.mean((y - batch["y"]) ** 2)


def temp_bytes(net, mesh, sequence_axis=None):
  """Temporary bytes per device of jit(grad(loss)) on one [1, LONG_T, 32] batch."""
  x = jax.ShapeDtypeStruct((1, LONG_T, 32), jnp.float32)
  batch = {"x": x, "y": x}
  params = jax.eval_shape(net.init, jax.random.PRNGKey(0), batch)
  placed = lambda tree, shardings: jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
  batch = placed(batch, sharding.batch_shardings(batch, mesh, sequence_axis=sequence_axis))
  params = placed(params, jax.tree.map(lambda _: sharding.replicated(mesh), params))
  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(net.apply)).lower(params, None, batch).compile()
  return compiled.memory_analysis().temp_size_in_bytes


out["context_temp_bytes"] = {
    name: [temp_bytes(net, one), temp_bytes(net, context_mesh, "context")]
    for name, net in (("transformer", hk.transform(functools.partial(_causal_loss, width=32))),
                      ("mamba2", hk.transform(_mamba2_loss)))}

seq_errors = {}
auto_mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "context"))
for name, net, net_params, d, m, axis in [
    ("not_in_mesh", LONG, seq_params, seq_data, seq_mesh, "time"),
    ("auto_axis", LONG, seq_params, seq_data, auto_mesh, "context"),
    ("indivisible", LONG, seq_params, {k: v[:, :10] for k, v in seq_data.items()},
     seq_mesh, "context"),
    ("named_kernel", hk.transform(functools.partial(_loss, implementation="cudnn")), params,
     data, seq_mesh, "context")]:
  compiles = programs.stats().get("compiles", 0)
  try:
    pk.fit(net.apply, net_params, d, num_steps=1, mesh=m, sequence_axis=axis,
           **dict(kw, batch_size=4))
    seq_errors[name] = ["no error", 0]
  except ValueError as e:
    seq_errors[name] = [str(e), programs.stats().get("compiles", 0) - compiles]
out["sequence_errors"] = seq_errors
print("RESULT" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("resume"))
  return simulated_devices.run(_SCRIPT, directory, timeout=600)


def test_caller_arrays_survive_repeated_fits(eight_devices):
  out = eight_devices
  for mode in ("replicated", "fsdp"):
    assert out[mode + "_caller_unchanged"], mode
    assert out[mode + "_result_reused_unchanged"], mode
    assert out[mode + "_repeat_equal"], mode


def test_steps_are_traced_under_the_mesh(eight_devices):
  meshes = eight_devices["traced_meshes"]
  assert meshes and all(m == {"data": 8} for m in meshes), meshes


def test_replicated_step_gathers_nothing(eight_devices):
  out = eight_devices
  assert out["replicated_step_is_fits"], out
  assert out["replicated_gather_ops"] == 0, out["replicated_gathers"]
  assert out["replicated_mode_replicated"]


def test_fsdp_gathers_only_parameters_and_shards_them(eight_devices):
  out = eight_devices
  assert out["fsdp_step_is_fits"], out
  sharded = {tuple(x) for x in out["fsdp_sharded_params"]}
  gathered = {tuple(x) for x in out["fsdp_gathers"]}
  # Every all-gather's result is a whole parameter, gathered along the
  # dimension 'fsdp' split it on; every sharded parameter is gathered.
  assert out["fsdp_gather_ops"] == len(out["fsdp_gathers"]), out
  assert gathered == sharded, (gathered, sharded)
  scan_gathered = {tuple(x) for x in out["scan_gathers"]}
  scan_sharded = {tuple(x) for x in out["scan_sharded_layers"]}
  assert out["scan_gather_ops"] == len(out["scan_gathers"]), out
  assert scan_sharded and scan_gathered == scan_sharded, (scan_gathered, scan_sharded)
  # The model's 6 matrices (>= FSDP_MIN_SIZE elements) are split 8 ways, and
  # so are their Adam moments (mu, nu); norms and biases are replicated.
  assert len(out["param_fraction"]) == 6, out["param_fraction"]
  assert len(out["opt_fraction"]) == 12, out["opt_fraction"]
  for fraction in (*out["param_fraction"].values(), *out["opt_fraction"].values()):
    assert fraction <= 1 / 8
  assert out["small_replicated"]


def test_fsdp_and_tensor_parallel_train_like_replicated(eight_devices):
  out = eight_devices
  # Different reduction orders move the last bits only.
  assert out["fsdp_vs_replicated"] < 1e-5, out
  assert out["tp_vs_replicated"] < 1e-5, out
  assert out["tp_query"] == [[None, "model"], [32, 16]], out
  assert out["tp_query_mu"] == out["tp_query"], out
  np.testing.assert_allclose(*out["tp_val_loss"], rtol=1e-5)
  assert out["fit_model_diff"] < 1e-5, out
  assert [None, "data"] in out["fit_model_specs"], out


def test_bad_parameter_spec_names_the_parameter(eight_devices):
  errors = eight_devices["errors"]
  for name in ("unknown_axis", "indivisible", "not_a_spec"):
    assert "parameter_sharding" in errors[name], errors
    assert "transformer/block_0/attention/key/w" in errors[name], errors
  assert "'model'" in errors["unknown_axis"], errors
  assert "not divisible" in errors["indivisible"], errors


def test_resume_on_four_devices_equals_uninterrupted(eight_devices):
  out = eight_devices
  assert out["restored_placed"] and out["restored_equal"], out
  assert out["resumed_step"] == 4
  assert out["resumed_vs_whole"] < 1e-5, out
  assert out["resumed_devices"] == [4], out
  assert out["resumed_param_fraction"] and all(
      f <= 1 / 4 for f in out["resumed_param_fraction"].values()), out


def test_explicit_mesh_trains_like_one_device(eight_devices):
  np.testing.assert_allclose(*eight_devices["explicit_dp_losses"], rtol=1e-5)


def test_tensor_parallel_splits_heads_not_the_batch(eight_devices):
  out = eight_devices
  replicated, split = out["tp_explicit_losses"]
  assert len(split) == 4, out
  np.testing.assert_allclose(split, replicated, rtol=1e-5)
  assert out["tp_explicit_vs_replicated"] < 1e-5, out
  # Rows over 'data' only: each device holds B / 4 of them, not B / 8.
  assert out["tp_explicit_batch_specs"] == ["P('data', None, None)"], out
  assert all(f == 1 / 2 for f in out["tp_explicit_fractions"].values()), out
  # No parameter is gathered; [B / 4, T, D] activations are all-reduced four
  # times: the row-split products of attention and the MLP forward, and
  # backward the gradients entering the query/key/value product (summed
  # before one all-reduce) and `w_in`.
  assert out["tp_explicit_gathers"][1] == 0, out["tp_explicit_gathers"]
  assert out["tp_explicit_activation_reduces"] == 4, out
  message, compiles = out["tp_explicit_error"]
  assert "transformer/block_0/attention/key/w" in message and "K=1" in message, message
  assert "2 devices" in message, message
  assert compiles == 0, compiles
def test_sequence_axis_trains_like_one_device(eight_devices):
  out = eight_devices
  whole, split = out["sequence_losses"]
  assert len(whole) == 20, out
  np.testing.assert_allclose(split, whole, rtol=1e-5)
  np.testing.assert_allclose(*out["sequence_val_losses"], rtol=1e-5)
  # The model saw [B, T, 4] split by rows and time (the ops' per-shard path).
  assert out["sequence_seen_specs"] == ["P('data', 'context', None)"], out
  assert out["sequence_sharded_params"] > 0, out
  assert out["conv_split"][0] < 1e-5, out
  assert out["conv_split"][1] == ["data", "context", None], out


def test_attention_models_train_on_a_split_sequence_like_one_device(eight_devices):
  out = eight_devices
  whole, split = out["causal_losses"]
  assert len(whole) == 20, out
  np.testing.assert_allclose(split, whole, rtol=1e-5)
  difference, largest, spec = out["diffusion_split"]
  assert difference < 1e-5 * largest, out
  assert spec == ["data", "context", None], out


def test_context_parallel_gradient_needs_a_fifth_of_the_temporary_memory(eight_devices):
  # One device's attention holds [T, T] logits, the ring [T/16, T/16] blocks;
  # the Mamba-2 model's activations are T/8 per device, plus small states.
  for name, (one_device, per_device) in eight_devices["context_temp_bytes"].items():
    assert 0 < per_device <= 0.2 * one_device, (name, one_device, per_device)


def test_sequence_axis_errors_before_compiling(eight_devices):
  errors = eight_devices["sequence_errors"]
  for name, (message, compiles) in errors.items():
    assert "`sequence_axis`" in message, (name, message)
    assert compiles == 0, (name, compiles)
  assert "'data': 2, 'context': 4" in errors["not_in_mesh"][0], errors
  assert "Explicit" in errors["auto_axis"][0] and "Auto" in errors["auto_axis"][0], errors
  assert "T=10" in errors["indivisible"][0], errors
  # cuDNN, asked for by name, cannot split the sequence (nor run on a CPU).
  assert "MultiHeadAttention 'transformer/block_0/attention'" in errors["named_kernel"][0], errors


@pytest.mark.parametrize("value", ["zero3", 3, None, P("data")])
def test_bad_parameter_sharding_names_the_argument(value):
  with pytest.raises(ValueError, match="`parameter_sharding` must be one of"):
    probjax_hk.fit(common.loss_fn, common.init_params(), common.make_data(),
                   num_steps=1, parameter_sharding=value, progress=False)
  calls = []
  net = common.NET
  transformed = type(net)(lambda *a, **k: calls.append(1) or net.init(*a, **k), net.apply)
  with pytest.raises(ValueError, match="`parameter_sharding` must be one of"):
    probjax_hk.fit_model(transformed, common.make_data(), num_steps=1,
                         parameter_sharding=value, progress=False)
  assert not calls  # checked before transformed.init
