"""The Mamba-2 block as an SSM cell, on `ops.ssd`.

Dao & Gu 2024, "Transformers are SSMs", https://arxiv.org/abs/2405.21060:

    z, xBC, dt = in_proj(u)                 # [E], [E + 2 G S], [N]
    x, B, C = silu(causal_depthwise_conv(xBC))        # width `conv_width`
    y = ssd(q=C, k=B, v=dt x, log_decay=dt A) + D x   # A = -exp(A_log) [N]
    y = RMSNorm(y * silu(z))                          # gated norm
    out = out_proj(y)                                 # [B, T, H]

Glossary of shapes: B batch, T time, H model width, E inner width (expand H),
N heads (E / P), P head size, G groups of B and C, S state size, W conv width.
"""

import haiku as hk
import jax
import jax.numpy as jnp

import ops
from ops import registry
from ops.ssd import IMPLEMENTATIONS as SSD_IMPLEMENTATIONS
from probjax_hk.arguments import check_positive_ints
from probjax_hk.layers import Linear
from probjax_hk.layers import RMSNorm
from probjax_hk.ssm.arguments import check_chunked_cell_args
from probjax_hk.ssm.arguments import check_step
from probjax_hk.ssm.base import SSMCell
from probjax_hk.ssm.causal_conv import causal_conv
from probjax_hk.ssm.causal_conv import causal_conv_step
from probjax_hk.ssm.causal_conv import conv_params
from probjax_hk.ssm.ssd import decay_params
from probjax_hk.ssm.ssd import ssd_decode_step
from probjax_hk.ssm.ssd import ssd_inputs

_F32 = jnp.float32


