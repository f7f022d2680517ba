"""Small blocks shared by the models: linear, norms, MLP, adaLN, embeddings.

Glossary of shapes: B batch, T time/tokens, D width, F hidden width.

Parameters are float32; each block computes in its input's dtype (bf16 in,
bf16 out), with norms and softmax-like reductions accumulated in float32.
"""

import math
from collections.abc import Sequence
from typing import Literal

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from probjax_hk import arguments
from probjax_hk import lean_backward

Activation = Literal["gelu", "swiglu"]
ACTIVATIONS = ("gelu", "swiglu")


def check_tokens(x: jax.Array, name: str = "x") -> None:
  """A sequence model's input must be [B, T, D] with no empty axis (a
  ValueError naming `name` and the axis), as the ops and `initial_state`
  require B >= 1 and T >= 1."""
  if x.ndim != 3:
    raise ValueError(f"`{name}` must be [B, T, D], got rank {x.ndim} with shape {x.shape}")
  for axis, size in zip("BTD", x.shape):
    if size < 1:
      raise ValueError(f"`{name}` must be [B, T, D] with {axis} >= 1, got {axis}={size} "
                       f"in shape {x.shape}")


def check_lengths(lengths, batch: int, name: str = "lengths") -> jax.Array:
  """`lengths` as int32 [B]; a ValueError naming it unless it is [B] integers
  (a float is refused, not truncated)."""
  lengths = jnp.asarray(lengths)
  if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"`{name}` must be [B]=({batch},) integers, got shape "
                     f"{lengths.shape} and dtype {lengths.dtype}")
  return lengths.astype(jnp.int32)


def sequence_mask(lengths, x: jax.Array, name: str = "lengths") -> tuple[jax.Array, jax.Array]:
  """The valid steps of right-padded sequences x [B, T, ...].

  Args:
    lengths: [B] integers in [0, T], the valid steps of each sequence
      (checked when concrete; traced ones are clipped to [0, T]).
    x: [B, T, ...], the padded sequences.
    name: the argument named in errors.

  Returns:
    (lengths [B] int32, mask [B, T] bool: step t of sequence b is valid).

  Raises:
    ValueError: for `lengths` that is not [B] integers, or concrete values
      outside [0, T].
  """
  batch, time = x.shape[:2]
  lengths = check_lengths(lengths, batch, name)
  if not isinstance(lengths, jax.core.Tracer):
    values = np.asarray(lengths)
    if values.min() < 0 or values.max() > time:
      raise ValueError(f"`{name}` must lie in [0, T={time}], got {values.tolist()}")
  lengths = jnp.clip(lengths, 0, time)
  return lengths, jnp.arange(time) < lengths[:, None]


def _typed_spec(x: jax.Array) -> jax.sharding.PartitionSpec | None:
  """x's layout over Explicit mesh axes, from its type (None: no mesh)."""
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return spec if spec is not None and len(spec) == x.ndim else None


def last_axis_split(x: jax.Array) -> tuple[tuple[str, ...], int]:
  """The Explicit mesh axes x's last axis is split over, from its type, and
  their number of devices: ((), 1) when it is whole."""
  spec = _typed_spec(x)
  entry = spec[-1] if spec else None
  if entry is None:
    return (), 1
  axes = entry if isinstance(entry, tuple) else (entry,)
  return axes, math.prod(jax.typeof(x).sharding.mesh.shape[a] for a in axes)


def summed_sharding(x: jax.Array) -> jax.sharding.PartitionSpec | None:
  """Where a product contracting x's last axis [..., D_in] puts its output.

  None (JAX's rule) unless that axis is split over Explicit mesh axes, as
  the heads or hidden units entering a row-split weight are under tensor
  parallelism; then x's spec with the last axis whole: each device's
  partial sums are all-reduced, and the weight is never gathered.
  """
  if not last_axis_split(x)[0]:
    return None
  return jax.sharding.PartitionSpec(*_typed_spec(x)[:-1], None)


