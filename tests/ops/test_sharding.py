"""The kernels run per shard on a mesh: no gather in front of any of them.

XLA's partitioner replicates a Pallas kernel (an opaque custom call) unless
the op runs it per shard (`ops/_sharding.py`). On 8 simulated CPU devices,
with every kernel forced on (interpret mode), each op is differentiated with
its batch split over a mesh: the compiled program must hold no all-gather,
and the values and gradients must equal one device's. pytest workers import
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
    ops.flex_attention(bad, bad, bad, implementation="pallas")
  out["sequence_error"] = "no error"
except ValueError as e:
  out["sequence_error"] = str(e)
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


def test_a_sharded_sequence_axis_is_an_error(results):
  message = results["sequence_error"]
  assert "`q`" in message and "sequence axis" in message and "cannot split" in message, message
