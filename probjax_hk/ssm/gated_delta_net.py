"""Gated DeltaNet as an SSM cell, on `ops.gated_delta_rule`.

Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", https://arxiv.org/abs/2412.06464:

    q, k, v = silu(causal_depthwise_conv(W_{q,k,v} u))   # [N, P] each, width W
    q, k = q / |q|, k / |k|                              # per head
    log_alpha = -exp(A_log) softplus(W_a u + dt_bias)    # [N], the decay gate
    beta = sigmoid(W_b u)                                # [N], the write strength
    o = gated_delta_rule(q, k, v, log_alpha, beta)       # scale P ** -0.5
    o = RMSNorm(o) * silu(W_g u)                         # per head; gate optional
    out = out_proj(o)                                    # [B, T, H]

Glossary of shapes: B batch, T time, H model width, N heads, P head size,
W conv width.
"""

import haiku as hk
import jax
import jax.numpy as jnp

import ops
from ops import registry
from ops.gated_delta_rule import IMPLEMENTATIONS as GATED_DELTA_RULE_IMPLEMENTATIONS
from probjax_hk.arguments import check_bools
from probjax_hk.arguments import check_positive_ints
from probjax_hk.layers import Linear
from probjax_hk.layers import RMSNorm
from probjax_hk.ssm.arguments import check_chunked_cell_args
from probjax_hk.ssm.arguments import check_step
from probjax_hk.ssm.arguments import past_the_end
from probjax_hk.ssm.base import SSMCell
from probjax_hk.ssm.causal_conv import causal_conv
from probjax_hk.ssm.causal_conv import causal_conv_step
from probjax_hk.ssm.causal_conv import conv_params
from probjax_hk.ssm.ssd import a_log_init
from probjax_hk.ssm.ssd import dt_bias_init
from probjax_hk.ssm.ssd import head_size

_F32 = jnp.float32


