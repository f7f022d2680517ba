"""The ops take the arguments of the JAX functions whose contract they share.

`ops.flex_attention(..., key_value_seq_lengths=)` as `jax.nn.dot_product_attention`
names it, and `ops.grouped_matmul(..., precision=, preferred_element_type=)` as
`jax.lax.ragged_dot` takes them: the same arguments give the same values,
dtypes and gradients, on both implementations (and the key lengths per shard
on a mesh).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
from ops import _backend
from ops.grouped_matmul import api as gmm_api
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


# --- grouped_matmul: precision and preferred_element_type ---------------------

_M, _K, _N, _SIZES = 40, 24, 16, (9, 0, 25)

# Absolute tolerance (relative to the largest reference value) by the path's
# least precise rounding: float32 throughout, or a bfloat16 input or output.
_ATOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _gmm_case(dtype):
  lhs, rhs = _normal(0, (_M, _K), dtype), _normal(1, (len(_SIZES), _K, _N), dtype)
  return lhs, rhs, jnp.asarray(_SIZES, jnp.int32), _normal(2, (_M, _N))


@functools.cache
def _value_and_grads(fn):
  @jax.jit
  def run(lhs, rhs, sizes, cotangent):
    out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
    return (out, *vjp(cotangent.astype(out.dtype)))
  return run


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("dtype, preferred", [
    (jnp.float32, None), (jnp.float32, jnp.bfloat16),
    (jnp.bfloat16, None), (jnp.bfloat16, jnp.float32)])
def test_grouped_matmul_is_ragged_dot(implementation, dtype, preferred):
  """Values, output dtype and gradient dtypes and values, as ragged_dot."""
  lhs, rhs, sizes, cotangent = _gmm_case(dtype)
  ours = functools.partial(ops.grouped_matmul, preferred_element_type=preferred,
                           implementation=implementation)
  theirs = functools.partial(jax.lax.ragged_dot, precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=preferred)
  got = _value_and_grads(ours)(lhs, rhs, sizes, cotangent)
  want = _value_and_grads(theirs)(lhs, rhs, sizes, cotangent)
  assert [g.dtype for g in got] == [w.dtype for w in want]
  assert got[0].dtype == jnp.dtype(preferred or dtype)
  all_float32 = dtype == jnp.float32 and preferred in (None, jnp.float32)
  # The XLA path returns its float32 accumulator as ragged_dot does.
  exact_out = all_float32 or (implementation == "xla" and preferred == jnp.float32)
  _close(got[0], want[0], _ATOL["float32" if exact_out else "bfloat16"])
  # Gradients (in the input dtype); ragged_dot's own round the cotangent
  # products to a bfloat16 output's dtype.
  for g, w in zip(got[1:], want[1:]):
    _close(g, w, _ATOL["float32" if all_float32 else "bfloat16"])


def test_grouped_matmul_float32_output_keeps_what_bfloat16_rounds():
  """With preferred_element_type=float32 the XLA path returns its float32
  accumulator: closer to the float32 product than the bfloat16 output."""
  lhs, rhs, sizes, _ = _gmm_case(jnp.bfloat16)
  exact = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes,
                             precision=jax.lax.Precision.HIGHEST)
  wide = ops.grouped_matmul(lhs, rhs, sizes, preferred_element_type=jnp.float32,
                            implementation="xla")
  narrow = ops.grouped_matmul(lhs, rhs, sizes, implementation="xla")
  err = lambda x: float(np.abs(np.asarray(x, np.float32) - np.asarray(exact)).max())
  assert err(wide) < 1e-4 < err(narrow)


def _ragged_dot_precisions(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args)
  return [e.params["precision"] for e in jaxpr.jaxpr.eqns if "ragged_dot" in e.primitive.name]


def test_grouped_matmul_precision_reaches_ragged_dot():
  lhs, rhs, sizes, _ = _gmm_case(jnp.float32)
  for precision, want in [
      ("highest", (jax.lax.Precision.HIGHEST,) * 2),
      ((jax.lax.Precision.HIGH, "default"), (jax.lax.Precision.HIGH, jax.lax.Precision.DEFAULT)),
      (jax.lax.DotAlgorithmPreset.F32_F32_F32, jax.lax.DotAlgorithmPreset.F32_F32_F32)]:
    fn = functools.partial(ops.grouped_matmul, precision=precision, implementation="xla")
    assert _ragged_dot_precisions(fn, lhs, rhs, sizes) == [want], precision


@pytest.mark.parametrize("precision", [
    None, "default", jax.lax.Precision.HIGHEST, ("high", "highest"),
    jax.lax.DotAlgorithmPreset.DEFAULT, jax.lax.DotAlgorithmPreset.F32_F32_F32])
def test_grouped_matmul_kernel_takes_what_it_computes(precision):
  """The kernel multiplies float32 exactly: every lax.Precision, its own
  algorithm and DEFAULT run it, with the same result."""
  lhs, rhs, sizes, _ = _gmm_case(jnp.float32)
  got = ops.grouped_matmul(lhs, rhs, sizes, precision=precision, implementation="pallas")
  want = jax.lax.ragged_dot(lhs, rhs, sizes, precision=jax.lax.Precision.HIGHEST)
  _close(got, want, _ATOL["float32"])


@pytest.mark.parametrize("dtype, precision", [
    (jnp.float32, jax.lax.DotAlgorithmPreset.BF16_BF16_F32),
    (jnp.float32, "tf32_tf32_f32"),
    (jnp.bfloat16, jax.lax.DotAlgorithmPreset.F32_F32_F32),
    (jnp.bfloat16, jax.lax.DotAlgorithmPreset.BF16_BF16_BF16)])
def test_grouped_matmul_kernel_refuses_another_algorithm(dtype, precision, monkeypatch):
  lhs, rhs, sizes, _ = _gmm_case(dtype)
  with pytest.raises(ValueError, match=r"implementation='pallas'\): the kernels run `precision`"):
    ops.grouped_matmul(lhs, rhs, sizes, precision=precision, implementation="pallas")
  # implementation=None on an NVIDIA GPU runs XLA instead (traced here only).
  monkeypatch.setattr(_backend, "on_nvidia_gpu", lambda: True)
  fn = functools.partial(ops.grouped_matmul, precision=precision)
  assert len(_ragged_dot_precisions(fn, lhs, rhs, sizes)) == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(precision="fastest_possible"), "`precision` must be"),
    (dict(precision=3), "`precision` must be"),
    (dict(precision=("high",)), "`precision` must be"),
    (dict(preferred_element_type=jnp.int32), "`preferred_element_type` must be"),
    (dict(preferred_element_type=jnp.float16), "`preferred_element_type` must be"),
    (dict(preferred_element_type="not a dtype"), "`preferred_element_type` must be"),
])
@pytest.mark.parametrize("implementation", [None, "pallas", "xla"])
def test_grouped_matmul_bad_options_raise(kwargs, match, implementation):
  lhs, rhs, sizes, _ = _gmm_case(jnp.float32)
  with pytest.raises(ValueError, match=match):
    ops.grouped_matmul(lhs, rhs, sizes, implementation=implementation, **kwargs)


def test_precision_limit_names_the_kernels_algorithm():
  preset = jax.lax.DotAlgorithmPreset
  assert gmm_api.precision_limit((jax.lax.Precision.DEFAULT,) * 2, jnp.bfloat16) is None
  assert gmm_api.precision_limit(preset.BF16_BF16_F32, jnp.bfloat16) is None
  assert "F32_F32_F32" in gmm_api.precision_limit(preset.TF32_TF32_F32, jnp.float32)


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
    text = grad.lower(*placed).compile().as_text()
    got = grad(*placed)
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
