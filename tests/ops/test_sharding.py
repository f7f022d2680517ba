"""The kernels run per shard on a mesh: no gather in front of any of them.

XLA's partitioner replicates a Pallas kernel (an opaque custom call) unless
the op runs it per shard (`ops/_sharding.py`). On 8 simulated CPU devices,
with every kernel forced on (interpret mode), each op is differentiated with
its batch split over a mesh: the compiled program must hold no all-gather,
and the values and gradients must equal one device's; a batch the mesh does
not divide is padded, not run whole on every device; and an array placed on
Auto axes outside a trace is read as placed. pytest workers import
JAX with one CPU device, so the 8-device run is a subprocess (one for the
whole file: its compile time is the cost). The library's models, the same
way: tests/models/test_sharding.py.
"""

import pytest

from tests import simulated_devices

# The helpers of this file's script and of tests/models/test_sharding.py's.
PRELUDE = r'''
import functools, json
import haiku as hk
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import ops
import probjax_hk as pk
from tests.ops import test_shard_map

assert jax.device_count() == 8, jax.devices()
out = {}

def gathers(text):
  return sum(line.count(" all-gather") for line in text.splitlines())

def max_err(got, want):
  return max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
             / (1.0 + float(np.max(np.abs(np.asarray(b, np.float32)))))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))

def check(name, loss, args, specs, mesh, also_explicit=None):
  """Gathers in the compiled fwd+bwd on `mesh`, and the error against one
  device; the same on the mesh `also_explicit` under the name explicit/<name>."""
  grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))
  want = grad(*args)
  for key, m in ((name, mesh), (f"explicit/{name}", also_explicit)):
    if m is None:
      continue
    placed = [jax.device_put(a, NamedSharding(m, s)) for a, s in zip(args, specs)]
    with jax.set_mesh(m):
      compiled = grad.lower(*placed).compile()  # run as read: one compile
      got = compiled(*placed)
    out[key] = {"gathers": gathers(compiled.as_text()), "err": max_err(got, want)}

def sin_sum(fn):
  return lambda *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float32)))

auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
'''

