"""ops.selective_scan against the contract of mamba_ssm's `selective_scan_fn`.

The argument grid of mamba_ssm's own selective-scan test, in this library's
layout (time on axis 1): input dtypes float32 / float16 / bfloat16; `B` and
`C` per step ([B, T, S]), per group ([B, T, G, S]) or time-invariant
([D, S], float32 weights); the skip `D`, the gate `z`, `delta_bias` and
softplus; and the final state returned or not (`return_last_state`). Its
inputs: batch 2, 4 channels, state size 8, `A = -0.5 U[0, 1)`, `delta = 0.5
U[0, 1)`, `delta_bias = 0.5 U[0, 1)`, normal `u`, `z`, `D`, `B`, `C`. Every
implementation is held to the peer's tolerances against the step reference:
the output and the final state, and the gradients of every input for a
random cotangent (the test's tolerance per gradient).

Beyond the peer: `B` and `C` of different forms or group counts, and
`reverse`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.selective_scan import selective_scan
from ops.selective_scan import selective_scan_reference

_BATCH, _WIDTH, _STATE = 2, 4, 8
_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")

# (rtol, atol) of the output and final state per input dtype (mamba_ssm's).
_TOL = {"float32": (6e-4, 2e-3), "float16": (3e-3, 5e-3), "bfloat16": (3e-2, 5e-2)}

# (dtype, T, B form, C form, D, z, delta_bias and softplus, final state,
# reverse). A form: 'step' [B, T, S], 'fixed' [D, S], or the group count G of
# [B, T, G, S]. Each value of each of the peer's axes once at least; T 33 and
# 47 are not multiples of the kernel's chunk (padded and masked). The last
# two rows go beyond the peer: B and C of different forms or group counts,
# and the scan reversed.
_ROWS = [
    ("float32", 128, "step", "step", True, True, True, True, False),
    ("float16", 64, 2, 2, True, True, True, False, False),
    ("float32", 33, "fixed", "fixed", False, False, False, False, False),
    ("bfloat16", 33, 2, "fixed", True, True, True, True, False),
    ("float32", 47, 4, 2, False, True, True, True, True),
]


def _inputs(row):
  dtype, time, b_form, c_form, has_d, has_z, has_bias = row[:7]
  ks = jax.random.split(jax.random.key(0), 9)
  f32 = jnp.float32

  def projection(form, key):
    if form == "fixed":  # weights: float32 whatever the input dtype
      return jax.random.normal(key, (_WIDTH, _STATE), f32)
    groups = () if form == "step" else (form,)
    return jax.random.normal(key, (_BATCH, time, *groups, _STATE)).astype(dtype)

  seq = (_BATCH, time, _WIDTH)
  return dict(
      u=jax.random.normal(ks[0], seq).astype(dtype),
      delta=(0.5 * jax.random.uniform(ks[1], seq)).astype(dtype),
      A=-0.5 * jax.random.uniform(ks[2], (_WIDTH, _STATE), f32),
      B=projection(b_form, ks[3]), C=projection(c_form, ks[4]),
      D=jax.random.normal(ks[5], (_WIDTH,), f32) if has_d else None,
      z=jax.random.normal(ks[6], seq).astype(dtype) if has_z else None,
      delta_bias=0.5 * jax.random.uniform(ks[7], (_WIDTH,), f32) if has_bias else None)


def _run(row, implementation):
  """Outputs and input gradients, for a random cotangent of y (and of the
  final state when it is returned)."""
  final, reverse = row[7:]
  args = _inputs(row)
  names = tuple(n for n in _NAMES if args[n] is not None)

  def fn(*xs):
    kw = dict(zip(names, xs))
    scan_args = [kw.pop(n) for n in ("u", "delta", "A", "B", "C")]
    options = dict(kw, delta_softplus=row[6], return_final_state=final, reverse=reverse)
    if implementation == "reference":
      return selective_scan_reference(*scan_args, **options)
    return selective_scan(*scan_args, implementation=implementation, **options)

  ks = jax.random.split(jax.random.key(1), 2)
  dy = jax.random.normal(ks[0], args["u"].shape).astype(args["u"].dtype)
  dstate = jax.random.normal(ks[1], (_BATCH, _WIDTH, _STATE)) if final else None

  @jax.jit
  def forward_and_grads(xs, cotangents):
    (y, state), vjp = jax.vjp(fn, *xs)
    return y, state, dict(zip(names, vjp(cotangents)))

  return forward_and_grads(tuple(args[n] for n in names), (dy, dstate))


@functools.lru_cache(maxsize=None)
def _reference(row):
  return _run(row, "reference")


def _close(name, x, ref, rtol, atol):
  assert x.dtype == ref.dtype and x.shape == ref.shape, name
  np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(ref, np.float32),
                             rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("row", _ROWS, ids=lambda row: "-".join(map(str, row)))
def test_matches_the_peer_contract(row, implementation):
  y, state, grads = _run(row, implementation)
  y_ref, state_ref, grads_ref = _reference(row)
  rtol, atol = _TOL[row[0]]
  _close("y", y, y_ref, rtol, atol)
  if row[7]:
    _close("final_state", state, state_ref, rtol, atol)
  else:
    assert state is None and state_ref is None
  # The peer's gradient tolerances: weights at (1e-3, 1e-3), raised to the
  # output's where z gates the output; per-step B and C at the output's.
  weight = (max(1e-3, rtol), max(1e-3, atol)) if row[5] else (1e-3, 1e-3)
  tol = dict(u=(2 * rtol, 2 * atol), delta=(5 * rtol, 10 * atol),
             A=(weight[0], 5 * weight[1]), D=weight, z=weight, delta_bias=weight)
  for name in ("B", "C"):
    tol[name] = weight if grads[name].ndim == 2 else (rtol, atol)
  assert grads.keys() == grads_ref.keys()
  for name, grad in grads.items():
    _close(f"d{name}", grad, grads_ref[name], *tol[name])
