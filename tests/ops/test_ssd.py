"""ops.ssd: the chunked XLA tier and the Pallas kernels (interpret mode on CPU)
against the step-by-step reference: outputs, final states and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import tolerances
import ops
from ops import _backend
from ops.ssd import api
from ops.ssd import ssd
from ops.ssd import ssd_reference
from tests.ops import test_measured

# Max error relative to max(1, max |reference|), per dtype: (forward, gradients).
_TOL = tolerances.SSD
_LOG_DECAY_GRAD_TOL = tolerances.SSD_LOG_DECAY_GRAD


def _rel(x, ref):
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  assert np.isfinite(x).all()
  return np.abs(x - ref).max() / max(1.0, np.abs(ref).max())


def _inputs(batch, time, heads, groups, key, value, dtype, *, decay=None, seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (batch, time, groups, key)).astype(dtype)
  k = (jax.random.normal(ks[1], (batch, time, groups, key)) / key ** 0.5).astype(dtype)
  v = jax.random.normal(ks[2], (batch, time, heads, value)).astype(dtype)
  if decay is None:
    g = -jax.nn.softplus(jax.random.normal(ks[3], (batch, time, heads)) - 1.0)
  else:
    g = jnp.full((batch, time, heads), decay)
  h0 = jax.random.normal(ks[4], (batch, heads, key, value))
  return q, k, v, g.astype(dtype), h0


def _loss(fn, q, k, v, g, h0):
  """Linear in (y, final) with fixed weights: the cotangents are exact in every dtype."""
  y, final = fn(q, k, v, g, initial_state=h0)
  wy = jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
  wf = jnp.sin(jnp.arange(final.size, dtype=jnp.float32).reshape(final.shape))
  return jnp.sum(y.astype(jnp.float32) * wy) + jnp.sum(final * wf)


@functools.lru_cache(maxsize=None)
def _value_and_grad(implementation, chunk_size, with_state):
  def fn(q, k, v, g, initial_state):
    if implementation == "reference":
      return ssd_reference(q, k, v, g, initial_state=initial_state)
    return ssd(q, k, v, g, initial_state=initial_state, chunk_size=chunk_size,
               implementation=implementation)
  argnums = (0, 1, 2, 3, 4) if with_state else (0, 1, 2, 3)

  def loss(q, k, v, g, h0):
    return _loss(fn, q, k, v, g, h0 if with_state else None)
  return jax.jit(jax.value_and_grad(loss, argnums=argnums)), jax.jit(fn)


def _check(implementation, chunk_size, dtype, shape, *, with_state=True, decay=None):
  q, k, v, g, h0 = _inputs(*shape, dtype, decay=decay)
  grad_fn, fwd = _value_and_grad(implementation, chunk_size, with_state)
  ref_grad, ref_fwd = _value_and_grad("reference", None, with_state)
  h0 = h0 if with_state else None
  y, final = fwd(q, k, v, g, h0)
  y_ref, final_ref = ref_fwd(q, k, v, g, h0)
  assert y.dtype == v.dtype and final.dtype == jnp.float32
  assert y.shape == v.shape and final.shape == final_ref.shape
  fwd_tol, grad_tol = _TOL[dtype]
  assert _rel(y, y_ref) < fwd_tol
  assert _rel(final, final_ref) < fwd_tol
  _, grads = grad_fn(q, k, v, g, h0 if with_state else jnp.zeros(()))
  _, grads_ref = ref_grad(q, k, v, g, h0 if with_state else jnp.zeros(()))
  names = ("q", "k", "v", "log_decay", "initial_state")
  for name, a, b in zip(names, grads, grads_ref):
    assert a.shape == b.shape, name
    tol = _LOG_DECAY_GRAD_TOL[dtype] if name == "log_decay" else grad_tol
    assert _rel(a, b) < tol, name


# (time, chunk, dtype, (heads, groups, key, value), with initial state); batch 1.
# Both tiers run the same cases, so the reference compiles once per case.
# T covers the issue's {1, 31, 64, 200}: one step, a padded last chunk, whole chunks,
# several chunks with a padded tail.
_CASES = [
    (31, 16, jnp.float32, (4, 2, 16, 24), True),     # shared q/k, padded K/V/T
    (64, 32, jnp.bfloat16, (2, 2, 32, 32), False),   # one group per head
    (1, None, jnp.float32, (2, 1, 16, 16), True),    # the default chunk
    (200, 64, jnp.float32, (2, 1, 16, 16), True),
]


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("time, chunk, dtype, dims, with_state", _CASES)
def test_matches_reference(implementation, time, chunk, dtype, dims, with_state):
  _check(implementation, chunk, dtype, (1, time) + dims, with_state=with_state)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("decay", [-20.0, 0.0])
def test_strong_and_no_decay_stay_finite(implementation, decay):
  _check(implementation, 16, jnp.float32, (1, 40, 2, 2, 16, 16), decay=decay)


def test_default_implementation_on_cpu_is_xla_and_vmaps(monkeypatch):
  called = []
  real = api.ssd_xla
  monkeypatch.setattr(api, "ssd_xla", lambda *a, **kw: called.append(1) or real(*a, **kw))
  q, k, v, g, _ = _inputs(2, 12, 2, 2, 16, 16, jnp.float32)
  fn = lambda q, k, v, g: ssd(q[None], k[None], v[None], g[None])[0][0]
  y = jax.vmap(fn)(q, k, v, g)                      # over a leading (batch) axis
  assert called == ([] if _backend.on_nvidia_gpu() else [1])
  np.testing.assert_allclose(y, ssd_reference(q, k, v, g)[0], atol=2e-5, rtol=2e-5)
  assert ops.ssd is ssd


def test_default_on_gpu_is_the_kernel_where_checked_and_measured_faster(monkeypatch):
  q, k, v, g, _ = _inputs(1, 12, 2, 2, 16, 16, jnp.float32)
  test_measured.fake_gpu(monkeypatch, {})  # a GPU never measured: XLA
  assert "pallas_call" not in str(jax.make_jaxpr(lambda *a: ssd(*a))(q, k, v, g))
  test_measured.fake_gpu(monkeypatch, {"ssd": test_measured.kernel_measured_faster(
      key_dim=16, length=12)})
  assert "pallas_call" in str(jax.make_jaxpr(lambda *a: ssd(*a))(q, k, v, g))


@pytest.mark.parametrize("change, match", [
    (dict(v=(2, 8, 3)), "`v` must be"),
    (dict(q=(2, 9, 2, 16), k=(2, 9, 2, 16)), "`q` must be"),
    (dict(q=(2, 8, 3, 16), k=(2, 8, 3, 16)), "multiple of the groups"),
    (dict(k=(2, 8, 2, 8)), "`k` must have the shape"),
    (dict(g=(2, 8, 3)), "`log_decay` must be"),
    (dict(h0=(2, 4, 16, 15)), "`initial_state` must be"),
])
def test_bad_shapes_raise(change, match):
  shapes = dict(q=(2, 8, 2, 16), k=(2, 8, 2, 16), v=(2, 8, 4, 16), g=(2, 8, 4),
                h0=(2, 4, 16, 16))
  shapes.update(change)
  x = {name: jnp.zeros(s) for name, s in shapes.items()}
  with pytest.raises(ValueError, match=match):
    ssd(x["q"], x["k"], x["v"], x["g"], initial_state=x["h0"])


def test_kernel_limits_raise_for_pallas_only():
  q, k, v, g, _ = _inputs(1, 8, 2, 2, 16, 16, jnp.float32)
  with pytest.raises(ValueError, match="chunk_size"):
    ssd(q, k, v, g, chunk_size=24, implementation="pallas")
  ssd(q, k, v, g, chunk_size=24, implementation="xla")
  with pytest.raises(ValueError, match="implementation"):
    ssd(q, k, v, g, implementation="cuda")
  with pytest.raises(ValueError, match="chunk_size"):
    ssd(q, k, v, g, chunk_size=0)


@pytest.mark.parametrize("groups", [(3, 2), (2, 4), (5, 1)])
def test_chunk_groups_of_the_states_walk(monkeypatch, groups):
  """The states walk split into groups of chunks (summary, then apply from
  the fold of the groups before) equals the single walk, a partial last
  group included, forward and reverse."""
  from ops.ssd import pallas as ssd_pallas_lib
  q, k, v, g, h0 = _inputs(1, 5 * 16, 2, 2, 16, 16, jnp.float32)
  monkeypatch.setattr(ssd_pallas_lib, "_state_groups", lambda programs, chunks, target: (1, 5))
  single = jax.jit(functools.partial(ops.ssd, chunk_size=16, implementation="pallas"))
  want = single(q, k, v, g, initial_state=h0)
  want_grads = jax.grad(functools.partial(_loss, single), argnums=(0, 1, 2, 3, 4))(
      q, k, v, g, h0)
  monkeypatch.setattr(ssd_pallas_lib, "_state_groups", lambda programs, chunks, target: groups)
  split = jax.jit(functools.partial(ops.ssd, chunk_size=16, implementation="pallas"))
  got = split(q, k, v, g, initial_state=h0)
  got_grads = jax.grad(functools.partial(_loss, split), argnums=(0, 1, 2, 3, 4))(
      q, k, v, g, h0)
  for a, b in zip(got + got_grads, want + want_grads):
    assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("heads, groups", [(2, 2), (4, 2)])
def test_chunk_gradients_by_key_and_value_tiles(heads, groups):
  """The keys' and values' chunk-gradient kernels with several K and V tiles
  per chunk (their d log_decay shares summed) match the reference."""
  from ops.ssd import configs as ssd_configs
  from ops.ssd import pallas as ssd_pallas_lib
  blocks = ssd_configs.TritonConfig(chunk=16, grad_block_k=16, grad_block_v=16)
  fn = functools.partial(ssd_pallas_lib.ssd_pallas, blocks=blocks)
  q, k, v, g, h0 = _inputs(1, 40, heads, groups, 48, 32, jnp.float32)  # K pads to 64
  grads = jax.jit(jax.grad(functools.partial(_loss, fn), argnums=(0, 1, 2, 3, 4)))(
      q, k, v, g, h0)
  want = jax.grad(functools.partial(_loss, ssd_reference), argnums=(0, 1, 2, 3, 4))(
      q, k, v, g, h0)
  for name, a, b in zip(("q", "k", "v", "log_decay", "initial_state"), grads, want):
    assert a.shape == b.shape, name
    assert _rel(a, b) < 1e-4, name
