"""SSDCell: a multi-head SSD layer (the Mamba-2 core without its block).

Dao & Gu 2024, "Transformers are SSMs", https://arxiv.org/abs/2405.21060:

    x, B, C, dt = in_proj(u)                    # [N, P], [N, S], [N, S], [N]
    dt = softplus(dt + dt_bias);  A = -exp(A_log)              # per head
    y = ssd(q=C, k=B, v=dt x, log_decay=dt A) + D x            # ops.ssd
    out = out_proj(y)                                          # [B, T, H]

Glossary of shapes: B batch, T time, H model width, N heads, P head size,
S state size.
"""

import math

import haiku as hk
import jax
import jax.numpy as jnp

import ops
from ops import registry
from ops.ssd import IMPLEMENTATIONS as SSD_IMPLEMENTATIONS
from probjax_hk import arguments
from probjax_hk.layers import Linear
from probjax_hk.ssm.arguments import check_chunked_cell_args
from probjax_hk.ssm.arguments import check_step
from probjax_hk.ssm.arguments import past_the_end
from probjax_hk.ssm.base import SSMCell

_F32 = jnp.float32


def dt_bias_init(dt_min: float = 1e-3, dt_max: float = 0.1):
  """Initializer: softplus^-1 of step sizes log-uniform in [dt_min, dt_max]."""
  def init(shape, dtype):
    u = jax.random.uniform(hk.next_rng_key(), shape, dtype)
    dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = jnp.maximum(dt, 1e-4)
    return dt + jnp.log(-jnp.expm1(-dt))
  return init


def a_log_init(shape, dtype):
  """Initializer: log of decay rates uniform in [1, 16] (Mamba-2)."""
  return jnp.log(jax.random.uniform(hk.next_rng_key(), shape, dtype, 1.0, 16.0))


def decay_params(heads: int):
  """`A = -exp(A_log)` [N], `dt_bias` [N] and the skip `D` [N], float32."""
  a_log = hk.get_parameter("A_log", [heads], _F32, init=a_log_init)
  dt_bias = hk.get_parameter("dt_bias", [heads], _F32, init=dt_bias_init())
  d = hk.get_parameter("D", [heads], _F32, init=jnp.ones)
  return -jnp.exp(a_log), dt_bias, d


def ssd_inputs(x, b, c, dt, a, dt_bias, valid=None):
  """Mamba-2's parameterization -> `ops.ssd` inputs.

  x [..., N, P], b/c [..., G, S], dt [..., N] -> (q, k, v, log_decay) with
  `v = dt x` (x's dtype) and `log_decay = dt A` (float32). With `valid`
  [B, T], dt is 0 past each sequence's end: no decay and no input there.
  """
  dt = jax.nn.softplus(dt.astype(_F32) + dt_bias)                   # [..., N]
  dt = past_the_end(valid, dt, 0)
  v = (x.astype(_F32) * dt[..., None]).astype(x.dtype)
  return c, b, v, dt * a


def ssd_decode_step(state, x, b, c, dt, a, dt_bias, d):
  """One token of the SSD core: state [B, N, S, P] f32, x [B, N, P], b/c
  [B, G, S], dt [B, N] -> (y [B, N, P] f32, state)."""
  y, state = ops.ssd_step(state, *ssd_inputs(x, b, c, dt, a, dt_bias))
  return y + d[:, None] * x.astype(_F32), state


def head_size(cell: str, num_heads: int, head_dim: int | None, model_dim: int | None) -> int:
  """P: `head_dim`, or the model width split over `num_heads` (multi-head cells)."""
  if head_dim is not None:
    return head_dim
  if model_dim is None:
    raise ValueError(f"{cell} needs `model_dim` or `head_dim` to build its state")
  if model_dim % num_heads:
    raise ValueError(f"`num_heads` must divide the model width, got {num_heads=} {model_dim=}")
  return model_dim // num_heads


