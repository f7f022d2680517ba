"""The Linear Recurrent Unit (LRU) cell.

Orvieto et al. 2023, "Resurrecting Recurrent Neural Networks for Long
Sequences", https://arxiv.org/abs/2303.06349:

    lambda = exp(-exp(nu_log) + i exp(theta_log))          # [N], |lambda| < 1
    h_t = lambda * h_{t-1} + gamma * (B x_t)                 # [B, N] complex
    y_t = Re(C h_t) + D * x_t                                # [B, H]

with the exponential parameterization of `lambda`, the normalization
`gamma = sqrt(1 - |lambda|^2)` and the ring initialization (|lambda| uniform
on the ring r_min <= |lambda| <= r_max, phase uniform in [0, max_phase]).

Glossary of shapes: B batch, T time, H model width, N state size.
"""

import math

import haiku as hk
import jax
import jax.numpy as jnp

import ops
from ops import registry
from ops.linear_scan import IMPLEMENTATIONS as LINEAR_SCAN_IMPLEMENTATIONS
from probjax_hk import arguments
from probjax_hk.ssm.arguments import check_step
from probjax_hk.ssm.arguments import past_the_end
from probjax_hk.ssm.base import SSMCell


def _ring_nu_log(r_min: float, r_max: float):
  def init(shape, dtype):
    u = jax.random.uniform(hk.next_rng_key(), shape, dtype)
    return jnp.log(-0.5 * jnp.log(u * (r_max ** 2 - r_min ** 2) + r_min ** 2))
  return init


def _phase_log(max_phase: float):
  def init(shape, dtype):
    u = jax.random.uniform(hk.next_rng_key(), shape, dtype, minval=1e-6)
    return jnp.log(max_phase * u)
  return init


class LRUCell(SSMCell):
  """The LRU as an SSM cell: `[B, T, H] -> [B, T, H]`, or one step at a time.

  The decode state is `[B, N]` complex64.
  """

  _sequence_takes_reverse = True  # `ops.linear_scan` runs backwards itself

  def __init__(self, state_dim: int | None = None, *, model_dim: int | None = None,
               r_min: float = 0.0, r_max: float = 1.0, max_phase: float = 2 * math.pi,
               implementation: registry.Choice = None,
               name: str | None = None):
    """Constructs the cell.

    Args:
      state_dim: N, the complex state size; defaults to `model_dim`.
      model_dim: H, the input/output width (SSMModel passes it; inferred from
        the input otherwise, but `initial_state` needs it).
      r_min, r_max: the ring of `|lambda|` at initialization,
        `0 <= r_min < r_max <= 1`.
      max_phase: the largest initial phase of lambda.
      implementation: `ops.linear_scan`'s backend for the sequence path.
      name: module name.

    Raises:
      TypeError: a size that is not an integer or a radius or phase that is
        not a number.
      ValueError: a size below 1, radii outside `0 <= r_min < r_max <= 1`, a
        `max_phase` that is not positive, or an unknown `implementation`.
    """
    super().__init__(model_dim=model_dim, name=name)
    arguments.check_positive_ints_or_none(state_dim=state_dim)
    arguments.check_nonnegative_numbers(r_min=r_min, r_max=r_max)
    arguments.check_positive_numbers(max_phase=max_phase)
    LINEAR_SCAN_IMPLEMENTATIONS.check(implementation)
    if not 0.0 <= r_min < r_max <= 1.0:
      raise ValueError(f"`r_min`/`r_max` must satisfy 0 <= r_min < r_max <= 1, "
                       f"got {r_min=} {r_max=}")
    self.state_dim = state_dim
    self.r_min, self.r_max, self.max_phase = r_min, r_max, max_phase
    self.implementation = implementation

  def _dims(self, model_dim: int | None = None) -> tuple[int, int]:
    model_dim = model_dim or self.model_dim
    if model_dim is None:
      raise ValueError("LRUCell needs `model_dim` to build its state")
    return model_dim, self.state_dim or model_dim

  @hk.transparent
  def _params(self, model_dim: int):
    h, n = self._dims(model_dim)
    f32 = jnp.float32
    nu_log = hk.get_parameter("nu_log", [n], f32, init=_ring_nu_log(self.r_min, self.r_max))
    theta_log = hk.get_parameter("theta_log", [n], f32, init=_phase_log(self.max_phase))
    lam = jnp.exp(-jnp.exp(nu_log) + 1j * jnp.exp(theta_log))           # [N]
    gamma_log = hk.get_parameter(
        "gamma_log", [n], f32,
        init=lambda *_: jnp.log(jnp.sqrt(1 - jnp.abs(lam) ** 2)))
    b_init = hk.initializers.RandomNormal(1.0 / math.sqrt(2 * h))
    c_init = hk.initializers.RandomNormal(1.0 / math.sqrt(n))
    b = (hk.get_parameter("B_re", [h, n], f32, init=b_init)
         + 1j * hk.get_parameter("B_im", [h, n], f32, init=b_init))      # [H, N]
    c = (hk.get_parameter("C_re", [n, h], f32, init=c_init)
         + 1j * hk.get_parameter("C_im", [n, h], f32, init=c_init))      # [N, H]
    d = hk.get_parameter("D", [h], f32, init=hk.initializers.RandomNormal())
    return lam, b * jnp.exp(gamma_log), c, d

  @hk.transparent
  def _sequence(self, x, state=None, valid=None, *, reverse=False):
    """x [B, T, H], state [B, N] or None, valid [B, T] or None -> (y [B, T, H],
    final state [B, N])."""
    lam, b, c, d = self._params(x.shape[-1])
    xf = x.astype(jnp.float32)
    # Real products on the real and imaginary parts: a real input times a
    # complex matrix needs two real matmuls, not a complex one, and the
    # kernel's split of `bu` into planes (and its merge of `h`) then cancels
    # against `lax.complex` and `.real`/`.imag` in XLA instead of copying.
    bu = jax.lax.complex(xf @ b.real, xf @ b.imag)                     # [B, T, N]
    if valid is not None:  # Past a sequence's end: decay 1, input 0.
      lam = past_the_end(valid, jnp.broadcast_to(lam, bu.shape), 1)
      bu = past_the_end(valid, bu, 0)
    # lam [N] is the same at every step: the kernel reads it once per program.
    h, state = ops.linear_scan(lam, bu, initial_state=state, reverse=reverse,
                               implementation=self.implementation)
    y = h.real @ c.real - h.imag @ c.imag + d * xf                      # Re(h c), [B, T, H]
    return y.astype(x.dtype), state

  def _state_shapes(self, batch_size: int, model_dim: int | None = None):
    return jax.ShapeDtypeStruct((batch_size, self._dims(model_dim)[1]), jnp.complex64)

  @hk.name_like("__call__")
  def step(self, x_t: jax.Array, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One step: x_t [B, H], state [B, N] -> (y_t [B, H], state)."""
    check_step("x_t", x_t, state, self._state_shapes)
    lam, b, c, d = self._params(x_t.shape[-1])
    xf = x_t.astype(jnp.float32)
    state = lam * state + xf.astype(jnp.complex64) @ b                  # [B, N]
    y = (state @ c).real + d * xf
    return y.astype(x_t.dtype), state