class Mamba2Cell(SSMCell):
  """The Mamba-2 block: `[B, T, H] -> [B, T, H]`, or one step at a time.

  The decode state is `(conv_state [B, W - 1, E + 2 G S], ssm_state [B, N, S, P])`,
  both float32.
  """

  def __init__(self, *, expand: int = 2, head_dim: int = 64, state_dim: int = 64,
               conv_width: int = 4, ngroups: int = 1, model_dim: int | None = None,
               chunk_size: int | None = None,
               implementation: registry.Choice = None,
               name: str | None = None):
    """Constructs the cell.

    Args:
      expand: E / H, an integer >= 1.
      head_dim: P; must divide E.
      state_dim: S, the state size of each head.
      conv_width: W (>= 1).
      ngroups: G, the number of B/C groups; must divide the number of heads.
      model_dim: H (SSMModel passes it; inferred from the input otherwise,
        but `initial_state` needs it).
      chunk_size: `ops.ssd`'s chunk (None: its default).
      implementation: `ops.ssd`'s backend for the sequence path.
      name: module name.

    Raises:
      TypeError: a size that is not an integer.
      ValueError: a size below 1, `head_dim` or `ngroups` not dividing the
        inner width or the heads (given `model_dim`), or an unknown
        `implementation`.
    """
    check_chunked_cell_args(name, model_dim=model_dim, chunk_size=chunk_size,
                            implementation=implementation,
                            implementations=SSD_IMPLEMENTATIONS)
    super().__init__(model_dim=model_dim, name=name)
    check_positive_ints(expand=expand, head_dim=head_dim, state_dim=state_dim,
                        conv_width=conv_width, ngroups=ngroups)
    self.expand, self.head_dim, self.state_dim = expand, head_dim, state_dim
    self.conv_width, self.ngroups = conv_width, ngroups
    self.chunk_size = chunk_size
    self.implementation = implementation
    if model_dim is not None:
      self._dims(model_dim)

  def _dims(self, model_dim=None):
    model_dim = model_dim or self.model_dim
    if model_dim is None:
      raise ValueError("Mamba2Cell needs `model_dim` to build its state")
    inner = self.expand * model_dim
    if inner % self.head_dim:
      raise ValueError(f"`head_dim` must divide expand * model_dim, got "
                       f"{self.head_dim=} {inner=}")
    heads = inner // self.head_dim
    if heads % self.ngroups:
      raise ValueError(f"`ngroups` must divide the number of heads, got "
                       f"{self.ngroups=} {heads=}")
    return model_dim, inner, heads

  @hk.transparent
  def _in_proj(self, u):
    """u [..., H] -> z [..., E], xBC [..., E + 2 G S], dt [..., N]."""
    _, inner, heads = self._dims(u.shape[-1])
    conv_channels = inner + 2 * self.ngroups * self.state_dim
    proj = Linear(inner + conv_channels + heads, with_bias=False, name="in_proj")(u)
    return jnp.split(proj, [inner, inner + conv_channels], axis=-1)

  @hk.transparent
  def _split_xbc(self, xbc):
    """silu'd conv output [..., E + 2 G S] -> x [..., N, P], b/c [..., G, S]."""
    inner = xbc.shape[-1] - 2 * self.ngroups * self.state_dim
    x, b, c = jnp.split(xbc, [inner, inner + self.ngroups * self.state_dim], axis=-1)
    lead = xbc.shape[:-1]
    return (x.reshape(*lead, inner // self.head_dim, self.head_dim),
            b.reshape(*lead, self.ngroups, self.state_dim),
            c.reshape(*lead, self.ngroups, self.state_dim))

  @hk.transparent
  def _finish(self, y, z, model_dim):
    """y [..., N, P] f32, z [..., E] -> out [..., H] in z's dtype."""
    y = y.reshape(*z.shape).astype(z.dtype)
    y = RMSNorm(name="norm")(y * jax.nn.silu(z))
    return Linear(model_dim, with_bias=False, name="out_proj")(y)

  @hk.transparent
  def _sequence(self, u: jax.Array, state=None, valid=None):
    """Forward in time: u [B, T, H], state or None, valid [B, T] or None ->
    ([B, T, H], state)."""
    conv_state, ssm_state = (None, None) if state is None else state
    model_dim, _, heads = self._dims(u.shape[-1])
    z, xbc, dt = self._in_proj(u)
    w, b = conv_params(self.conv_width, xbc.shape[-1])
    xbc, conv_state = causal_conv(xbc, w, b, conv_state, valid)
    x, bm, cm = self._split_xbc(jax.nn.silu(xbc))
    a, dt_bias, d = decay_params(heads)
    q, k, v, log_decay = ssd_inputs(x, bm, cm, dt, a, dt_bias, valid)
    y, ssm_state = ops.ssd(q, k, v, log_decay, initial_state=ssm_state,
                           chunk_size=self.chunk_size,
                           implementation=self.implementation)     # [B, T, N, P]
    y = y.astype(_F32) + d[:, None] * x.astype(_F32)
    return self._finish(y, z, model_dim), (conv_state, ssm_state)

  def _state_shapes(self, batch_size: int, model_dim: int | None = None):
    _, inner, heads = self._dims(model_dim)
    channels = inner + 2 * self.ngroups * self.state_dim
    return (jax.ShapeDtypeStruct((batch_size, self.conv_width - 1, channels), _F32),
            jax.ShapeDtypeStruct((batch_size, heads, self.state_dim, self.head_dim), _F32))

  @hk.name_like("__call__")
  def step(self, u_t: jax.Array, state):
    """One step: u_t [B, H], state -> (y_t [B, H], state)."""
    check_step("u_t", u_t, state, self._state_shapes)
    conv_state, ssm_state = state
    model_dim, _, heads = self._dims(u_t.shape[-1])
    z, xbc, dt = self._in_proj(u_t)
    w, b = conv_params(self.conv_width, xbc.shape[-1])
    xbc, conv_state = causal_conv_step(xbc, conv_state, w, b)
    x, bm, cm = self._split_xbc(jax.nn.silu(xbc))
    a, dt_bias, d = decay_params(heads)
    y, ssm_state = ssd_decode_step(ssm_state, x, bm, cm, dt, a, dt_bias, d)
    return self._finish(y, z, model_dim), (conv_state, ssm_state)