_SCRIPT = PRELUDE + r'''
# Every op, batch 8 split over 8 devices (Auto axes from jax.set_mesh).
for name, (fn, args, specs) in test_shard_map._cases().items():
  batched = [s == test_shard_map._B for s in specs]
  args = [jnp.concatenate([a] * 4) if b else a for a, b in zip(args, batched)]
  check(f"op/{name}", sin_sum(fn), args, [P("data") if b else P() for b in batched], auto)

# Not vacuous: the kernel path called directly (not through the op) is
# gathered by the partitioner; through the op, arrays placed on a mesh are
# enough (their types carry it through the trace) without jax.set_mesh.
from ops.ssd import pallas as ssd_pallas
fn, args, specs = test_shard_map._cases()["ssd"]
args = [jnp.concatenate([a] * 4) for a in args]
placed = [jax.device_put(a, NamedSharding(auto, P("data"))) for a in args]
raw = lambda q, k, v, g: ssd_pallas.ssd_pallas(q, k, v, g, initial_state=None, chunk_size=None)[0]
out["raw_kernel_gathers"] = gathers(jax.jit(jax.grad(sin_sum(raw), argnums=(0, 1, 2, 3))).lower(
    *placed).compile().as_text())
out["placed_without_set_mesh_gathers"] = gathers(jax.jit(jax.grad(
    sin_sum(fn), argnums=(0, 1, 2, 3))).lower(*placed).compile().as_text())

# Explicit axes: batch over 'data', heads (channels) over 'model', from the types.
key = jax.random.split(jax.random.PRNGKey(1), 5)
q = jax.random.normal(key[0], (4, 24, 4, 16))
kv = jax.random.normal(key[1], (4, 24, 2, 16))
check("explicit/flex_attention_gqa", sin_sum(lambda q, k, v: ops.flex_attention(
    q, k, v, is_causal=True, implementation="pallas")),
      [q, kv, kv], [P("data", None, "model")] * 3, explicit)
decay = -jax.nn.softplus(jax.random.normal(key[2], (4, 24, 4)))
check("explicit/ssd_heads", sin_sum(lambda q, k, v, g: ops.ssd(q, k, v, g, implementation="pallas")[0]),
      [q, q, q, decay], [P("data", None, "model")] * 3 + [P("data", None, "model")], explicit)
u = jax.random.normal(key[3], (4, 24, 8))
a_mat = -jnp.exp(jax.random.normal(key[4], (8, 4)))
bc = jax.random.normal(key[2], (4, 24, 4))
check("explicit/selective_scan_channels", sin_sum(lambda u, dt, a, b, c: ops.selective_scan(
    u, dt, a, b, c, delta_softplus=True, implementation="pallas")[0]),
      [u, u, a_mat, bc, bc], [P("data", None, "model"), P("data", None, "model"),
                              P("model"), P("data"), P("data")], explicit)
try:
  bad = jax.device_put(q, NamedSharding(explicit, P(None, "data")))
  with jax.set_mesh(explicit):
    ops.flex_attention(bad, bad, bad, mask_mod=lambda b, n, t, s: s <= t, implementation="pallas")
  out["sequence_error"] = "no error"
except ValueError as e:
  out["sequence_error"] = str(e)

# Auto axes, a batch of 3 on 8 devices: padded to 8, one row per device (the
# kernel sees batch 1), no operand gathered or resharded.
import time
from ops import _sequence_parallel, _sharding
from tests.ops import compiled_programs
start = time.perf_counter()
fn, args, specs = test_shard_map._cases()["ssd"]
args = [jnp.concatenate([a, a])[:3] for a in args]
grad = jax.jit(jax.value_and_grad(sin_sum(fn), argnums=(0, 1, 2, 3)))
seen, real = [], ssd_pallas.ssd_pallas
ssd_pallas.ssd_pallas = lambda q, *a, **kw: (seen.append(q.shape[0]), real(q, *a, **kw))[1]
with jax.set_mesh(auto):
  compiled = grad.lower(*args).compile()
  got = compiled(*args)
ssd_pallas.ssd_pallas = real
out["padded_batch"] = {"kinds": compiled_programs.collective_kinds(compiled.as_text()),
                       "kernel_batch": seen, "err": max_err(got, grad(*args))}
# Rows of a grouped matmul likewise: padded rows belong to no group.
x, w = jax.random.normal(key[0], (61, 16)), jax.random.normal(key[1], (3, 16, 24))
grad = jax.jit(jax.value_and_grad(sin_sum(lambda x, w: ops.grouped_matmul(
    x, w, jnp.array([10, 0, 51], jnp.int32), implementation="pallas")), argnums=(0, 1)))
with jax.set_mesh(auto):
  compiled = grad.lower(x, w).compile()
  got = compiled(x, w)
out["padded_rows"] = {"kinds": compiled_programs.collective_kinds(compiled.as_text()),
                      "err": max_err(got, grad(x, w))}
# MoE with a capacity cannot pad: a padded token would take a real one's slot.
try:
  with jax.set_mesh(auto):
    jax.eval_shape(functools.partial(ops.moe_dispatch, capacity_factor=1.0), x[:12],
                   jnp.zeros((12, 2), jnp.int32), jnp.ones((12, 2)), w, w.transpose(0, 2, 1))
  out["capacity_error"] = "no error"
except ValueError as e:
  out["capacity_error"] = str(e)

# Outside a trace an array's Auto split is known: split where the op can,
# an error naming the argument and the axis where it cannot.
mesh2 = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
q = jax.random.normal(key[0], (4, 24, 4, 16))
on = lambda mesh, *spec: jax.device_put(q, NamedSharding(mesh, P(*spec)))
heads = _sharding.plan("ssd", [("q", on(mesh2, None, None, "model"), ("batch", "seq", "heads", None))],
                       split=("batch", "heads")).axes
traced = []
jax.jit(lambda x: traced.append(_sequence_parallel.splits_time(x)) or x).trace(
    on(auto, None, "data"))
out["eager"] = {"heads_axes": {k: list(v) for k, v in heads.items()},
                "time_split": _sequence_parallel.splits_time(on(auto, None, "data")),
                "time_split_traced": traced[0]}
try:
  with jax.set_mesh(auto):
    ops.ssd(q, on(auto, None, None, None, "data"), q, decay, implementation="pallas")
  out["eager"]["key_size_error"] = "no error"
except ValueError as e:
  out["eager"]["key_size_error"] = str(e)
out["added_seconds"] = time.perf_counter() - start
print("RESULT" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def results():
  return simulated_devices.run(_SCRIPT, timeout=900)


_CASES = [f"op/{n}" for n in ("flex_attention", "ssd", "gated_delta_rule", "selective_scan",
                              "linear_scan", "grouped_matmul", "grouped_mlp")] + [
    "explicit/flex_attention_gqa", "explicit/ssd_heads", "explicit/selective_scan_channels"]


@pytest.mark.parametrize("case", _CASES)
def test_runs_per_shard_and_matches_one_device(results, case):
  assert results[case]["gathers"] == 0, results[case]
  assert results[case]["err"] < 2e-5, results[case]


def test_the_kernel_called_directly_is_gathered(results):
  """The check above can fail: the partitioner gathers a kernel's inputs when
  the kernel is not run per shard."""
  assert results["raw_kernel_gathers"] > 0, results


def test_arrays_placed_on_a_mesh_need_no_mesh_in_context(results):
  assert results["placed_without_set_mesh_gathers"] == 0, results


def test_a_batch_the_auto_axes_do_not_divide_is_padded(results):
  """3 rows on 8 devices: one each, nothing gathered or resharded (the
  all-reduce returns the gradients, replicated as the inputs were)."""
  case = results["padded_batch"]
  assert case["kernel_batch"] == [1], case
  assert set(case["kinds"]) <= {"all-reduce"} and case["err"] < 2e-5, case
  case = results["padded_rows"]
  assert set(case["kinds"]) <= {"all-reduce"} and case["err"] < 2e-5, case
  message = results["capacity_error"]
  assert "token count 12" in message and "('data',)" in message and "(8,)" in message, message


def test_an_auto_split_outside_a_trace_is_read(results):
  """An array placed on Auto axes and passed outside jit: its heads split as
  placed, its time split seen, and a split the op cannot take refused; under
  jit the same split is not visible."""
  eager = results["eager"]
  assert eager["heads_axes"] == {"heads": ["model"], "batch": ["data"]}, eager
  assert eager["time_split"] and not eager["time_split_traced"], eager
  message = eager["key_size_error"]
  assert "`k`" in message and "axis 3" in message and "cannot split" in message, message


def test_a_sharded_sequence_the_kernels_cannot_ring_is_an_error(results):
  """A mod sees global positions, which the kernels' ring blocks do not have."""
  message = results["sequence_error"]
  assert "`q`" in message and "sequence axis" in message and "mask_mod" in message, message
