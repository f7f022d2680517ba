"""ops.linear_scan: the associative XLA tier and the Pallas kernel (interpret
mode on CPU) against the step-by-step reference: outputs, final states and
gradients, real and complex, forward and reverse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import tolerances
from ops import _backend
from ops.linear_scan import configs
from ops.linear_scan import linear_scan
from ops.linear_scan import linear_scan_pallas
from ops.linear_scan import linear_scan_reference
from tests.ops import test_measured

# Max error relative to max(1, max |reference|), per dtype: (forward, gradients).
_TOL = tolerances.LINEAR_SCAN


def _rel(x, ref):
  x, ref = np.asarray(x, np.complex64), np.asarray(ref, np.complex64)
  assert np.isfinite(x).all()
  return np.abs(x - ref).max() / max(1.0, np.abs(ref).max())


def _inputs(batch, time, width, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  a = jax.random.uniform(ks[0], (batch, time, width), minval=0.6, maxval=0.99)
  b = jax.random.normal(ks[1], (batch, time, width))
  h0 = jax.random.normal(ks[2], (batch, width))
  if dtype == "complex64":
    a = a * jnp.exp(1j * jax.random.uniform(ks[3], a.shape, maxval=3.0))
    b = b + 1j * jax.random.normal(ks[4], b.shape)
    h0 = h0 - 0.5j * h0
  return a.astype(dtype), b.astype(dtype), h0.astype(dtype)


def _loss(fn):
  """Linear in (h, final) with fixed weights, so cotangents are exact in bf16."""
  def loss(a, b, h0):
    h, final = fn(a, b, h0)
    wh = jnp.cos(jnp.arange(h.size, dtype=jnp.float32).reshape(h.shape))
    wf = jnp.sin(jnp.arange(final.size, dtype=jnp.float32).reshape(final.shape))
    return (jnp.sum(jnp.real(h).astype(jnp.float32) * wh)
            + jnp.sum(jnp.imag(h).astype(jnp.float32) * wf[:, None, :])
            + jnp.sum(jnp.real(final).astype(jnp.float32) * wf))
  return loss


def _impl(implementation, reverse, with_state, blocks=None):
  def fn(a, b, h0):
    h0 = h0 if with_state else None
    if implementation == "reference":
      return linear_scan_reference(a, b, initial_state=h0, reverse=reverse)
    if blocks is not None:
      return linear_scan_pallas(a, b, initial_state=h0, reverse=reverse, blocks=blocks)
    return linear_scan(a, b, initial_state=h0, reverse=reverse,
                       implementation=implementation)
  return fn


def _check(implementation, dtype, time, reverse, with_state, blocks=None,
           batch=2, width=12, const_decay=False):
  a, b, h0 = _inputs(batch, time, width, dtype)
  if const_decay:
    a = a[0, 0]  # [D]: the same decay at every step and batch row
  fn = _impl(implementation, reverse, with_state, blocks)
  ref = _impl("reference", reverse, with_state)
  fwd_tol, grad_tol = _TOL[dtype]
  (h, final), (h_ref, final_ref) = jax.jit(fn)(a, b, h0), jax.jit(ref)(a, b, h0)
  assert h.dtype == h_ref.dtype == jnp.dtype(dtype)
  assert h.shape == (batch, time, width) and final.shape == (batch, width)
  assert _rel(h, h_ref) < fwd_tol
  assert _rel(final, final_ref) < fwd_tol
  argnums = (0, 1, 2) if with_state else (0, 1)
  grads = jax.jit(jax.grad(_loss(fn), argnums=argnums))(a, b, h0)
  grads_ref = jax.jit(jax.grad(_loss(ref), argnums=argnums))(a, b, h0)
  for g, g_ref in zip(grads, grads_ref):
    assert g.dtype == g_ref.dtype
    assert _rel(g, g_ref) < grad_tol


# Small kernel tiles keep interpret mode fast; T 257 in chunks of 64 makes five
# chunks (the last padded), and D 12 pads to 16 channels. T 1 goes through
# `linear_scan`'s default tiling.
_SMALL = configs.TritonConfig(block_d=8, unroll=4, chunk=16, num_warps=1)
_CHUNKED = configs.TritonConfig(block_d=8, unroll=4, chunk=64, num_warps=1)

# (implementation, dtype, T, reverse, initial_state, blocks): T in {1, 7, 64, 257},
# both directions, each tier on real, complex and bf16 inputs.
_CASES = [
    ("xla", "float32", 7, False, True, None),
    ("xla", "complex64", 64, True, True, None),
    ("xla", "bfloat16", 64, False, False, None),
    ("pallas", "float32", 257, False, True, _CHUNKED),
    ("pallas", "complex64", 257, True, True, _CHUNKED),
    ("pallas", "float32", 64, True, False, _SMALL),
    ("pallas", "complex64", 7, True, True, _SMALL),
    ("pallas", "complex64", 1, False, True, None),
    ("pallas", "bfloat16", 64, False, True, _SMALL),
]


@pytest.mark.parametrize("implementation,dtype,time,reverse,with_state,blocks", _CASES)
def test_matches_reference(implementation, dtype, time, reverse, with_state, blocks):
  _check(implementation, dtype, time, reverse, with_state, blocks)


# A decay [D] shared by every step (the LRU's): the kernel reads it once per
# program and its backward sums da over batch and time.
@pytest.mark.parametrize("implementation,dtype,time,reverse,with_state,blocks", [
    ("xla", "complex64", 64, False, True, None),
    ("pallas", "complex64", 257, True, True, _CHUNKED),
    ("pallas", "complex64", 257, False, True, _CHUNKED),
    ("pallas", "float32", 64, False, False, _SMALL),
    ("pallas", "bfloat16", 7, True, True, _SMALL),
])
def test_decay_shared_by_every_step(implementation, dtype, time, reverse, with_state,
                                    blocks):
  _check(implementation, dtype, time, reverse, with_state, blocks, const_decay=True)


def test_reverse_is_flipped_forward():
  a, b, h0 = _inputs(2, 9, 4, "float32")
  h, final = linear_scan(a[:, ::-1], b[:, ::-1], initial_state=h0, implementation="xla")
  h_rev, final_rev = linear_scan(a, b, initial_state=h0, reverse=True,
                                 implementation="pallas")
  np.testing.assert_allclose(h_rev, h[:, ::-1], atol=1e-5)
  np.testing.assert_allclose(final_rev, final, atol=1e-5)


def _has_pallas_call(fn, *args):
  return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def test_default_backend_on_cpu_is_xla():
  a, b, _ = _inputs(1, 8, 4, "float32")
  assert jax.default_backend() == "cpu"
  assert not _has_pallas_call(lambda a, b: linear_scan(a, b), a, b)
  assert _has_pallas_call(lambda a, b: linear_scan(a, b, implementation="pallas"), a, b)



@pytest.mark.parametrize("winner", ["xla", "pallas", "unmeasured"])
def test_default_backend_on_gpu_follows_the_measured_table(monkeypatch, winner):
  # A per-step decay and a shared one [D] (the LRU's) both take the winner of
  # the measured, checked table on NVIDIA GPUs only, and XLA without one.
  ms = {"pallas": 2.0, "xla": 2.0, winner: 1.0}
  tables = {} if winner == "unmeasured" else {"linear_scan": test_measured.measured_table(
      [dict(length=8, ms=ms)], axes=("length",), kernels=("pallas",))}
  test_measured.fake_gpu(monkeypatch, tables)
  a, b, _ = _inputs(1, 8, 4, "float32")
  assert _has_pallas_call(lambda a, b: linear_scan(a, b), a, b) == (winner == "pallas")
  assert _has_pallas_call(lambda a, b: linear_scan(a, b), a[0, 0], b) == (winner == "pallas")
  monkeypatch.setattr(_backend, "on_nvidia_gpu", lambda: False)
  assert not _has_pallas_call(lambda a, b: linear_scan(a, b), a, b)
  assert not _has_pallas_call(lambda a, b: linear_scan(a, b), a[0, 0], b)


def test_jit_and_vmap():
  a, b, h0 = _inputs(3, 16, 4, "float32")
  fn = jax.jit(jax.vmap(lambda a, b, h0: linear_scan(
      a[None], b[None], initial_state=h0[None], implementation="pallas")[0][0]))
  ref = linear_scan_reference(a, b, initial_state=h0)[0]
  assert _rel(fn(a, b, h0), ref) < 1e-5


def test_bad_arguments_raise():
  a, b, h0 = _inputs(2, 8, 4, "float32")
  with pytest.raises(ValueError, match="`a`"):
    linear_scan(a[0], b)        # neither [B, T, D] nor [D]
  with pytest.raises(ValueError, match="`a`"):
    linear_scan(a[0, 0, :3], b)  # [D] of the wrong width
  with pytest.raises(ValueError, match="`b`"):
    linear_scan(a[0], b[0])
  with pytest.raises(ValueError, match="`b`"):
    linear_scan(a, b[:, :5])
  with pytest.raises(ValueError, match="`initial_state`"):
    linear_scan(a, b, initial_state=h0[:, :3])
  with pytest.raises(ValueError, match="`implementation`"):
    linear_scan(a, b, implementation="cuda")
  with pytest.raises(ValueError, match="`a`"):
    linear_scan(a.astype(jnp.int32), b)
  with pytest.raises(ValueError, match="chunk"):
    configs.TritonConfig(unroll=4, chunk=6)