class Linear(hk.Module):
  """`y = x @ w + b` with float32 parameters cast to the input's dtype.

  (`hk.Linear` creates its parameters in the input's dtype, which would make
  a bf16 forward pass create bf16 parameters.)
  """

  def __init__(self, output_size: int, *, with_bias: bool = True,
               w_init: hk.initializers.Initializer | None = None,
               b_init: hk.initializers.Initializer | None = None,
               name: str | None = None):
    """Constructs the layer.

    Args:
      output_size: the output width, an integer >= 1.
      with_bias: add a bias `b` of shape [output_size].
      w_init: initializer of the [D_in, output_size] weight; None draws from
        a truncated normal of stddev `1 / sqrt(D_in)`.
      b_init: initializer of the bias; None gives zeros.
      name: module name.

    Raises:
      TypeError: `output_size` is not an integer, `with_bias` not a bool, or
        an initializer neither None nor callable.
      ValueError: `output_size` is below 1.
    """
    arguments.check_name(name)
    super().__init__(name=name)
    arguments.check_positive_ints(output_size=output_size)
    arguments.check_bools(with_bias=with_bias)
    arguments.check_callables_or_none(w_init=w_init, b_init=b_init)
    self.output_size = output_size
    self.with_bias = with_bias
    self.w_init = w_init
    self.b_init = b_init or jnp.zeros

  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the layer: [..., D_in] -> [..., output_size].

    Args:
      x: [..., D_in], any float dtype.

    Returns:
      [..., output_size] in `x`'s dtype.
    """
    w, b = self.parameters(x.shape[-1])
    y = jnp.dot(x, w.astype(x.dtype), out_sharding=summed_sharding(x))
    return y if b is None else y + b.astype(x.dtype)

  def parameters(self, input_size: int) -> tuple[jax.Array, jax.Array | None]:
    """The float32 weight [input_size, output_size] and bias [output_size]
    (None without one), created on first use."""
    w_init = self.w_init or hk.initializers.TruncatedNormal(1.0 / math.sqrt(input_size))
    w = hk.get_parameter("w", [input_size, self.output_size], jnp.float32, init=w_init)
    if not self.with_bias:
      return w, None
    return w, hk.get_parameter("b", [self.output_size], jnp.float32, init=self.b_init)


def shared_input(x: jax.Array, linears: Sequence[Linear]) -> list[jax.Array]:
  """`[linear(x) for linear in linears]`, as one product where the layers have
  one output size and their weights are split alike along it over Explicit
  mesh axes while x's last axis is whole (tensor parallelism's query, key and
  value projections): the backward then all-reduces x's gradient once,
  summed over the layers, instead of once per layer.

  Args:
    x: [..., D_in].
    linears: `Linear`s taking x.

  Returns:
    Each layer's [..., output_size] in `x`'s dtype.
  """
  params = [linear.parameters(x.shape[-1]) for linear in linears]
  specs = {str(_typed_spec(w)) for w, _ in params}
  if (len(linears) < 2 or len(specs) != 1 or len({w.shape for w, _ in params}) != 1
      or not last_axis_split(params[0][0])[0] or last_axis_split(x)[0]):
    return [linear(x) for linear in linears]
  ys = jnp.einsum("...d,gdh->g...h", x, jnp.stack([w.astype(x.dtype) for w, _ in params]))
  return [y if b is None else y + b.astype(x.dtype) for y, (_, b) in zip(ys, params)]


class RMSNorm(hk.Module):
  """Root-mean-square norm over the last axis, computed in float32."""

  def __init__(self, *, eps: float = 1e-6, create_scale: bool = True,
               name: str | None = None):
    """Constructs the norm.

    Args:
      eps: added to the mean square before its reciprocal square root.
      create_scale: learn a per-feature scale of shape [D], initialized to
        ones; False leaves `x / rms(x)` unscaled.
      name: module name.

    Raises:
      TypeError: `eps` is not a number or `create_scale` not a bool.
      ValueError: `eps` is negative or not finite.
    """
    arguments.check_name(name)
    super().__init__(name=name)
    arguments.check_nonnegative_numbers(eps=eps)
    arguments.check_bools(create_scale=create_scale)
    self.eps = eps
    self.create_scale = create_scale

  def __call__(self, x: jax.Array) -> jax.Array:
    """Normalizes the last axis: [..., D] -> [..., D].

    Args:
      x: [..., D], any float dtype.

    Returns:
      [..., D] in `x`'s dtype.
    """
    scale = (hk.get_parameter("scale", [x.shape[-1]], jnp.float32, init=jnp.ones)
             if self.create_scale else None)
    return lean_backward.rms_norm(x, scale, self.eps)


class LayerNorm(hk.Module):
  """Layer norm over the last axis, computed in float32.

  With `create_scale=create_offset=False` it is the parameter-free norm that
  adaLN modulation follows.
  """

  def __init__(self, *, eps: float = 1e-6, create_scale: bool = True,
               create_offset: bool = True, name: str | None = None):
    """Constructs the norm.

    Args:
      eps: added to the variance before its reciprocal square root.
      create_scale: learn a per-feature scale of shape [D], initialized to
        ones.
      create_offset: learn a per-feature offset of shape [D], initialized to
        zeros.
      name: module name.

    Raises:
      TypeError: `eps` is not a number, or a `create_*` flag not a bool.
      ValueError: `eps` is negative or not finite.
    """
    arguments.check_name(name)
    super().__init__(name=name)
    arguments.check_nonnegative_numbers(eps=eps)
    arguments.check_bools(create_scale=create_scale, create_offset=create_offset)
    self.eps = eps
    self.create_scale = create_scale
    self.create_offset = create_offset

  def __call__(self, x: jax.Array) -> jax.Array:
    """Normalizes the last axis: [..., D] -> [..., D].

    Args:
      x: [..., D], any float dtype.

    Returns:
      [..., D] in `x`'s dtype.
    """
    scale = (hk.get_parameter("scale", [x.shape[-1]], jnp.float32, init=jnp.ones)
             if self.create_scale else None)
    offset = (hk.get_parameter("offset", [x.shape[-1]], jnp.float32, init=jnp.zeros)
              if self.create_offset else None)
    return lean_backward.layer_norm(x, scale, offset, self.eps)


class MLP(hk.Module):
  """Two-layer feed-forward block: GELU, or SwiGLU (`silu(x W) * (x V)`)."""

  def __init__(self, hidden_dim: int, *, output_dim: int | None = None,
               activation: Activation = "gelu", name: str | None = None):
    """Constructs the block.

    Args:
      hidden_dim: F, the hidden width, an integer >= 1.
      output_dim: the output width, an integer >= 1; None keeps the input
        width D.
      activation: 'gelu' (`gelu(x W_in + b_in) W_out + b_out`) or 'swiglu'
        (one bias-free [D, 2F] input projection split into gate and value,
        `(silu(gate) * value) W_out`, no biases).
      name: module name.

    Raises:
      TypeError: `hidden_dim` or `output_dim` is not an integer.
      ValueError: `activation` is neither 'gelu' nor 'swiglu', or
        `hidden_dim` or `output_dim` is below 1.
    """
    arguments.check_name(name)
    super().__init__(name=name)
    arguments.check_choice("activation", activation, ACTIVATIONS)
    arguments.check_positive_ints(hidden_dim=hidden_dim)
    arguments.check_positive_ints_or_none(output_dim=output_dim)
    self.hidden_dim = hidden_dim
    self.output_dim = output_dim
    self.activation = activation

  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the block: [..., D] -> [..., output_dim or D].

    Args:
      x: [..., D], any float dtype.

    Returns:
      [..., output_dim], or [..., D] without `output_dim`, in `x`'s dtype.
    """
    output_dim = self.output_dim or x.shape[-1]
    if self.activation == "swiglu":
      gate_and_value = Linear(2 * self.hidden_dim, with_bias=False, name="w_in")(x)
      axes, devices = last_axis_split(gate_and_value)
      if axes:
        raise ValueError(
            f"parameter '{self.module_name}/w_in/w' of MLP(activation='swiglu') splits its"
            f" [D, 2F] columns over mesh axes {axes} ({devices} devices), but its first and"
            f" second halves are the gate and the value of the same hidden units, which"
            f" such a split does not keep together: use activation='gelu' for tensor"
            f" parallelism, or keep w_in and w_out whole")
      gate, value = jnp.split(gate_and_value, 2, axis=-1)
      h = jax.nn.silu(gate) * value
    else:
      h = lean_backward.gelu(Linear(self.hidden_dim, name="w_in")(x))
    return Linear(output_dim, with_bias=self.activation == "gelu", name="w_out")(h)


