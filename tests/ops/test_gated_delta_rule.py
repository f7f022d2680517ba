"""ops.gated_delta_rule: the chunked (WY / UT-transform) XLA tier and the Pallas
kernels (interpret mode on CPU) against the step-by-step reference: outputs,
final states and gradients of every input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import tolerances
import ops
from ops import _backend
from ops.gated_delta_rule import api
from ops.gated_delta_rule import gated_delta_rule
from ops.gated_delta_rule import gated_delta_rule_reference
from tests.ops import test_measured
from tests.ops.outputs_and_grads import fixed_weights_loss
from tests.ops.outputs_and_grads import outputs_and_grads
from tests.ops.outputs_and_grads import sin_loss

# Max error relative to max(1, max |reference|), per dtype: (forward, gradients).
_TOL = tolerances.GATED_DELTA_RULE
_NAMES = ("q", "k", "v", "log_decay", "beta", "initial_state")


def _rel(x, ref):
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  assert np.isfinite(x).all()
  return np.abs(x - ref).max() / max(1.0, np.abs(ref).max())


def _inputs(batch, time, heads, key, value, dtype, *, decay=None, seed=0, groups=None):
  """q, k, v, log_decay, beta in `dtype` and a float32 initial state, drawn
  with NumPy (an eager `jax.random` call compiles a program per shape)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape, np.float32)
  groups = groups or heads
  q = normal(batch, time, groups, key)
  k = normal(batch, time, groups, key)
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = normal(batch, time, heads, value)
  if decay is None:
    g = -np.logaddexp(0.0, normal(batch, time, heads) - 1.0)  # -softplus
  else:
    g = np.full((batch, time, heads), decay, np.float32)
  beta = 1.0 / (1.0 + np.exp(-normal(batch, time, heads)))
  h0 = normal(batch, heads, key, value)
  return tuple(jnp.asarray(x.astype(dtype)) for x in (q, k, v, g, beta)) + (jnp.asarray(h0),)


@functools.lru_cache(maxsize=None)
def _fns(implementation, chunk_size, with_state, scale=None):
  """One jitted program: (y, final) and the gradients of every input."""
  def fn(q, k, v, g, beta, h0):
    h0 = h0 if with_state else None
    if implementation == "reference":
      return gated_delta_rule_reference(q, k, v, g, beta, scale=scale, initial_state=h0)
    return gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                            chunk_size=chunk_size, implementation=implementation)
  return outputs_and_grads(fn, fixed_weights_loss, range(6 if with_state else 5))


def _check(implementation, chunk_size, dtype, shape, *, with_state=True, decay=None,
           groups=None, scale=None):
  args = _inputs(*shape, dtype, decay=decay, groups=groups)
  (y, final), grads = _fns(implementation, chunk_size, with_state, scale)(*args)
  (y_ref, final_ref), ref_grads = _fns("reference", None, with_state, scale)(*args)
  assert y.dtype == args[2].dtype and final.dtype == jnp.float32
  fwd_tol, grad_tol = _TOL[dtype]
  assert _rel(y, y_ref) < fwd_tol
  assert _rel(final, final_ref) < fwd_tol
  for name, a, b in zip(_NAMES, grads, ref_grads):
    assert a.shape == b.shape, name
    assert _rel(a, b) < grad_tol, name


# (time, chunk, dtype, q/k groups, with initial state, scale); batch 1, 4 heads,
# K 16, V 24. Both tiers run the same cases: the reference compiles once per case.
# T covers the issue's {1, 31, 64, 200}: one step, a padded last chunk, whole chunks,
# several chunks with a padded tail.
_CASES = [
    (31, 16, jnp.float32, 2, True, 0.3),      # shared q/k, padded K/V/T, own scale
    (64, 32, jnp.bfloat16, None, False, None),
    (1, None, jnp.float32, None, True, None),  # the default chunk
    (200, 64, jnp.float32, None, True, None),
]


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("time, chunk, dtype, groups, with_state, scale", _CASES)
def test_matches_reference(implementation, time, chunk, dtype, groups, with_state, scale):
  _check(implementation, chunk, dtype, (1, time, 4, 16, 24), groups=groups,
         with_state=with_state, scale=scale)


@pytest.mark.parametrize("case", ["random", "repeated_key"])
@pytest.mark.parametrize("block", [None, 16, 8, 2])
def test_unit_lower_inverse(case, block):
  """(I + A)^-1 of the kernels (forward substitution, in diagonal blocks of
  `block` rows merged after it) against numpy, at L 32. 'repeated_key' (one key written 32 times with beta 1 and no decay: A
  all ones below the diagonal) is the case a truncated series would get wrong:
  its powers grow like binomials while the inverse is bidiagonal."""
  from ops.gated_delta_rule import triton as gdr_triton
  chunk = 32
  if case == "random":
    a = np.random.default_rng(0).uniform(-0.5, 0.5, (chunk, chunk))
  else:
    a = np.ones((chunk, chunk), np.float32)
  a = np.tril(a, -1).astype(np.float32)
  got = gdr_triton._unit_lower_inverse(jnp.asarray(a), chunk, block)
  want = np.linalg.inv(np.eye(chunk) + a.astype(np.float64))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize(
    "block_v, state_block_v, grad_num_stages, inverse_block, grad_block_k, key, groups",
    [(16, None, 2, None, None, 16, None), (32, 16, 1, 4, 16, 40, 1)])
