"""UNet: the convolutional denoiser of diffusion models.

Ho, Jain & Abbeel, "Denoising Diffusion Probabilistic Models" (2020),
https://arxiv.org/abs/2006.11239, with the scale-and-shift conditioning of
Nichol & Dhariwal, "Improved Denoising Diffusion Probabilistic Models" (2021),
https://arxiv.org/abs/2102.09672.

Glossary of shapes: B batch, H height, W width, C channels, C_in/C_out input and
output channels, E conditioning (time embedding) width, D_c context width,
N attention heads.

Images are NHWC (JAX's convention) and kernels HWIO. One level per entry of
`channels`; level `l` runs at `1 / 2**l` of the input resolution:

  conv_in -> [res_block (+ attention)] x num_res_blocks, downsample   (per level)
          -> res_block, attention, res_block                        (middle)
          -> [concat skip, res_block (+ attention)] x (num_res_blocks + 1),
             upsample                                               (per level, reversed)
          -> GroupNorm, SiLU, conv_out

The conditioning vector `c = time_embedding(t) + context_projection(context)`
sets a per-channel scale and shift after the second GroupNorm of every
residual block. Parameters are float32 and every layer computes in the input's
dtype (bf16 in, bf16 out); GroupNorm statistics are accumulated in float32.
"""

from collections.abc import Callable, Iterable, Sequence
import math
import numbers
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from probjax_hk import arguments
from probjax_hk import attention
from probjax_hk import layers
from probjax_hk import stacking
from probjax_hk import transformer

_DIMENSION_NUMBERS = ("NHWC", "HWIO", "NHWC")


class Conv2D(hk.Module):
  """2-D convolution, NHWC/HWIO, float32 parameters cast to the input's dtype.

  (`hk.Conv2D` creates its parameters in the input's dtype, so a bf16 forward
  pass would create bf16 parameters.) Odd square kernels with symmetric
  padding: stride 1 keeps the size, stride 2 halves an even size.
  """

  def __init__(self, output_channels: int, kernel_size: int = 3, *, stride: int = 1,
               with_bias: bool = True, w_init: hk.initializers.Initializer | None = None,
               name: str | None = None):
    super().__init__(name=name)
    if kernel_size < 1 or kernel_size % 2 == 0:
      raise ValueError(f"`kernel_size` must be a positive odd number, got {kernel_size=}")
    if stride < 1:
      raise ValueError(f"`stride` must be >= 1, got {stride=}")
    self.output_channels = output_channels
    self.kernel_size = kernel_size
    self.stride = stride
    self.with_bias = with_bias
    self.w_init = w_init

  def __call__(self, x: jax.Array) -> jax.Array:
    """[B, H, W, C_in] -> [B, ceil(H / stride), ceil(W / stride), output_channels]."""
    k, input_channels = self.kernel_size, x.shape[-1]
    # DDPM's initializer; a uniform draw also compiles far faster than a
    # truncated normal, one per kernel shape.
    w_init = self.w_init or hk.initializers.VarianceScaling(1.0, "fan_avg", "uniform")
    w = hk.get_parameter("w", [k, k, input_channels, self.output_channels], jnp.float32,
                         init=w_init)  # [k, k, C_in, C_out]
    pad = k // 2
    y = jax.lax.conv_general_dilated(
        x, w.astype(x.dtype), window_strides=(self.stride, self.stride),
        padding=((pad, pad), (pad, pad)), dimension_numbers=_DIMENSION_NUMBERS)
    if self.with_bias:
      b = hk.get_parameter("b", [self.output_channels], jnp.float32, init=jnp.zeros)
      y = y + b.astype(x.dtype)
    return y