class AdaLNModulation(hk.Module):
  """adaLN-Zero: `num_chunks` vectors regressed from a conditioning vector.

  The projection starts at zero, so every gate starts closed and each block
  starts as the identity (Peebles & Xie 2023, https://arxiv.org/abs/2212.09748).
  """

  def __init__(self, model_dim: int, num_chunks: int, *, name: str | None = None):
    """Constructs the modulation.

    Args:
      model_dim: D, the width of each vector, an integer >= 1.
      num_chunks: how many vectors, an integer >= 1 (6 in a DiT block: shift,
        scale and gate before attention and before the MLP).
      name: module name.

    Raises:
      TypeError: `model_dim` or `num_chunks` is not an integer.
      ValueError: `model_dim` or `num_chunks` is below 1.
    """
    arguments.check_name(name)
    super().__init__(name=name)
    arguments.check_positive_ints(model_dim=model_dim, num_chunks=num_chunks)
    self.model_dim = model_dim
    self.num_chunks = num_chunks

  def __call__(self, cond: jax.Array) -> list[jax.Array]:
    """Regresses the vectors: [B, C] -> num_chunks arrays of [B, 1, model_dim].

    Args:
      cond: [B, C] conditioning vector (e.g. a timestep embedding), any
        float dtype.

    Returns:
      A list of `num_chunks` arrays of [B, 1, model_dim] in `cond`'s dtype,
      the singleton axis broadcasting over the tokens; all zeros at
      initialization.
    """
    out = Linear(self.num_chunks * self.model_dim, w_init=jnp.zeros,
                 name="projection")(jax.nn.silu(cond))
    return [c[:, None, :] for c in jnp.split(out, self.num_chunks, axis=-1)]


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
  """adaLN's affine modulation: `x * (1 + scale) + shift`.

  Args:
    x: [B, T, D] normalized activations.
    shift: [B, 1, D] (or any shape broadcasting against `x`), e.g. a chunk
      of `AdaLNModulation`.
    scale: [B, 1, D], likewise; zero leaves `x` unscaled.

  Returns:
    [B, T, D] in `x`'s dtype (`shift` and `scale` are cast to it).

  Raises:
    ValueError: `x` is not floating point, or `shift` or `scale` does not
      broadcast to its shape.
  """
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise ValueError(f"`x` must be a floating-point array, got dtype {jnp.result_type(x)}")
  for arg, a in (("shift", shift), ("scale", scale)):
    try:
      fits = np.broadcast_shapes(jnp.shape(a), jnp.shape(x)) == jnp.shape(x)
    except ValueError:
      fits = False
    if not fits:
      raise ValueError(f"`{arg}` must broadcast to x's shape {jnp.shape(x)}, got shape "
                       f"{jnp.shape(a)}")
  return x * (1 + scale.astype(x.dtype)) + shift.astype(x.dtype)


