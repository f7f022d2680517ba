"""DiffusionTransformer: DiT blocks with adaLN-Zero conditioning.

Peebles & Xie, "Scalable Diffusion Models with Transformers" (2023),
https://arxiv.org/abs/2212.09748.

Glossary of shapes: B batch, T tokens, D_x token width, D model width,
C context width.

The conditioning vector `c = time_embedding(t) + context_projection(context)`
regresses, per block, the shift, scale and gate of the attention and MLP
branches; the gates start at zero so every block starts as the identity, and
the output projection starts at zero so the untrained model predicts zeros.
"""

import haiku as hk
import jax
import jax.numpy as jnp

from probjax_hk import arguments
from probjax_hk import attention
from probjax_hk import layers
from probjax_hk import stacking
from probjax_hk import transformer


class DiTBlock(hk.Module):
  """`x + gate * attn(modulate(norm(x)))`, then the same for the MLP."""

  def __init__(self, num_heads: int, *, num_kv_heads: int | None,
               widening_factor: int, attention_fn: attention.AttentionFn,
               dropout_rate: float, is_training: bool, use_rope: bool,
               name: str | None = None):
    super().__init__(name=name)
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.widening_factor = widening_factor
    self.attention_fn = attention_fn
    self.dropout_rate = dropout_rate
    self.is_training = is_training
    self.use_rope = use_rope

  def __call__(self, x: jax.Array, cond: jax.Array):
    """([B, T, D], [B, D]) -> the same pair, x updated."""
    model_dim = x.shape[-1]
    (shift_attn, scale_attn, gate_attn, shift_mlp, scale_mlp,
     gate_mlp) = layers.AdaLNModulation(model_dim, 6, name="adaln")(cond)
    norm = lambda n: layers.LayerNorm(create_scale=False, create_offset=False, name=n)
    h = layers.modulate(norm("attention_norm")(x), shift_attn, scale_attn)
    h = attention.MultiHeadAttention(
        self.num_heads, num_kv_heads=self.num_kv_heads, use_rope=self.use_rope,
        attention_fn=self.attention_fn, name="attention")(h)
    x = x + transformer.dropout(gate_attn.astype(x.dtype) * h, self.dropout_rate,
                                self.is_training)
    h = layers.modulate(norm("mlp_norm")(x), shift_mlp, scale_mlp)
    h = layers.MLP(self.widening_factor * model_dim, name="mlp")(h)
    x = x + transformer.dropout(gate_mlp.astype(x.dtype) * h, self.dropout_rate,
                                self.is_training)
    return x, cond


class DiffusionTransformer(hk.Module):
  """A DiT over token sequences: predicts noise (or velocity) from `x_t` and `t`."""

  def __init__(self, model_dim: int, num_heads: int, num_layers: int, *,
               num_kv_heads: int | None = None, widening_factor: int = 4,
               attention_fn: attention.AttentionFn = attention.dot_product_attention,
               dropout_rate: float = 0.0, remat_policy: stacking.RematPolicy = None,
               scan_layers: bool = False, scan_unroll: int = 1, use_rope: bool = True,
               name: str | None = None):
    """Constructs the DiT.

    Args:
      model_dim: D, the residual width.
      num_heads: N, query heads; must divide `model_dim`.
      num_layers: number of DiT blocks.
      num_kv_heads: key/value heads for GQA (default N).
      widening_factor: MLP hidden width over D.
      attention_fn: `jax.nn.dot_product_attention`-style callable.
      dropout_rate: residual dropout when training with an RNG.
      remat_policy: None | 'full' | a `jax.checkpoint_policies` name | callable.
      scan_layers: build the blocks with `hk.layer_stack`.
      scan_unroll: `hk.layer_stack`'s unroll with `scan_layers`.
      use_rope: rotary position embedding (tokens are ordered).
      name: module name.

    Raises:
      TypeError: a size that is not an integer, a flag that is not a bool, a
        `dropout_rate` that is not a number or an `attention_fn` that is not
        callable.
      ValueError: a size below 1, `num_heads` not dividing `model_dim` (or
        `num_kv_heads` not dividing `num_heads`), `dropout_rate` outside
        [0, 1), or an unknown `remat_policy`.
    """
    arguments.check_name(name)
    super().__init__(name=name)
    transformer.check_model_args(model_dim, num_heads, num_layers, num_kv_heads,
                                 dropout_rate, remat_policy, scan_unroll, widening_factor,
                                 attention_fn=attention_fn, scan_layers=scan_layers,
                                 use_rope=use_rope)
    self.model_dim = model_dim
    self.num_heads = num_heads
    self.num_layers = num_layers
    self.num_kv_heads = num_kv_heads
    self.widening_factor = widening_factor
    self.attention_fn = attention_fn
    self.dropout_rate = dropout_rate
    self.remat_policy = remat_policy
    self.scan_layers = scan_layers
    self.scan_unroll = scan_unroll
    self.use_rope = use_rope

  def __call__(self, x: jax.Array, t: jax.Array, context: jax.Array | None = None, *,
               is_training: bool = False) -> jax.Array:
    """Predicts from noisy tokens.

    Args:
      x: [B, T, D_x] noisy tokens.
      t: [B] (or scalar) diffusion times.
      context: optional [B, C] conditioning vector (e.g. a class embedding).
      is_training: enables dropout (with an RNG).

    Returns:
      [B, T, D_x] in x's dtype.
    """
    layers.check_tokens(x)
    batch = x.shape[0]
    t = jnp.asarray(t)
    if t.ndim == 0:
      t = jnp.broadcast_to(t, (batch,))
    if t.shape != (batch,):
      raise ValueError(f"`t` must be a scalar or [B]=({batch},), got shape {t.shape}")
    if context is not None and (context.ndim != 2 or context.shape[0] != batch):
      raise ValueError(f"`context` must be [B, C] with B={batch}, got shape {context.shape}")

    h = layers.Linear(self.model_dim, name="input_projection")(x)  # [B, T, D]
    cond = layers.TimestepEmbedding(self.model_dim, name="time_embedding")(t, x.dtype)
    if context is not None:
      cond = cond + layers.Linear(self.model_dim, name="context_projection")(
          context.astype(x.dtype))  # [B, D]

    def make_block(name):
      return DiTBlock(self.num_heads, num_kv_heads=self.num_kv_heads,
                      widening_factor=self.widening_factor,
                      attention_fn=self.attention_fn, dropout_rate=self.dropout_rate,
                      is_training=is_training, use_rope=self.use_rope, name=name)

    h, _ = stacking.apply_stack(make_block, self.num_layers, (h, cond),
                                scan_layers=self.scan_layers,
                                remat_policy=self.remat_policy, unroll=self.scan_unroll)
    shift, scale = layers.AdaLNModulation(self.model_dim, 2, name="final_adaln")(cond)
    h = layers.modulate(
        layers.LayerNorm(create_scale=False, create_offset=False, name="final_norm")(h),
        shift, scale)
    return layers.Linear(x.shape[-1], w_init=jnp.zeros, name="output_projection")(h)