class GroupNorm(hk.Module):
  """Group normalization (Wu & He 2018, https://arxiv.org/abs/1803.08494).

  Statistics over the spatial axes and the channels of each group, computed in
  float32; float32 scale and offset; the output has the input's dtype.
  """

  def __init__(self, num_groups: int, *, eps: float = 1e-5, name: str | None = None):
    super().__init__(name=name)
    if num_groups < 1:
      raise ValueError(f"`num_groups` must be >= 1, got {num_groups=}")
    self.num_groups = num_groups
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    """[B, ..., C] -> [B, ..., C], C a multiple of `num_groups`."""
    channels = x.shape[-1]
    if channels % self.num_groups:
      raise ValueError(f"`norm_groups`={self.num_groups} must divide the channel count, "
                       f"got {channels=}")
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], self.num_groups,
                                       channels // self.num_groups)  # [B, ..., G, C/G]
    axes = tuple(range(1, x.ndim - 1)) + (x.ndim,)
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True)
    y = ((xf - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
    y = y * hk.get_parameter("scale", [channels], jnp.float32, init=jnp.ones)
    y = y + hk.get_parameter("offset", [channels], jnp.float32, init=jnp.zeros)
    return y.astype(x.dtype)


class ResBlock(hk.Module):
  """`skip(x) + conv(drop(silu(modulate(norm(conv(silu(norm(x))))))))`."""

  def __init__(self, output_channels: int, *, norm_groups: int, dropout_rate: float,
               is_training: bool, name: str | None = None):
    super().__init__(name=name)
    self.output_channels = output_channels
    self.norm_groups = norm_groups
    self.dropout_rate = dropout_rate
    self.is_training = is_training

  def __call__(self, x: jax.Array, cond: jax.Array | None) -> jax.Array:
    """([B, H, W, C_in], [B, E] or None) -> [B, H, W, output_channels]."""
    c = self.output_channels
    h = jax.nn.silu(GroupNorm(self.norm_groups, name="norm_1")(x))
    h = Conv2D(c, 3, name="conv_1")(h)  # [B, H, W, C]
    h = GroupNorm(self.norm_groups, name="norm_2")(h)
    if cond is not None:
      scale_shift = layers.Linear(2 * c, name="modulation")(jax.nn.silu(cond))  # [B, 2C]
      scale, shift = jnp.split(scale_shift[:, None, None, :], 2, axis=-1)  # [B, 1, 1, C]
      h = h * (1 + scale.astype(h.dtype)) + shift.astype(h.dtype)
    h = transformer.dropout(jax.nn.silu(h), self.dropout_rate, self.is_training)
    h = Conv2D(c, 3, name="conv_2")(h)
    skip = x if x.shape[-1] == c else Conv2D(c, 1, name="skip")(x)
    return skip + h


class AttentionBlock(hk.Module):
  """`x + attention(norm(x))` over the H * W positions, with bias projections."""

  def __init__(self, num_heads: int, *, norm_groups: int,
               attention_fn: attention.AttentionFn, name: str | None = None):
    super().__init__(name=name)
    self.num_heads = num_heads
    self.norm_groups = norm_groups
    self.attention_fn = attention_fn

  def __call__(self, x: jax.Array) -> jax.Array:
    """[B, H, W, C] -> [B, H, W, C]."""
    batch, height, width, channels = x.shape
    h = GroupNorm(self.norm_groups, name="norm")(x)
    h = h.reshape(batch, height * width, channels)  # [B, H*W, C]
    h = attention.MultiHeadAttention(self.num_heads, attention_fn=self.attention_fn,
                                     with_bias=True, name="attention")(h)
    return x + h.reshape(x.shape)


def _maybe_remat(make: Callable[[], hk.Module],
                 remat_policy: stacking.RematPolicy) -> Callable[..., jax.Array]:
  """The block `make()` builds, wrapped in `hk.remat` under a `remat_policy`.

  (A function, not a UNet method: Haiku would prefix the names of modules
  built inside a method other than `__call__` with `~method_name`.)
  """
  if remat_policy is None:
    return make()
  policy = stacking.resolve_remat_policy(remat_policy)
  return hk.remat(lambda *args: make()(*args), policy=policy)


def upsample_nearest(x: jax.Array) -> jax.Array:
  """Nearest-neighbour 2x upsampling: [B, H, W, C] -> [B, 2H, 2W, C]."""
  b, h, w, c = x.shape
  x = jnp.broadcast_to(x[:, :, None, :, None, :], (b, h, 2, w, 2, c))
  return x.reshape(b, 2 * h, 2 * w, c)


class UNet(hk.Module):
  """A time- (and context-) conditioned UNet over NHWC images."""

  def __init__(self, in_channels: int, channels: Sequence[int] = (64, 128, 256), *,
               out_channels: int | None = None, num_res_blocks: int = 2,
               attention_levels: Sequence[int] | None = None, num_heads: int = 4,
               time_embedding_dim: int | None = None, context_dim: int | None = None,
               dropout_rate: float = 0.0, norm_groups: int = 32,
               remat_policy: stacking.RematPolicy = None,
               attention_fn: attention.AttentionFn = attention.dot_product_attention,
               name: str | None = None):
    """Constructs the UNet.

    Args:
      in_channels: C_in, channels of the input images.
      channels: the width of each level; `len(channels)` levels, so image sizes
        must be multiples of `2 ** (len(channels) - 1)`.
      out_channels: C_out (default C_in).
      num_res_blocks: residual blocks per level on the way down (one more on
        the way up, which also consumes the downsampling skip).
      attention_levels: the levels (indices into `channels`) with a
        self-attention block after each residual block; default the lowest
        resolution `(len(channels) - 1,)`. The middle block has attention when
        the lowest level does.
      num_heads: N, attention heads; must divide the channels of every
        attention level.
      time_embedding_dim: E, width of the conditioning vector (default
        `4 * channels[0]`).
      context_dim: D_c, width of the optional context vector; `context` must
        then be given to `__call__` (and must not be otherwise).
      dropout_rate: dropout inside each residual block when training with an RNG.
      norm_groups: GroupNorm groups; must divide every entry of `channels`.
      remat_policy: None | 'full' | a `jax.checkpoint_policies` name | callable,
        applied with `hk.remat` to every residual and attention block.
      attention_fn: `jax.nn.dot_product_attention`-style callable (default
        `probjax_hk.dot_product_attention`, which picks the fastest kernel).
      name: module name.

    Raises:
      TypeError: a size that is not an integer, `channels` or
        `attention_levels` that is not a sequence, a `dropout_rate` that is
        not a number, or an `attention_fn` that is not callable.
      ValueError: a size below 1, no `channels`, `norm_groups` or
        `num_heads` not dividing the channels they must, a level that is not
        an integer index into `channels`, a `dropout_rate` outside [0, 1),
        or an unknown `remat_policy`.
    """
    arguments.check_name(name)
    super().__init__(name=name or "unet")
    if isinstance(channels, (str, bytes)) or not isinstance(channels, Iterable):
      raise TypeError(f"`channels` must be a sequence of positive ints, got {channels=}")
    channels = tuple(channels)
    if not channels:
      raise ValueError(f"`channels` must be a non-empty sequence of positive ints, got {channels=}")
    arguments.check_positive_ints(in_channels=in_channels, num_res_blocks=num_res_blocks,
                                  num_heads=num_heads, norm_groups=norm_groups,
                                  **{f"channels[{i}]": c for i, c in enumerate(channels)})
    arguments.check_positive_ints_or_none(out_channels=out_channels,
                                          time_embedding_dim=time_embedding_dim,
                                          context_dim=context_dim)
    if any(c % norm_groups for c in channels):
      raise ValueError(f"`norm_groups` must divide every channel count, got {norm_groups=} "
                       f"and {channels=}")
    if attention_levels is None:
      attention_levels = (len(channels) - 1,)
    if isinstance(attention_levels, (str, bytes)) or not isinstance(attention_levels, Iterable):
      raise TypeError(f"`attention_levels` must be a sequence of indices into `channels` "
                      f"or None, got {attention_levels=}")
    attention_levels = tuple(attention_levels)
    if any(not isinstance(level, numbers.Integral) or isinstance(level, bool)
           or not 0 <= level < len(channels) for level in attention_levels):
      raise ValueError(f"`attention_levels` must be indices into `channels` "
                       f"(0..{len(channels) - 1}), got {attention_levels=}")
    attention_levels = tuple(sorted(set(attention_levels)))
    if any(channels[level] % num_heads for level in attention_levels):
      raise ValueError(f"`num_heads` must divide the channels of every attention level, "
                       f"got {num_heads=}, {channels=}, {attention_levels=}")
    arguments.check_rates(dropout_rate=dropout_rate)
    stacking.validate_remat_policy(remat_policy)
    arguments.check_callables(attention_fn=attention_fn)
    self.in_channels = in_channels
    self.channels = channels
    self.out_channels = out_channels or in_channels
    self.num_res_blocks = num_res_blocks
    self.attention_levels = attention_levels
    self.num_heads = num_heads
    self.time_embedding_dim = time_embedding_dim or 4 * channels[0]
    self.context_dim = context_dim
    self.dropout_rate = dropout_rate
    self.norm_groups = norm_groups
    self.remat_policy = remat_policy
    self.attention_fn = attention_fn

  @property
  def size_multiple(self) -> int:
    """Heights and widths must be multiples of this number, `2 ** (len(channels) - 1)`."""
    return 2 ** (len(self.channels) - 1)

  def _check_inputs(self, x, t, context):
    if x.ndim != 4 or x.shape[-1] != self.in_channels or 0 in x.shape:
      raise ValueError(f"`x` must be [B, H, W, C_in={self.in_channels}] (NHWC) with B, H, "
                       f"W >= 1, got shape {x.shape}")
    batch, height, width, _ = x.shape
    m = self.size_multiple
    for axis, size in (("height", height), ("width", width)):
      if size % m:
        raise ValueError(
            f"`x` {axis} {size} must be a multiple of {m} (= 2 ** (len(channels) - 1) for "
            f"{len(self.channels)} levels), got x.shape={x.shape}")
    if t is not None and t.shape != (batch,):
      raise ValueError(f"`t` must be a scalar or [B]=({batch},), got shape {t.shape}")
    if self.context_dim is None and context is not None:
      raise ValueError("`context` was given but the UNet was built with context_dim=None")
    if self.context_dim is not None and (
        context is None or context.shape != (batch, self.context_dim)):
      shape = None if context is None else context.shape
      raise ValueError(f"`context` must be [B, D_c]=({batch}, {self.context_dim}) "
                       f"(context_dim={self.context_dim}), got {shape}")

  def __call__(self, x: jax.Array, t: jax.Array | None = None,
               context: jax.Array | None = None, *, is_training: bool = False) -> jax.Array:
    """Predicts from noisy images.

    Args:
      x: [B, H, W, C_in] images, H and W multiples of `size_multiple`.
      t: optional [B] (or scalar) diffusion times (any float scale; the
        sinusoidal embedding expects steps, e.g. in [0, 1000]).
      context: [B, D_c] conditioning vector, required iff `context_dim` is set.
      is_training: enables dropout (with an RNG).

    Returns:
      [B, H, W, C_out] in x's dtype.
    """
    if t is not None:
      t = jnp.asarray(t)
      if t.ndim == 0:
        t = jnp.broadcast_to(t, (x.shape[0],))
    self._check_inputs(x, t, context)

    cond = None  # [B, E]
    if t is not None:
      cond = layers.TimestepEmbedding(self.time_embedding_dim, name="time_embedding")(
          t, x.dtype)
    if context is not None:
      projected = layers.Linear(self.time_embedding_dim, name="context_projection")(
          context.astype(x.dtype))
      cond = projected if cond is None else cond + projected

    def res_block(h, c, name):
      return _maybe_remat(lambda: ResBlock(
          c, norm_groups=self.norm_groups, dropout_rate=self.dropout_rate,
          is_training=is_training, name=name), self.remat_policy)(h, cond)

    def attention_block(h, name):
      return _maybe_remat(lambda: AttentionBlock(
          self.num_heads, norm_groups=self.norm_groups, attention_fn=self.attention_fn,
          name=name), self.remat_policy)(h)

    last = len(self.channels) - 1
    h = Conv2D(self.channels[0], 3, name="conv_in")(x)  # [B, H, W, C_0]
    skips = [h]
    for level, c in enumerate(self.channels):  # [B, H / 2**l, W / 2**l, C_l]
      for i in range(self.num_res_blocks):
        h = res_block(h, c, f"down_{level}_res_{i}")
        if level in self.attention_levels:
          h = attention_block(h, f"down_{level}_attention_{i}")
        skips.append(h)
      if level != last:
        h = Conv2D(c, 3, stride=2, name=f"down_{level}_downsample")(h)
        skips.append(h)

    h = res_block(h, self.channels[last], "middle_res_0")
    if last in self.attention_levels:
      h = attention_block(h, "middle_attention")
    h = res_block(h, self.channels[last], "middle_res_1")

    for level in reversed(range(len(self.channels))):
      c = self.channels[level]
      for i in range(self.num_res_blocks + 1):
        h = jnp.concatenate([h, skips.pop()], axis=-1)  # [B, H_l, W_l, C + C_skip]
        h = res_block(h, c, f"up_{level}_res_{i}")
        if level in self.attention_levels:
          h = attention_block(h, f"up_{level}_attention_{i}")
      if level != 0:
        h = Conv2D(c, 3, name=f"up_{level}_upsample")(upsample_nearest(h))
    assert not skips

    h = jax.nn.silu(GroupNorm(self.norm_groups, name="norm_out")(h))
    return Conv2D(self.out_channels, 3, name="conv_out")(h)  # [B, H, W, C_out]


def diffusion_times(key: jax.Array, batch: int) -> jax.Array:
  """[B] uniform times in [0, 1)."""
  return jax.random.uniform(key, (batch,))


def denoising_loss(apply_fn: Callable[..., jax.Array], params: hk.Params,
                   rng: jax.Array, x0: jax.Array) -> jax.Array:
  """Noise-prediction loss under the cosine variance-preserving schedule.

  `x_t = cos(pi t / 2) x0 + sin(pi t / 2) eps`, t ~ U[0, 1); the model sees
  `(x_t, 1000 t)` and the loss is the float32 mean square error against eps.

  Args:
    apply_fn: `apply_fn(params, rng, x_t, t)` -> [B, H, W, C] noise prediction
      (`hk.Transformed.apply` of a function calling a UNet).
    params: the model's parameters.
    rng: a key, split for t, the noise and the model (dropout).
    x0: [B, H, W, C] clean images; their dtype is the compute dtype.

  Returns:
    The scalar float32 loss.
  """
  t_key, noise_key, model_key = jax.random.split(rng, 3)
  t = diffusion_times(t_key, x0.shape[0])  # [B]
  noise = jax.random.normal(noise_key, x0.shape, jnp.float32)
  angle = (0.5 * math.pi * t)[:, None, None, None]
  x_t = (jnp.cos(angle) * x0.astype(jnp.float32) + jnp.sin(angle) * noise).astype(x0.dtype)
  prediction = apply_fn(params, model_key, x_t, 1000.0 * t)
  return jnp.mean(jnp.square(prediction.astype(jnp.float32) - noise))


def make_train_step(transformed: hk.Transformed, optimizer: optax.GradientTransformation,
                    *, donate: bool = True) -> Callable[..., Any]:
  """A jitted denoising train step, optionally donating params and optimizer state.

  With `donate=True` the step's parameter and optimizer-state outputs reuse the
  input buffers (`donate_argnums=(0, 1)`), so a step holds one copy of them
  instead of two; the caller must not use the inputs after the call.

  Args:
    transformed: `hk.transform` of `f(x_t, t)` calling a UNet (set
      `is_training=True` inside for dropout).
    optimizer: an optax transformation.
    donate: donate the parameter and optimizer-state buffers.

  Returns:
    `step(params, opt_state, rng, x0) -> (params, opt_state, loss)`, jitted.
  """
  def step(params, opt_state, rng, x0):
    loss, grads = jax.value_and_grad(
        lambda p: denoising_loss(transformed.apply, p, rng, x0))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1) if donate else ())