class SSDCell(SSMCell):
  """Multi-head SSD: `[B, T, H] -> [B, T, H]`, or one step at a time.

  The decode state is `[B, N, S, P]` float32.
  """

  def __init__(self, num_heads: int, *, head_dim: int | None = None,
               state_dim: int = 64, model_dim: int | None = None,
               chunk_size: int | None = None,
               implementation: registry.Choice = None,
               name: str | None = None):
    """Constructs the cell.

    Args:
      num_heads: N, the number of heads.
      head_dim: P; defaults to `model_dim // num_heads`.
      state_dim: S, the key size of each head's state.
      model_dim: H (SSMModel passes it; inferred from the input otherwise,
        but `initial_state` needs it or `head_dim`).
      chunk_size: `ops.ssd`'s chunk (None: its default).
      implementation: `ops.ssd`'s backend for the sequence path.
      name: module name.

    Raises:
      TypeError: a size that is not an integer.
      ValueError: a size below 1, `num_heads` not dividing `model_dim`
        (without `head_dim`), or an unknown `implementation`.
    """
    check_chunked_cell_args(name, num_heads=num_heads, head_dim=head_dim,
                            model_dim=model_dim, chunk_size=chunk_size,
                            implementation=implementation,
                            implementations=SSD_IMPLEMENTATIONS)
    super().__init__(model_dim=model_dim, name=name)
    arguments.check_positive_ints(state_dim=state_dim)
    self.num_heads = num_heads
    self.head_dim = head_dim
    self.state_dim = state_dim
    self.chunk_size = chunk_size
    self.implementation = implementation

  def _dims(self, model_dim=None):
    model_dim = model_dim or self.model_dim
    head_dim = head_size("SSDCell", self.num_heads, self.head_dim, model_dim)
    return model_dim, self.num_heads, head_dim, self.state_dim

  @hk.transparent
  def _project(self, u):
    """u [..., H] -> x [..., N, P], b/c [..., N, S], dt [..., N]."""
    _, heads, p, s = self._dims(u.shape[-1])
    sizes = (heads * p, heads * s, heads * s, heads)
    proj = Linear(sum(sizes), with_bias=False, name="in_proj")(u)
    x, b, c, dt = jnp.split(proj, [sizes[0], sizes[0] + sizes[1],
                                   sizes[0] + 2 * sizes[1]], axis=-1)
    lead = u.shape[:-1]
    return (x.reshape(*lead, heads, p), b.reshape(*lead, heads, s),
            c.reshape(*lead, heads, s), dt)

  @hk.transparent
  def _sequence(self, u: jax.Array, state=None, valid=None):
    """Forward in time: u [B, T, H], state or None, valid [B, T] or None ->
    ([B, T, H], state)."""
    batch, time, model_dim = u.shape
    _, heads, p, _ = self._dims(model_dim)
    x, b, c, dt = self._project(u)
    a, dt_bias, d = decay_params(heads)
    q, k, v, log_decay = ssd_inputs(x, b, c, dt, a, dt_bias, valid)
    y, state = ops.ssd(q, k, v, log_decay, initial_state=state, chunk_size=self.chunk_size,
                       implementation=self.implementation)         # [B, T, N, P]
    y = y.astype(_F32) + d[:, None] * x.astype(_F32)
    y = y.astype(u.dtype).reshape(batch, time, heads * p)
    return Linear(model_dim, with_bias=False, name="out_proj")(y), state

  def _state_shapes(self, batch_size: int, model_dim: int | None = None):
    _, heads, p, s = self._dims(model_dim)
    return jax.ShapeDtypeStruct((batch_size, heads, s, p), _F32)

  @hk.name_like("__call__")
  def step(self, u_t: jax.Array, state):
    """One step: u_t [B, H], state -> (y_t [B, H], state)."""
    check_step("u_t", u_t, state, self._state_shapes)
    model_dim = u_t.shape[-1]
    _, heads, p, _ = self._dims(model_dim)
    x, b, c, dt = self._project(u_t)
    a, dt_bias, d = decay_params(heads)
    y, state = ssd_decode_step(state, x, b, c, dt, a, dt_bias, d)
    y = y.astype(u_t.dtype).reshape(u_t.shape[0], heads * p)
    return Linear(model_dim, with_bias=False, name="out_proj")(y), state