def _l2_normalize(x, eps=1e-6):
  xf = x.astype(_F32)
  return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class GatedDeltaNetCell(SSMCell):
  """Gated DeltaNet: `[B, T, H] -> [B, T, H]`, or one step at a time.

  The decode state is `(conv_state [B, W - 1, 3 N P], ssm_state [B, N, P, P])`,
  both float32.
  """

  def __init__(self, num_heads: int, *, head_dim: int | None = None,
               conv_width: int = 4, use_output_gate: bool = True,
               model_dim: int | None = None, chunk_size: int | None = None,
               implementation: registry.Choice = None,
               name: str | None = None):
    """Constructs the cell.

    Args:
      num_heads: N, the number of heads.
      head_dim: P (key and value size per head); defaults to
        `model_dim // num_heads`.
      conv_width: W (>= 1), the short convolutions on q, k and v.
      use_output_gate: multiply the normed output by `silu(W_g u)`.
      model_dim: H (SSMModel passes it; inferred from the input otherwise,
        but `initial_state` needs it or `head_dim`).
      chunk_size: `ops.gated_delta_rule`'s chunk (None: its default).
      implementation: `ops.gated_delta_rule`'s backend for the sequence path.
      name: module name.

    Raises:
      TypeError: a size that is not an integer or a flag that is not a bool.
      ValueError: a size below 1, `num_heads` not dividing `model_dim`
        (without `head_dim`), or an unknown `implementation`.
    """
    check_chunked_cell_args(name, num_heads=num_heads, head_dim=head_dim,
                            model_dim=model_dim, chunk_size=chunk_size,
                            implementation=implementation,
                            implementations=GATED_DELTA_RULE_IMPLEMENTATIONS)
    super().__init__(model_dim=model_dim, name=name)
    check_positive_ints(conv_width=conv_width)
    check_bools(use_output_gate=use_output_gate)
    self.num_heads = num_heads
    self.head_dim = head_dim
    self.conv_width = conv_width
    self.use_output_gate = use_output_gate
    self.chunk_size = chunk_size
    self.implementation = implementation

  def _dims(self, model_dim=None):
    model_dim = model_dim or self.model_dim
    head_dim = head_size("GatedDeltaNetCell", self.num_heads, self.head_dim, model_dim)
    return model_dim, self.num_heads, head_dim

  @hk.transparent
  def _gates(self, u, heads):
    """u [..., H] -> (log_alpha [..., N] f32, beta [..., N] f32)."""
    ab = Linear(2 * heads, with_bias=False, name="gate_proj")(u).astype(_F32)
    a_raw, b_raw = jnp.split(ab, 2, axis=-1)
    a_log = hk.get_parameter("A_log", [heads], _F32, init=a_log_init)
    dt_bias = hk.get_parameter("dt_bias", [heads], _F32, init=dt_bias_init())
    log_alpha = -jnp.exp(a_log) * jax.nn.softplus(a_raw + dt_bias)
    return log_alpha, jax.nn.sigmoid(b_raw)

  @hk.transparent
  def _qkv(self, qkv, heads, p):
    """silu'd conv output [..., 3 N P] -> q, k (unit norm), v: [..., N, P]."""
    q, k, v = (t.reshape(*qkv.shape[:-1], heads, p) for t in jnp.split(qkv, 3, axis=-1))
    return _l2_normalize(q), _l2_normalize(k), v

  @hk.transparent
  def _finish(self, o, u, model_dim):
    """o [..., N, P] -> out [..., H] in u's dtype."""
    o = RMSNorm(name="norm")(o.astype(u.dtype))                    # per head
    o = o.reshape(*u.shape[:-1], -1)
    if self.use_output_gate:
      o = o * jax.nn.silu(Linear(o.shape[-1], with_bias=False, name="g_proj")(u))
    return Linear(model_dim, with_bias=False, name="out_proj")(o)

  @hk.transparent
  def _sequence(self, u: jax.Array, state=None, valid=None):
    """Forward in time: u [B, T, H], state or None, valid [B, T] or None ->
    ([B, T, H], state)."""
    conv_state, ssm_state = (None, None) if state is None else state
    model_dim, heads, p = self._dims(u.shape[-1])
    qkv = Linear(3 * heads * p, with_bias=False, name="qkv_proj")(u)
    w, b = conv_params(self.conv_width, qkv.shape[-1])
    qkv, conv_state = causal_conv(qkv, w, b, conv_state, valid)
    q, k, v = self._qkv(jax.nn.silu(qkv), heads, p)
    log_alpha, beta = self._gates(u, heads)
    # Past a sequence's end: decay 1 and no write, so the state stays.
    log_alpha, beta = past_the_end(valid, log_alpha, 0), past_the_end(valid, beta, 0)
    o, ssm_state = ops.gated_delta_rule(q, k, v, log_alpha, beta, initial_state=ssm_state,
                                        chunk_size=self.chunk_size,
                                        implementation=self.implementation)
    return self._finish(o, u, model_dim), (conv_state, ssm_state)

  def _state_shapes(self, batch_size: int, model_dim: int | None = None):
    _, heads, p = self._dims(model_dim)
    return (jax.ShapeDtypeStruct((batch_size, self.conv_width - 1, 3 * heads * p), _F32),
            jax.ShapeDtypeStruct((batch_size, heads, p, p), _F32))

  @hk.name_like("__call__")
  def step(self, u_t: jax.Array, state):
    """One step: u_t [B, H], state -> (y_t [B, H], state)."""
    check_step("u_t", u_t, state, self._state_shapes)
    conv_state, ssm_state = state
    model_dim, heads, p = self._dims(u_t.shape[-1])
    qkv = Linear(3 * heads * p, with_bias=False, name="qkv_proj")(u_t)
    w, b = conv_params(self.conv_width, qkv.shape[-1])
    qkv, conv_state = causal_conv_step(qkv, conv_state, w, b)
    q, k, v = self._qkv(jax.nn.silu(qkv), heads, p)
    log_alpha, beta = self._gates(u_t, heads)
    o, ssm_state = ops.gated_delta_step(ssm_state, q, k, v, log_alpha, beta, scale=p ** -0.5)
    return self._finish(o, u_t, model_dim), (conv_state, ssm_state)
