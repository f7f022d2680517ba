"""`selective_scan`: the Mamba-1 (S6) selective state-space recurrence.

Gu & Dao 2023, https://arxiv.org/abs/2312.00752. Time is on axis 1.

Glossary of shapes: B batch, T time, D channels, S state size.
"""

import jax
import jax.numpy as jnp

from ops import _shapes
from ops import _sharding
from ops import registry
from ops.selective_scan import configs
from ops.selective_scan import pallas as pallas_impl
from ops.selective_scan import sequence_parallel
from ops.selective_scan.xla import selective_scan_xla

_KERNEL_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
_TOKEN = ("batch", "seq", "channels")  # u, delta, z, y [B, T, D]
_STATE = ("batch", "channels", None)  # initial_state, final_state [B, D, S]


def _validate(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus,
              reverse, return_final_state):
  named = (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C), ("D", D),
           ("z", z), ("delta_bias", delta_bias), ("initial_state", initial_state))
  _shapes.check_arrays(None, named)
  if u.ndim != 3:
    raise ValueError(f"`u` must be [B, T, D], got shape {u.shape}")
  _shapes.check_time(None, "u", u.shape)
  batch, time, width = u.shape
  if delta.shape != u.shape:
    raise ValueError(f"`delta` must have the shape of `u` {u.shape}, got {delta.shape}")
  if A.ndim != 2 or A.shape[0] != width:
    raise ValueError(f"`A` must be [D, S] with D = {width}, got shape {A.shape}")
  state = A.shape[1]
  for name, x in (("B", B), ("C", C)):
    per_step = x.ndim in (3, 4) and x.shape[:2] == (batch, time)
    if not (per_step or x.ndim == 2 and x.shape[0] == width) or x.shape[-1] != state:
      raise ValueError(f"`{name}` must be [B, T, S] = {(batch, time, state)}, per "
                       f"group [B, T, G, S] or time-invariant [D, S] = "
                       f"{(width, state)}, got {x.shape} (T must match `u`)")
    if x.ndim == 4 and (x.shape[2] == 0 or width % x.shape[2]):
      raise ValueError(f"`{name}`: the group count G = {x.shape[2]} must divide "
                       f"D = {width}")
  for name, x in (("D", D), ("delta_bias", delta_bias)):
    if x is not None and x.shape != (width,):
      raise ValueError(f"`{name}` must be [D] = ({width},), got {x.shape}")
  if z is not None and z.shape != u.shape:
    raise ValueError(f"`z` must have the shape of `u` {u.shape}, got {z.shape}")
  if initial_state is not None and initial_state.shape != (batch, width, state):
    raise ValueError(f"`initial_state` must be [B, D, S] = {(batch, width, state)}, "
                     f"got {initial_state.shape}")
  _shapes.check_inexact(None, named)
  _shapes.check_bool(None, "delta_softplus", delta_softplus)
  _shapes.check_bool(None, "reverse", reverse)
  _shapes.check_bool(None, "return_final_state", return_final_state)


def _projection_layout(x):
  """Sharding labels of a projection: time-invariant [D, S] splits with the
  channels like `A`; a shared [B, T, S] is replicated over them; per-group
  [B, T, G, S] splits its groups with their channels."""
  return {2: ("channels", None), 3: ("batch", "seq", None),
          4: ("batch", "seq", "channels", None)}[x.ndim]


def _named_arrays(u, delta, A, B, C, D, z, delta_bias, initial_state):
  """(name, array or None, sharding layout) of each array argument, in order."""
  return (("u", u, _TOKEN), ("delta", delta, _TOKEN), ("A", A, ("channels", None)),
          ("B", B, _projection_layout(B)), ("C", C, _projection_layout(C)),
          ("D", D, ("channels",)), ("z", z, _TOKEN),
          ("delta_bias", delta_bias, ("channels",)),
          ("initial_state", initial_state, _STATE))