def sinusoidal_embedding(t: jax.Array, dim: int, *, max_period: float = 10_000.0) -> jax.Array:
  """Sinusoidal embedding of scalar times (as in DDPM and DiT).

  Args:
    t: [B] times (any float scale; diffusion steps or [0, 1]).
    dim: embedding width (even).
    max_period: the longest wavelength.

  Returns:
    [B, dim] float32 embedding, cosines then sines.

  Raises:
    TypeError: `dim` is not an integer or `max_period` not a number.
    ValueError: `dim` is odd or below 2, `max_period` not positive, or `t`
      not [B].
  """
  arguments.check_positive_ints(dim=dim)
  if dim < 2 or dim % 2:
    raise ValueError(f"`dim` must be even and >= 2, got {dim=}")
  arguments.check_positive_numbers(max_period=max_period)
  if t.ndim != 1:
    raise ValueError(f"`t` must be [B], got shape {t.shape}")
  half = dim // 2
  freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
  angles = t.astype(jnp.float32)[:, None] * freqs[None, :]
  return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


class TimestepEmbedding(hk.Module):
  """Sinusoidal features of `t` followed by a two-layer SiLU MLP."""

  def __init__(self, dim: int, *, frequency_dim: int = 256, name: str | None = None):
    """Constructs the embedding.

    Args:
      dim: the output width, and that of the MLP's hidden layer, an integer
        >= 1.
      frequency_dim: the width of the sinusoidal features
        (`sinusoidal_embedding`'s `dim`), even and >= 2.
      name: module name.

    Raises:
      TypeError: `dim` or `frequency_dim` is not an integer.
      ValueError: `dim` is below 1, or `frequency_dim` is odd or below 2.
    """
    arguments.check_name(name)
    super().__init__(name=name)
    arguments.check_positive_ints(dim=dim, frequency_dim=frequency_dim)
    if frequency_dim < 2 or frequency_dim % 2:
      raise ValueError(f"`frequency_dim` must be even and >= 2, got {frequency_dim=}")
    self.dim = dim
    self.frequency_dim = frequency_dim

  def __call__(self, t: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Embeds the times: [B] -> [B, dim] in `dtype`.

    Args:
      t: [B] times, on the scale of diffusion steps (0 to 1000 in DDPM).
      dtype: the dtype of the MLP's computation and of the output.

    Returns:
      [B, dim] in `dtype`.

    Raises:
      ValueError: `t` is not [B].
    """
    h = sinusoidal_embedding(t, self.frequency_dim).astype(dtype)
    h = jax.nn.silu(Linear(self.dim, name="linear_1")(h))
    return Linear(self.dim, name="linear_2")(h)


def rotary_embedding(x: jax.Array, positions: jax.Array, *, base: float = 10_000.0) -> jax.Array:
  """Rotary position embedding (Su et al. 2021) on the last axis.

  Args:
    x: [B, T, N, H] queries or keys, H even.
    positions: [T] or [B, T] integer positions.
    base: the rotation base.

  Returns:
    [B, T, N, H], the pairs ``(x[..., :H/2], x[..., H/2:])`` rotated by position.

  Raises:
    ValueError: `x` is not [B, T, N, H] with H even, `positions` not [T] or
      [B, T], or `base` not a positive number (a TypeError if not a number).
  """
  if x.ndim != 4:
    raise ValueError(f"`x` must be [B, T, N, H], got shape {x.shape}")
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"`x` must have an even head size H for the rotary embedding, "
                     f"got {head_dim=}")
  arguments.check_positive_numbers(base=base)
  batch, seq_len = x.shape[:2]
  if positions.shape not in ((seq_len,), (1, seq_len), (batch, seq_len)):
    raise ValueError(f"`positions` must be [T]=({seq_len},) or [B, T]=({batch}, {seq_len}), "
                     f"got shape {positions.shape}")
  half = head_dim // 2
  freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[..., None] * freqs  # [(B,) T, H/2]
  if angles.ndim == 2:
    angles = angles[None]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
