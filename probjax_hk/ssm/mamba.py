"""The Mamba (Mamba-1) block as an SSM cell.

Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces", https://arxiv.org/abs/2312.00752:

    x, z = in_proj(u)                                   # [B, T, E] each, E = expand H
    x = silu(causal_depthwise_conv(x))                  # width `conv_width`
    dt_low, B, C = x_proj(x)                            # [dt_rank], [S], [S]
    delta = softplus(dt_proj(dt_low) + dt_bias)         # [B, T, E]
    y = selective_scan(x, delta, A, B, C, D, z)         # A = -exp(A_log): [E, S]
    out = out_proj(y)                                   # [B, T, H]

Glossary of shapes: B batch, T time, H model width, E inner width,
S state size, W conv width, R dt rank.
"""

import math

import haiku as hk
import jax
import jax.numpy as jnp

import ops
from ops import registry
from ops.selective_scan import IMPLEMENTATIONS as SELECTIVE_SCAN_IMPLEMENTATIONS
from probjax_hk import arguments
from probjax_hk.layers import Linear
from probjax_hk.ssm.arguments import check_step
from probjax_hk.ssm.arguments import past_the_end
from probjax_hk.ssm.base import SSMCell
from probjax_hk.ssm.causal_conv import causal_conv
from probjax_hk.ssm.causal_conv import causal_conv_step
from probjax_hk.ssm.causal_conv import conv_params