def selective_scan(u: jax.Array, delta: jax.Array, A: jax.Array, B: jax.Array,
                   C: jax.Array, *, D: jax.Array | None = None,
                   z: jax.Array | None = None, delta_bias: jax.Array | None = None,
                   delta_softplus: bool = False,
                   initial_state: jax.Array | None = None, reverse: bool = False,
                   return_final_state: bool = True,
                   implementation: registry.Choice = None
                   ) -> tuple[jax.Array, jax.Array | None]:
  """Mamba's selective scan over time (axis 1)::

      delta = softplus(delta + delta_bias)           (each part optional)
      h_t = exp(delta_t A) h_{t-1} + delta_t u_t B_t  # [B, D, S]
      y_t = h_t C_t + D u_t;  y_t *= silu(z_t)

  On a mesh, the time axis may be split over Explicit mesh axes (with the
  batch and channels): each device scans its own chunk, and only the chunks'
  final states and summed step sizes cross devices
  (`ops/selective_scan/sequence_parallel.py`).

  Args:
    u: [B, T, D] input (float32, bfloat16 or float16).
    delta: [B, T, D] step sizes.
    A: [D, S] state matrix (negative entries decay).
    B: [B, T, S] input projection, per group [B, T, G, S] (G divides D;
      channel d uses group d // (D / G)), or time-invariant [D, S] (one
      projection per channel, the same at every step and batch row).
    C: [B, T, S] output projection, per group [B, T, G', S] or
      time-invariant [D, S]; its form and group count are independent of
      `B`'s.
    D: [D] skip connection, or None.
    z: [B, T, D] gate, or None.
    delta_bias: [D] added to `delta`, or None.
    delta_softplus: apply softplus to the biased `delta`.
    initial_state: [B, D, S], the state before the first step processed.
    reverse: scan from the last time step to the first (bidirectional models).
    return_final_state: False returns None in place of the final state,
      which the kernel then neither writes nor differentiates through (the
      form of mamba_ssm's `return_last_state=False`).
    implementation: None (on NVIDIA GPUs the faster of the Triton kernel and
      XLA where measured, `ops/dispatch_tables/selective_scan.json`; XLA
      elsewhere), 'triton' (the kernel; interpret mode off GPU; 'pallas' is
      its alias), 'xla' (`lax.associative_scan`, materializes [B, T, D, S]),
      or a sequence of these tried in order (`ops.registry`).

  Returns:
    y: [B, T, D] in `u`'s dtype (accumulated in float32).
    final_state: [B, D, S] float32, the state after the last step processed;
      None when `return_final_state` is False.
  """
  _validate(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus,
            reverse, return_final_state)
  call = dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias,
              delta_softplus=delta_softplus, initial_state=initial_state,
              reverse=reverse, return_final_state=return_final_state)
  split = sequence_parallel.plan(
      _named_arrays(u, delta, A, B, C, D, z, delta_bias, initial_state))
  chosen = IMPLEMENTATIONS.choose(implementation, call, state=A.shape[-1],
                                  length=u.shape[1] // (split.size("seq") if split else 1))
  if split is not None:
    return sequence_parallel.selective_scan_split(
        chosen.run, split, delta_softplus=delta_softplus, reverse=reverse,
        return_final_state=return_final_state)
  return chosen.run(**call)


def _xla(**call):
  return selective_scan_xla(**call)


def _triton(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, reverse,
            return_final_state):
  def kernel_path(u, delta, A, B, C, D, z, delta_bias, initial_state):
    y, final = pallas_impl.selective_scan_pallas(
        u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
        delta_softplus=delta_softplus, initial_state=initial_state, reverse=reverse,
        return_final_state=return_final_state)
    return (y, final) if return_final_state else y

  # Per shard: batch, and channels under Explicit axes.
  plan = _sharding.plan("selective_scan", _named_arrays(
      u, delta, A, B, C, D, z, delta_bias, initial_state), split=("batch", "channels"))
  if not return_final_state:
    return plan.run(kernel_path, _TOKEN), None
  return plan.run(kernel_path, [_TOKEN, _STATE])


def _triton_supports(call) -> str | None:
  for name in ("u", "delta", "B", "C"):
    dtype = jnp.dtype(call[name].dtype)
    if dtype not in _KERNEL_DTYPES:
      return f"`{name}` dtype {dtype} is not one of float32, bfloat16, float16"
  return None


# The measured table decides the default (ops/dispatch_tables/selective_scan.json,
# where the kernel is timed as 'pallas').
IMPLEMENTATIONS = registry.xla_and_triton(
    "selective_scan", xla=_xla, triton=_triton, supports=_triton_supports,
    config=configs.TritonConfig)
