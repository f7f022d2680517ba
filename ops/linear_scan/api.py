"""`linear_scan`: the diagonal linear recurrence `h_t = a_t * h_{t-1} + b_t`.

The core of the Linear Recurrent Unit (Orvieto et al. 2023,
https://arxiv.org/abs/2303.06349) and of every diagonal SSM in recurrent form.

Glossary of shapes: B batch, T time, D channels.
"""

import jax
import jax.numpy as jnp

from ops import _sequence_parallel
from ops import _shapes
from ops import _sharding
from ops import registry
from ops.linear_scan import configs
from ops.linear_scan import pallas as pallas_impl
from ops.linear_scan import sequence_parallel
from ops.linear_scan.xla import linear_scan_xla

_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64)
_VALID_DTYPES = _KERNEL_DTYPES + (jnp.float64, jnp.complex128)


def _validate(a, b, initial_state, reverse):
  _shapes.check_arrays(None, (("a", a), ("b", b), ("initial_state", initial_state)))
  if b.ndim != 3:
    raise ValueError(f"`b` must be [B, T, D], got shape {b.shape}")
  _shapes.check_time(None, "b", b.shape)
  if a.shape != b.shape and a.shape != b.shape[2:]:
    raise ValueError(f"`a` must be [B, T, D] = {b.shape} like `b`, or [D] = "
                     f"{b.shape[2:]} (the same decay at every step), got {a.shape}")
  for name, x in (("a", a), ("b", b)):
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in _VALID_DTYPES]:
      raise ValueError(f"`{name}` must be a float or complex array, got {x.dtype}")
  if initial_state is not None and initial_state.shape != (b.shape[0], b.shape[2]):
    raise ValueError(f"`initial_state` must be [B, D] = {(b.shape[0], b.shape[2])}, "
                     f"got {initial_state.shape}")
  _shapes.check_inexact(None, (("initial_state", initial_state),))
  _shapes.check_bool(None, "reverse", reverse)


def linear_scan(a: jax.Array, b: jax.Array, *,
                initial_state: jax.Array | None = None, reverse: bool = False,
                implementation: registry.Choice = None
                ) -> tuple[jax.Array, jax.Array]:
  """`h_t = a_t * h_{t-1} + b_t` over axis 1.

  On a mesh, the time axis may be split over Explicit mesh axes (with the
  batch and channels): each device scans its own chunk, and only the chunks'
  final states and total decays cross devices
  (`ops/linear_scan/sequence_parallel.py`).

  Args:
    a: [B, T, D] decay; float32, bfloat16 or complex64 (float64/complex128 on
      the XLA path only). Or [D]: the same decay at every step and batch row
      (the LRU's), which the kernel reads once per program instead of per
      step.
    b: [B, T, D] input, same shape.
    initial_state: [B, D], the state before the first step processed (zeros
      when None).
    reverse: run from the last time step to the first.
    implementation: None (on NVIDIA GPUs the faster of the Triton kernel and
      XLA where measured, `ops/dispatch_tables/linear_scan.json`; XLA
      elsewhere), 'triton' (the kernel; interpret mode off GPU; 'pallas' is
      its alias), 'xla' (`lax.associative_scan`), or a sequence of these tried
      in order (`ops.registry`).

  Returns:
    h: [B, T, D] in the result dtype of `a` and `b` (accumulated in float32 or
      complex64).
    final_state: [B, D], the state after the last step processed.
  """
  _validate(a, b, initial_state, reverse)
  call = dict(a=a, b=b, initial_state=initial_state, reverse=reverse)
  split = sequence_parallel.plan(a, b, initial_state)
  chosen = IMPLEMENTATIONS.choose(implementation, call,
                                  length=b.shape[1] // split.size("seq"))
  if _sequence_parallel.time_axes(split):
    return sequence_parallel.linear_scan_split(chosen.run, split, reverse=reverse)
  return chosen.run(**call)


def _xla(**call):
  return linear_scan_xla(**call)


def _triton(a, b, initial_state, reverse):
  token = ("batch", "seq", "channels")
  plan = _sharding.plan("linear_scan", (
      ("a", a, token if a.ndim == 3 else ("channels",)), ("b", b, token),
      ("initial_state", initial_state, ("batch", "channels"))),
      split=("batch", "channels"))
  return plan.run(lambda a, b, h0: pallas_impl.linear_scan_pallas(
      a, b, initial_state=h0, reverse=reverse), [token, ("batch", "channels")])


def _triton_supports(call) -> str | None:
  dtype = jnp.dtype(jnp.result_type(call["a"], call["b"]))
  if dtype not in [jnp.dtype(d) for d in _KERNEL_DTYPES]:
    return f"`a`/`b` dtype {dtype} is not one of float32, bfloat16, float16, complex64"
  return None


# The measured table decides the default (ops/dispatch_tables/linear_scan.json,
# where the kernel is timed as 'pallas').
IMPLEMENTATIONS = registry.Registry("linear_scan", table="linear_scan")
IMPLEMENTATIONS.register("xla", _xla)
IMPLEMENTATIONS.register("triton", _triton, supports=_triton_supports, kernel=True,
                         config=configs.TritonConfig, measured_as="pallas")
IMPLEMENTATIONS.alias("pallas", ("triton",))