class MambaCell(SSMCell):
  """The Mamba block: `[B, T, H] -> [B, T, H]`, or one step at a time.

  The decode state is `(conv_state [B, W - 1, E], ssm_state [B, E, S] f32)`.
  """

  _sequence_takes_reverse = True  # `ops.selective_scan` runs backwards itself

  def __init__(self, state_dim: int | None = None, *, model_dim: int | None = None,
               expand: int = 2, conv_width: int = 4, dt_rank: int | str = "auto",
               dt_min: float = 0.001, dt_max: float = 0.1,
               implementation: registry.Choice = None,
               name: str | None = None):
    """Constructs the cell.

    Args:
      state_dim: S, the state size per channel; defaults to `model_dim`.
      model_dim: H (SSMModel passes it; inferred from the input otherwise,
        but `initial_state` needs it).
      expand: E / H, an integer >= 1.
      conv_width: W, the causal depthwise convolution's width (>= 1).
      dt_rank: R, the rank of the delta projection; 'auto' is ceil(H / 16).
      dt_min, dt_max: the range of the initial step sizes (log-uniform).
      implementation: `ops.selective_scan`'s backend for the sequence path.
      name: module name.

    Raises:
      TypeError: a size that is not an integer (`dt_rank`: nor 'auto') or a
        step size that is not a number.
      ValueError: a size below 1, step sizes outside
        `0 < dt_min <= dt_max`, or an unknown `implementation`.
    """
    super().__init__(model_dim=model_dim, name=name)
    arguments.check_positive_ints_or_none(state_dim=state_dim)
    arguments.check_positive_ints(expand=expand, conv_width=conv_width)
    if dt_rank != "auto":
      arguments.check_positive_ints(dt_rank=dt_rank)
    arguments.check_positive_numbers(dt_min=dt_min, dt_max=dt_max)
    SELECTIVE_SCAN_IMPLEMENTATIONS.check(implementation)
    if not 0 < dt_min <= dt_max:
      raise ValueError(f"`dt_min`/`dt_max` must satisfy 0 < dt_min <= dt_max, "
                       f"got {dt_min=} {dt_max=}")
    self.state_dim = state_dim
    self.expand = expand
    self.conv_width = conv_width
    self.dt_rank = dt_rank
    self.dt_min, self.dt_max = dt_min, dt_max
    self.implementation = implementation

  def _dims(self, model_dim: int | None = None):
    model_dim = model_dim or self.model_dim
    if model_dim is None:
      raise ValueError("MambaCell needs `model_dim` to build its state")
    inner = self.expand * model_dim
    state = self.state_dim or model_dim
    rank = math.ceil(model_dim / 16) if self.dt_rank == "auto" else self.dt_rank
    return model_dim, inner, state, rank

  def _dt_bias_init(self, shape, dtype):
    u = jax.random.uniform(hk.next_rng_key(), shape, dtype)
    dt = jnp.exp(u * (math.log(self.dt_max) - math.log(self.dt_min))
                 + math.log(self.dt_min))
    dt = jnp.maximum(dt, 1e-4)
    return dt + jnp.log(-jnp.expm1(-dt))  # inverse softplus

  @hk.transparent
  def _ssm_params(self, inner, state):
    a_log = hk.get_parameter(
        "A_log", [inner, state], jnp.float32,
        init=lambda s, d: jnp.log(jnp.broadcast_to(jnp.arange(1, state + 1, dtype=d), s)))
    d = hk.get_parameter("D", [inner], jnp.float32, init=jnp.ones)
    dt_bias = hk.get_parameter("dt_bias", [inner], jnp.float32, init=self._dt_bias_init)
    return -jnp.exp(a_log), d, dt_bias

  @hk.transparent
  def _project(self, x, state, rank):
    """x [..., E] -> (delta before bias [..., E], B [..., S], C [..., S])."""
    x_dbl = Linear(rank + 2 * state, with_bias=False, name="x_proj")(x)
    dt_low, b, c = jnp.split(x_dbl, [rank, rank + state], axis=-1)
    delta = Linear(x.shape[-1], with_bias=False, name="dt_proj")(dt_low)
    return delta, b, c

  @hk.transparent
  def _sequence(self, x, state=None, valid=None, *, reverse=False):
    """x [B, T, H], state or None, valid [B, T] or None -> (y [B, T, H], final
    state); `reverse` returns no conv state."""
    conv_state, ssm_state = (None, None) if state is None else state
    h, inner, state_dim, rank = self._dims(x.shape[-1])
    xz = Linear(2 * inner, with_bias=False, name="in_proj")(x)           # [B, T, 2E]
    xi, z = jnp.split(xz, 2, axis=-1)
    w, b = conv_params(self.conv_width, inner)
    if reverse:  # Reversed time mirrors the window: the causal conv of the flipped input.
      conv = causal_conv(xi[:, ::-1], w, b)[0][:, ::-1]
    else:
      conv, conv_state = causal_conv(xi, w, b, conv_state, valid)
    xc = jax.nn.silu(conv)                                               # [B, T, E]
    delta, bm, cm = self._project(xc, state_dim, rank)
    a, d, dt_bias = self._ssm_params(inner, state_dim)
    softplus = True
    if valid is not None:  # A step size of 0 past a sequence's end: decay 1, input 0.
      delta = jax.nn.softplus(delta.astype(jnp.float32) + dt_bias)
      delta, dt_bias, softplus = past_the_end(valid, delta, 0).astype(xc.dtype), None, False
    y, ssm_state = ops.selective_scan(xc, delta, a, bm, cm, D=d, z=z, delta_bias=dt_bias,
                                      delta_softplus=softplus, initial_state=ssm_state,
                                      reverse=reverse, implementation=self.implementation)
    return Linear(h, with_bias=False, name="out_proj")(y), (conv_state, ssm_state)

  def _state_shapes(self, batch_size: int, model_dim: int | None = None):
    _, inner, state, _ = self._dims(model_dim)
    return (jax.ShapeDtypeStruct((batch_size, self.conv_width - 1, inner), jnp.float32),
            jax.ShapeDtypeStruct((batch_size, inner, state), jnp.float32))

  @hk.name_like("__call__")
  def step(self, x_t: jax.Array, state):
    """One step: x_t [B, H] -> (y_t [B, H], state)."""
    check_step("x_t", x_t, state, self._state_shapes)
    conv_state, ssm_state = state
    h, inner, state_dim, rank = self._dims(x_t.shape[-1])
    xz = Linear(2 * inner, with_bias=False, name="in_proj")(x_t)         # [B, 2E]
    xi, z = jnp.split(xz, 2, axis=-1)
    w, b = conv_params(self.conv_width, inner)
    conv, conv_state = causal_conv_step(xi, conv_state, w, b)
    xc = jax.nn.silu(conv)                                               # [B, E]
    delta, bm, cm = self._project(xc, state_dim, rank)
    a, d, dt_bias = self._ssm_params(inner, state_dim)
    y, ssm_state = ops.selective_scan_step(ssm_state, xc, delta, a, bm, cm, D=d, z=z,
                                           delta_bias=dt_bias, delta_softplus=True)
    out = Linear(h, with_bias=False, name="out_proj")(y)
    return out, (conv_state, ssm_state)
