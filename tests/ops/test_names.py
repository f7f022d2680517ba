"""The ops take the arguments of the JAX functions whose contract they share.

`ops.flex_attention(..., key_value_seq_lengths=)` as `jax.nn.dot_product_attention`
names it: the same arguments give the same values on both implementations,
and the key lengths per shard on a mesh. (`ops.grouped_matmul`'s arguments
as `jax.lax.ragged_dot` takes them: `test_contract_ragged_dot.py`.)
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
from tests import simulated_devices



def _normal(key, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32).astype(dtype)


def _close(got, want, atol):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = max(1.0, float(np.abs(want).max()))
  np.testing.assert_allclose(got, want, rtol=0, atol=atol * scale)


# --- flex_attention: key_value_seq_lengths -----------------------------------


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_flex_key_value_seq_lengths_is_jax_nn_argument(implementation):
  """GQA 4:2, causal, and every example's keys cut at its own length (no row
  is left without keys, where jax.nn returns the mean of v and flex zeros)."""
  q = _normal(0, (2, 24, 4, 16))
  k, v = _normal(1, (2, 24, 2, 16)), _normal(2, (2, 24, 2, 16))
  lengths = jnp.array([24, 9], jnp.int32)
  got = ops.flex_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                           implementation=implementation)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                      key_value_seq_lengths=lengths, implementation="xla")
  _close(got, want, 2e-5)
  # Not vacuous: the lengths change the output of the second example only.
  full = ops.flex_attention(q, k, v, is_causal=True, implementation=implementation)
  assert np.allclose(full[0], got[0]) and not np.allclose(full[1, 10:], got[1, 10:])


# --- key lengths per shard on 8 CPU devices -----------------------------------

_SCRIPT = r'''
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import ops

assert jax.device_count() == 8
out = {}
auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
normal = lambda i, shape: jax.random.normal(jax.random.PRNGKey(i), shape)

def run(name, fn, args, specs, mesh):
  """fn's fwd+bwd (not in its last, integer argument) on `mesh` against one device."""
  loss = lambda *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float32)))
  grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args) - 1))))
  want = grad(*args)
  placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  with jax.set_mesh(mesh):
    compiled = grad.lower(*placed).compile()  # run as read: one compile
    text, got = compiled.as_text(), compiled(*placed)
  err = max(float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())
            / (1.0 + float(np.abs(np.asarray(b, np.float32)).max()))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  out[name] = {"gathers": text.count(" all-gather"), "err": err}

q, kv = normal(0, (8, 16, 2, 16)), normal(1, (8, 16, 2, 16))
lengths = jnp.array([16, 3, 9, 16, 1, 12, 16, 7], jnp.int32)
def flex(q, k, v, lengths):
  return ops.flex_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                            implementation="pallas")
run("flex_lengths", flex, [q, kv, kv, lengths], [P("data")] * 4, auto)

try:  # The lengths split over another axis than the batch of q.
  placed = [jax.device_put(q, NamedSharding(explicit, P("data"))),
            jax.device_put(kv, NamedSharding(explicit, P("data"))),
            jax.device_put(kv, NamedSharding(explicit, P("data"))),
            jax.device_put(lengths, NamedSharding(explicit, P("model")))]
  with jax.set_mesh(explicit):
    flex(*placed)
  out["lengths_error"] = "no error"
except ValueError as e:
  out["lengths_error"] = str(e)
print("RESULT" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def sharded():
  return simulated_devices.run(_SCRIPT, timeout=600)


def test_flex_key_value_seq_lengths_run_per_shard(sharded):
  assert sharded["flex_lengths"]["gathers"] == 0, sharded
  assert sharded["flex_lengths"]["err"] < 2e-5, sharded


def test_a_misplaced_length_array_is_named(sharded):
  message = sharded["lengths_error"]
  assert "`key_value_seq_lengths` is sharded over ('model',)" in message, message
  assert "batch axis" in message and "split alike" in message, message