def test_kernels_loop_over_several_value_tiles(block_v, state_block_v, grad_num_stages,
                                               inverse_block, grad_block_k, key, groups):
  """The output and gradient kernels visit V a `block_v` tile at a time
  (V 40 pads to 64: four or two tiles, the last one all padding) and the
  states kernels run one program per `state_block_v` tile (`block_v`'s when
  None); the prepare kernel's inverse in diagonal blocks of `inverse_block`
  rows; the key-gradient kernel on `grad_block_k` columns (K 40 pads to 64:
  four programs per chunk, the last all padding, with q/k shared by both
  heads); outputs and every gradient still match."""
  from ops.gated_delta_rule import configs as gdr_configs
  from ops.gated_delta_rule import pallas as gdr_pallas_lib
  blocks = gdr_configs.TritonConfig(chunk=16, block_v=block_v, state_block_v=state_block_v,
                                    grad_num_stages=grad_num_stages,
                                    inverse_block=inverse_block, grad_block_k=grad_block_k)
  args = _inputs(1, 40, 2, key, 40, jnp.float32, seed=3, groups=groups)
  kernel = lambda *a: gdr_pallas_lib.gated_delta_rule_pallas(
      *a[:5], initial_state=a[5], blocks=blocks)
  reference = lambda *a: gated_delta_rule_reference(*a[:5], initial_state=a[5])
  outputs, grads = outputs_and_grads(kernel, sin_loss)(*args)
  ref_outputs, ref_grads = outputs_and_grads(reference, sin_loss)(*args)
  for got, want in zip(outputs, ref_outputs):
    assert _rel(got, want) < 2e-5
  for name, a, b in zip(_NAMES, grads, ref_grads):
    assert a.shape == b.shape, name
    assert _rel(a, b) < 2e-4, name


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("decay", [-20.0, 0.0])
def test_strong_and_no_decay_stay_finite(implementation, decay):
  # The last case's shapes and options (several chunks, a padded tail): its
  # compiled programs, other values.
  time, chunk, dtype, groups, with_state, scale = _CASES[-1]
  _check(implementation, chunk, dtype, (1, time, 4, 16, 24), decay=decay, groups=groups,
         with_state=with_state, scale=scale)


def test_default_implementation_on_cpu_is_xla(monkeypatch):
  called = []
  real = api.gated_delta_rule_xla
  monkeypatch.setattr(api, "gated_delta_rule_xla",
                      lambda *a, **kw: called.append(1) or real(*a, **kw))
  args = _inputs(1, 8, 2, 16, 16, jnp.float32)[:5]
  y, _ = jax.jit(lambda *a: gated_delta_rule(*a))(*args)  # a trace of its own
  assert called == ([] if _backend.on_nvidia_gpu() else [1])
  np.testing.assert_allclose(y, jax.jit(gated_delta_rule_reference)(*args)[0], atol=2e-5)
  assert ops.gated_delta_rule is gated_delta_rule


def test_default_on_gpu_is_the_kernel_where_checked_and_measured_faster(monkeypatch):
  args = _inputs(1, 8, 2, 16, 16, jnp.float32)[:5]
  test_measured.fake_gpu(monkeypatch, {})  # a GPU never measured: XLA
  assert "pallas_call" not in str(jax.make_jaxpr(lambda *a: gated_delta_rule(*a))(*args))
  test_measured.fake_gpu(monkeypatch, {"gated_delta_rule": test_measured.kernel_measured_faster(
      key_dim=16, length=8)})
  assert "pallas_call" in str(jax.make_jaxpr(gated_delta_rule)(*args))
  # A chunk size the kernel cannot take falls back to XLA instead of raising.
  assert "pallas_call" not in str(jax.make_jaxpr(
      lambda *a: gated_delta_rule(*a, chunk_size=24))(*args))


def test_kernel_limits_raise_for_pallas_only():
  args = _inputs(1, 8, 2, 16, 16, jnp.float32)[:5]
  with pytest.raises(ValueError, match="chunk_size"):
    gated_delta_rule(*args, chunk_size=24, implementation="pallas")
  jax.eval_shape(functools.partial(gated_delta_rule, chunk_size=24, implementation="xla"),
                 *args)  # traced only: whether it raises
  big = _inputs(1, 4, 1, 512, 16, jnp.float32)[:5]
  with pytest.raises(ValueError, match="must be <= 256"):
    gated_delta_rule(*big, implementation="pallas")


@pytest.mark.parametrize("change, match", [
    (dict(beta=(2, 8, 3)), "`beta` must be"),
    (dict(g=(2, 8, 4, 1)), "`log_decay` must be"),
    (dict(k=(2, 8, 4, 8)), "`k` must have the shape"),
    (dict(h0=(2, 4, 16, 8)), "`initial_state` must be"),
])
def test_bad_shapes_raise(change, match):
  shapes = dict(q=(2, 8, 4, 16), k=(2, 8, 4, 16), v=(2, 8, 4, 16), g=(2, 8, 4),
                beta=(2, 8, 4), h0=(2, 4, 16, 16))
  shapes.update(change)
  x = {name: jnp.zeros(s) for name, s in shapes.items()}
  with pytest.raises(ValueError, match=match):
    gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"])


@pytest.mark.parametrize("knobs, match", [
    (dict(chunk=24), "`chunk` must be a power of two"),
    (dict(block_v=8), "`block_v` must be >= 16"),
    (dict(chunk=16, inverse_block=32), "`inverse_block` must be between 2 and `chunk`"),
    (dict(inverse_block=6), "`inverse_block` must be a power of two"),
    (dict(grad_num_stages=0), "`grad_num_stages` must be >= 1"),
    (dict(grad_block_k=8), "`grad_block_k` must be >= 16"),
    (dict(key_grad_num_warps=3), "`key_grad_num_warps` must be a power of two"),
])
def test_bad_tiling_raises(knobs, match):
  from ops.gated_delta_rule import configs as gdr_configs
  with pytest.raises(ValueError, match=match):
    gdr_configs.TritonConfig(**knobs)
