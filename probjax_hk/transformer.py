"""Transformer: a stack of pre-norm attention + MLP blocks.

Glossary of shapes: B batch, T tokens, D_in input width, D model width,
N query heads, K key/value heads, H = D / N head size.

`Transformer(256, 8, 4)` is the standard profile (8 heads of 32).
"""

import haiku as hk
import jax

from probjax_hk import arguments
from probjax_hk import attention
from probjax_hk import layers
from probjax_hk import stacking


def check_model_args(model_dim: int, num_heads: int, num_layers: int,
                     num_kv_heads: int | None, dropout_rate: float,
                     remat_policy: stacking.RematPolicy, scan_unroll: int,
                     widening_factor: int = 4) -> None:
  """The constructor checks the Transformer and DiffusionTransformer share."""
  arguments.check_positive_ints(model_dim=model_dim, num_heads=num_heads,
                                num_layers=num_layers, widening_factor=widening_factor,
                                scan_unroll=scan_unroll)
  arguments.check_positive_ints_or_none(num_kv_heads=num_kv_heads)
  if model_dim % num_heads:
    raise ValueError(f"`num_heads` must divide `model_dim`, got {num_heads=} {model_dim=}")
  if num_kv_heads is not None and num_heads % num_kv_heads:
    raise ValueError(f"`num_kv_heads` must divide `num_heads`, got {num_kv_heads=} {num_heads=}")
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"`dropout_rate` must be in [0, 1), got {dropout_rate=}")
  stacking.validate_remat_policy(remat_policy)


def dropout(x: jax.Array, rate: float, is_training: bool) -> jax.Array:
  """Dropout only when training with a rate and an RNG (`hk.maybe_next_rng_key`)."""
  if not is_training or rate == 0.0:
    return x
  key = hk.maybe_next_rng_key()
  return x if key is None else hk.dropout(key, rate, x)


class TransformerBlock(hk.Module):
  """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

  def __init__(self, num_heads: int, *, num_kv_heads: int | None,
               widening_factor: int, attention_fn: attention.AttentionFn,
               is_causal: bool, dropout_rate: float, is_training: bool,
               use_rope: bool, mlp_activation: layers.Activation,
               name: str | None = None):
    super().__init__(name=name)
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.widening_factor = widening_factor
    self.attention_fn = attention_fn
    self.is_causal = is_causal
    self.dropout_rate = dropout_rate
    self.is_training = is_training
    self.use_rope = use_rope
    self.mlp_activation = mlp_activation

  def __call__(self, x: jax.Array, key_value_seq_lengths: jax.Array | None):
    """([B, T, D], [B] or None) -> the same pair, x updated."""
    model_dim = x.shape[-1]
    h = layers.LayerNorm(name="attention_norm")(x)
    h = attention.MultiHeadAttention(
        self.num_heads, num_kv_heads=self.num_kv_heads, use_rope=self.use_rope,
        attention_fn=self.attention_fn, name="attention")(
            h, is_causal=self.is_causal, key_value_seq_lengths=key_value_seq_lengths)
    x = x + dropout(h, self.dropout_rate, self.is_training)
    h = layers.LayerNorm(name="mlp_norm")(x)
    h = layers.MLP(self.widening_factor * model_dim, activation=self.mlp_activation,
                   name="mlp")(h)
    x = x + dropout(h, self.dropout_rate, self.is_training)
    return x, key_value_seq_lengths


class Transformer(hk.Module):
  """A pre-norm Transformer encoder (or decoder with `is_causal=True`).

  Blocks are built through `probjax_hk.stacking.apply_stack`: `remat_policy`
  wraps each in `hk.remat`, `scan_layers=True` builds them with
  `hk.layer_stack` (convert checkpoints with `stack_layer_params` /
  `unstack_layer_params`).
  """

  def __init__(self, model_dim: int, num_heads: int, num_layers: int, *,
               num_kv_heads: int | None = None, widening_factor: int = 4,
               attention_fn: attention.AttentionFn = attention.dot_product_attention,
               is_causal: bool = False, dropout_rate: float = 0.0,
               remat_policy: stacking.RematPolicy = None, scan_layers: bool = False,
               scan_unroll: int = 1, use_rope: bool = False,
               mlp_activation: layers.Activation = "gelu", name: str | None = None):
    """Constructs the Transformer.

    Args:
      model_dim: D, the residual width.
      num_heads: N, query heads; must divide `model_dim`.
      num_layers: number of blocks.
      num_kv_heads: K, key/value heads for GQA (default N).
      widening_factor: MLP hidden width over D.
      attention_fn: `jax.nn.dot_product_attention`-style callable.
      is_causal: causal self-attention.
      dropout_rate: residual dropout when training with an RNG.
      remat_policy: None | 'full' | a `jax.checkpoint_policies` name | callable.
      scan_layers: build the blocks with `hk.layer_stack`.
      scan_unroll: `hk.layer_stack`'s unroll with `scan_layers`.
      use_rope: rotary position embedding on queries and keys.
      mlp_activation: 'gelu' or 'swiglu'.
      name: module name.
    """
    super().__init__(name=name)
    check_model_args(model_dim, num_heads, num_layers, num_kv_heads, dropout_rate,
                     remat_policy, scan_unroll, widening_factor)
    self.model_dim = model_dim
    self.num_heads = num_heads
    self.num_layers = num_layers
    self.num_kv_heads = num_kv_heads
    self.widening_factor = widening_factor
    self.attention_fn = attention_fn
    self.is_causal = is_causal
    self.dropout_rate = dropout_rate
    self.remat_policy = remat_policy
    self.scan_layers = scan_layers
    self.scan_unroll = scan_unroll
    self.use_rope = use_rope
    self.mlp_activation = mlp_activation

  def __call__(self, x: jax.Array, *, key_value_seq_lengths: jax.Array | None = None,
               is_training: bool = False) -> jax.Array:
    """Applies the stack.

    Args:
      x: [B, T, D_in] tokens; projected to D when D_in != D.
      key_value_seq_lengths: optional [B] number of valid tokens per example;
        later tokens are not attended to.
      is_training: enables dropout (with an RNG).

    Returns:
      [B, T, D] in x's dtype.
    """
    layers.check_tokens(x)
    if key_value_seq_lengths is not None and key_value_seq_lengths.shape != x.shape[:1]:
      raise ValueError(f"`key_value_seq_lengths` must be [B]={x.shape[:1]}, "
                       f"got {key_value_seq_lengths.shape}")
    if x.shape[-1] != self.model_dim:
      x = layers.Linear(self.model_dim, name="input_projection")(x)  # [B, T, D]

    def make_block(name):
      return TransformerBlock(
          self.num_heads, num_kv_heads=self.num_kv_heads,
          widening_factor=self.widening_factor, attention_fn=self.attention_fn,
          is_causal=self.is_causal, dropout_rate=self.dropout_rate,
          is_training=is_training, use_rope=self.use_rope,
          mlp_activation=self.mlp_activation, name=name)

    x, _ = stacking.apply_stack(
        make_block, self.num_layers, (x, key_value_seq_lengths),
        scan_layers=self.scan_layers, remat_policy=self.remat_policy,
        unroll=self.scan_unroll)
    return layers.LayerNorm(name="final_norm")(x)
