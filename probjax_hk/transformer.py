"""Transformer: a stack of pre-norm attention + MLP blocks.

Glossary of shapes: B batch, T tokens, D_in input width, D model width,
N query heads, K key/value heads, H = D / N head size, S cache slots,
L layers.

`Transformer(256, 8, 4)` is the standard profile (8 heads of 32).

A causal Transformer decodes through the interface every sequence model
shares: `initial_state(batch_size, max_length)`, `prefill(x, state=None, *,
max_length=None) -> (y, state)` (a prompt in one parallel call) and
`step(x_t, state) -> (y_t, state)`. Its state is a `TransformerState`: a
`KVCache` per layer and the tokens decoded so far per sequence.
"""

from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from probjax_hk import arguments
from probjax_hk import attention
from probjax_hk import layers
from probjax_hk import stacking


def check_model_args(model_dim: int, num_heads: int, num_layers: int,
                     num_kv_heads: int | None, dropout_rate: float,
                     remat_policy: stacking.RematPolicy, scan_unroll: int,
                     widening_factor: int = 4, *,
                     attention_fn: attention.AttentionFn = attention.dot_product_attention,
                     scan_layers: bool = False, use_rope: bool = False) -> None:
  """The constructor checks the Transformer and DiffusionTransformer share."""
  arguments.check_positive_ints(model_dim=model_dim, num_heads=num_heads,
                                num_layers=num_layers, widening_factor=widening_factor,
                                scan_unroll=scan_unroll)
  arguments.check_positive_ints_or_none(num_kv_heads=num_kv_heads)
  if model_dim % num_heads:
    raise ValueError(f"`num_heads` must divide `model_dim`, got {num_heads=} {model_dim=}")
  if num_kv_heads is not None and num_heads % num_kv_heads:
    raise ValueError(f"`num_kv_heads` must divide `num_heads`, got {num_kv_heads=} {num_heads=}")
  arguments.check_rates(dropout_rate=dropout_rate)
  stacking.validate_remat_policy(remat_policy)
  arguments.check_callables(attention_fn=attention_fn)
  arguments.check_bools(scan_layers=scan_layers, use_rope=use_rope)


def dropout(x: jax.Array, rate: float, is_training: bool) -> jax.Array:
  """Dropout only when training with a rate and an RNG (`hk.maybe_next_rng_key`)."""
  if not is_training or rate == 0.0:
    return x
  key = hk.maybe_next_rng_key()
  return x if key is None else hk.dropout(key, rate, x)


class TransformerState(NamedTuple):
  """A causal Transformer's decoding state (`Transformer.initial_state`).

  Attributes:
    caches: one `KVCache` per layer ([B, S, K, H] key and value in the
      model's compute dtype), a list of L; with `scan_layers`, one `KVCache`
      of [L, B, S, K, H] arrays.
    lengths: [B] int32, the tokens each sequence was given so far (the next
      token's position); above `max_length` once its cache overflowed.
  """
  caches: list[attention.KVCache] | attention.KVCache
  lengths: jax.Array

  @property
  def max_length(self) -> int:
    """S, the cache slots per sequence."""
    caches = self.caches if isinstance(self.caches, attention.KVCache) else self.caches[0]
    return caches.key.shape[-3]                                       # [(L,) B, S, K, H]

  @property
  def overflowed(self) -> jax.Array:
    """Which sequences were given more tokens than their cache holds ([B] bool).

    Set under `jit`; eagerly the overflowing call raises. Those sequences'
    outputs are NaN from the overflowing call on.
    """
    return self.lengths > self.max_length


class TransformerBlock(hk.Module):
  """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

  def __init__(self, num_heads: int, *, num_kv_heads: int | None,
               widening_factor: int, attention_fn: attention.AttentionFn,
               is_causal: bool, dropout_rate: float, is_training: bool,
               use_rope: bool, mlp_activation: layers.Activation,
               local_window_size: int | tuple[int, int] | None = None,
               name: str | None = None):
    super().__init__(name=name)
    self.local_window_size = local_window_size
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
    h = self._attention()(
        layers.LayerNorm(name="attention_norm")(x), is_causal=self.is_causal,
        key_value_seq_lengths=key_value_seq_lengths, local_window_size=self.local_window_size)
    x = x + dropout(h, self.dropout_rate, self.is_training)
    return self._mlp(x), key_value_seq_lengths

  @hk.name_like("__call__")
  def prefill(self, x: jax.Array, max_length: int):
    """Causal: [B, T, D] -> ([B, T, D], the layer's `KVCache` of S = max_length)."""
    h, cache = self._attention().prefill(
        layers.LayerNorm(name="attention_norm")(x), max_length,
        local_window_size=self.local_window_size)
    return self._mlp(x + h), cache

  @hk.name_like("__call__")
  def decode(self, x: jax.Array, cache: attention.KVCache, lengths: jax.Array):
    """Causal: [B, T, D] new tokens after `lengths` [B] cached ones -> ([B, T, D], cache)."""
    h, cache = self._attention().decode(
        layers.LayerNorm(name="attention_norm")(x), cache, lengths,
        local_window_size=self.local_window_size)
    return self._mlp(x + h), cache

  @hk.transparent
  def _attention(self):
    return attention.MultiHeadAttention(
        self.num_heads, num_kv_heads=self.num_kv_heads, use_rope=self.use_rope,
        attention_fn=self.attention_fn, name="attention")

  @hk.transparent
  def _mlp(self, x):
    """x + MLP(norm(x)), with dropout when training."""
    h = layers.LayerNorm(name="mlp_norm")(x)
    h = layers.MLP(self.widening_factor * x.shape[-1], activation=self.mlp_activation,
                   name="mlp")(h)
    return x + dropout(h, self.dropout_rate, self.is_training)


class Transformer(hk.Module):
  """A pre-norm Transformer encoder (or decoder with `is_causal=True`).

  Blocks are built through `probjax_hk.stacking.apply_stack`: `remat_policy`
  wraps each in `hk.remat`, `scan_layers=True` builds them with
  `hk.layer_stack` (convert checkpoints with `stack_layer_params` /
  `unstack_layer_params`).

  A causal Transformer decodes through `initial_state`, `prefill` and `step`
  (the user guide: :ref:`decoding-kv-cache`), for example::

      model = Transformer(64, 4, 2, is_causal=True, use_rope=True)
      y, state = model.prefill(prompt, max_length=T + steps)   # [B, T, D_in]
      y_t, state = model.step(x_t, state)                       # [B, D_in]

  with the parameters of `model(x)`, whatever `remat_policy` and
  `scan_layers` are.
  """

  def __init__(self, model_dim: int, num_heads: int, num_layers: int, *,
               num_kv_heads: int | None = None, widening_factor: int = 4,
               attention_fn: attention.AttentionFn = attention.dot_product_attention,
               is_causal: bool = False, dropout_rate: float = 0.0,
               remat_policy: stacking.RematPolicy = None, scan_layers: bool = False,
               scan_unroll: int = 1, use_rope: bool = False,
               mlp_activation: layers.Activation = "gelu",
               local_window_size: int | tuple[int, int] | None = None,
               name: str | None = None):
    """Constructs the Transformer.

    Args:
      model_dim: D, the residual width.
      num_heads: N, query heads; must divide `model_dim`.
      num_layers: number of blocks.
      num_kv_heads: K, key/value heads for GQA (default N).
      widening_factor: MLP hidden width over D.
      attention_fn: `jax.nn.dot_product_attention`-style callable (given
        `local_window_size` when the model has one).
      is_causal: causal self-attention (needed for decoding).
      dropout_rate: residual dropout when training with an RNG.
      remat_policy: None | 'full' | a `jax.checkpoint_policies` name | callable.
      scan_layers: build the blocks with `hk.layer_stack`.
      scan_unroll: `hk.layer_stack`'s unroll with `scan_layers`.
      use_rope: rotary position embedding on queries and keys.
      mlp_activation: 'gelu' or 'swiglu'.
      local_window_size: sliding-window attention, `w` or `(left, right)`:
        token t attends to tokens in [t - left, t + right] (causal: [t - w, t]).
        None attends to all.
      name: module name.

    Raises:
      TypeError: a size that is not an integer, a flag that is not a bool, a
        `dropout_rate` that is not a number or an `attention_fn` that is not
        callable.
      ValueError: a size below 1, `num_heads` not dividing `model_dim` (or
        `num_kv_heads` not dividing `num_heads`), `dropout_rate` outside
        [0, 1), or an unknown `remat_policy`, `mlp_activation` or window.
    """
    arguments.check_name(name)
    super().__init__(name=name)
    check_model_args(model_dim, num_heads, num_layers, num_kv_heads, dropout_rate,
                     remat_policy, scan_unroll, widening_factor, attention_fn=attention_fn,
                     scan_layers=scan_layers, use_rope=use_rope)
    arguments.check_bools(is_causal=is_causal)
    arguments.check_choice("mlp_activation", mlp_activation, layers.ACTIVATIONS)
    attention.check_window(local_window_size)
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
    self.local_window_size = local_window_size

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
    x = self._input_projection(x)                                   # [B, T, D]
    x, _ = stacking.apply_stack(
        lambda name: self._block(name, is_training), self.num_layers,
        (x, key_value_seq_lengths), scan_layers=self.scan_layers,
        remat_policy=self.remat_policy, unroll=self.scan_unroll)
    return layers.LayerNorm(name="final_norm")(x)

  @hk.name_like("__call__")
  def initial_state(self, batch_size: int, max_length: int, *,
                    dtype=jnp.float32) -> TransformerState:
    """The decoding state before the first token: empty caches.

    Args:
      batch_size: B, the number of sequences.
      max_length: S, the most tokens a sequence holds (prompt and generated).
      dtype: the dtype the model computes in (its inputs' dtype).

    Returns:
      A `TransformerState`: L caches of [B, S, K, H] zeros (stacked on a
      leading L axis with `scan_layers`) and lengths [B] of zeros.

    Raises:
      ValueError: for a model that is not causal or a size that is not a
        positive int.
    """
    self._check_decodable()
    arguments.check_positive_ints(batch_size=batch_size, max_length=max_length)
    cache = self._attention_layer().initial_cache(batch_size, max_length, self.model_dim,
                                                  dtype)
    if self.scan_layers:
      caches = jax.tree.map(lambda c: jnp.stack([c] * self.num_layers), cache)
    else:
      caches = [cache] * self.num_layers
    return TransformerState(caches, jnp.zeros((batch_size,), jnp.int32))

  @hk.name_like("__call__")
  def prefill(self, x: jax.Array, state: TransformerState | None = None, *,
              max_length: int | None = None, lengths: jax.Array | None = None
              ) -> tuple[jax.Array, TransformerState]:
    """Runs a prompt (or the next chunk of one) in one parallel call.

    Without `state`, the output is `__call__(x)` (the same attention
    function, so the fused kernels on a GPU) and the caches hold x's keys
    and values. With `state`, x's tokens follow the state's and attend to
    its caches (`probjax_hk.attention.cached_attention`), as T calls of
    `step` would.

    With `lengths`, x holds right-padded sequences of different lengths:
    sequence b's tokens are x[b, :lengths[b]], its state continues after
    them (the next token goes to slot `lengths[b]`, over the padding's), and
    its outputs past them are unspecified. The padding never reaches the
    valid outputs (attention is causal), nor later steps (slots past a
    sequence's length are not attended to).

    Args:
      x: [B, T, D_in], the next T tokens of each sequence.
      state: None (x starts the sequences), or a `TransformerState` from
        `initial_state`, `prefill` or `step`.
      max_length: S, the cache size; required without `state` (and at least
        T), None or the state's S with it.
      lengths: None (all T tokens of every sequence) or [B] ints in [0, T],
        the valid tokens of each (checked when concrete, clipped when
        traced). The cache needs room for all T while they run.

    Returns:
      (y [B, T, D] in x's dtype, the state after x's tokens).

    Raises:
      ValueError: for a model that is not causal, x that is not [B, T, D_in],
        a missing or too short `max_length`, `lengths` that is not [B]
        integers in [0, T], or a state that does not fit x, or whose concrete
        lengths leave fewer than T free slots. Under `jit` a sequence x
        overflows gets NaN outputs and `state.overflowed`.
    """
    self._check_decodable()
    layers.check_tokens(x)
    if lengths is not None:
      lengths, valid = layers.sequence_mask(lengths, x)
      # Finite padding: a NaN key in a slot nobody attends to still makes 0 * NaN.
      x = jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))
    if state is None:
      if max_length is None:
        raise ValueError("`max_length` (the cache size) is required when `state` is None")
      arguments.check_positive_ints(max_length=max_length)
      if max_length < x.shape[1]:
        raise ValueError(f"`max_length` must be >= the prompt's T={x.shape[1]}, "
                         f"got {max_length=}")
      h = self._input_projection(x)
      h, caches = stacking.apply_stack_with_states(
          lambda name: _ignore_state(self._block(name, False).prefill, max_length),
          self.num_layers, h, None, scan_layers=self.scan_layers, unroll=self.scan_unroll)
      if lengths is None:
        lengths = jnp.full((x.shape[0],), x.shape[1], jnp.int32)
      return layers.LayerNorm(name="final_norm")(h), TransformerState(caches, lengths)
    slots = self._check_state(state, x)
    if max_length is not None and max_length != slots:
      raise ValueError(f"`max_length` must be None or the state's cache size {slots} "
                       f"when `state` is given, got {max_length=}")
    return self._decode(x, state, lengths)

  @hk.name_like("__call__")
  def step(self, x_t: jax.Array, state: TransformerState
           ) -> tuple[jax.Array, TransformerState]:
    """One decoding step.

    Args:
      x_t: [B, D_in], each sequence's next token.
      state: a `TransformerState` (`initial_state`, `prefill` or `step`);
        its sequences must have room (lengths < S).

    Returns:
      (y_t [B, D] in x_t's dtype, the state after x_t).

    Raises:
      ValueError: for a model that is not causal, x_t that is not [B, D_in],
        or a state that does not fit x_t, or whose concrete lengths fill its
        cache. Under `jit` a sequence with a full cache gets a NaN y_t and
        `state.overflowed`.
    """
    self._check_decodable()
    if x_t.ndim != 2:
      raise ValueError(f"`x_t` must be [B, D_in], got shape {x_t.shape}")
    self._check_state(state, x_t[:, None])
    y, state = self._decode(x_t[:, None], state)
    return y[:, 0], state

  @hk.transparent
  def _decode(self, x, state, new_tokens=None):
    """x [B, T, D_in] after the state's tokens -> (y [B, T, D], state); NaN
    rows for the sequences whose cache x overflows. `new_tokens` [B]: the
    valid ones of x's T (default all)."""
    time, slots = x.shape[1], state.max_length
    overflow = state.lengths + time > slots                            # [B]
    # An overflowing sequence writes its last slots instead, so every attention
    # implementation gets lengths it supports; its outputs are NaN below.
    lengths = jnp.where(overflow, slots - time, state.lengths)
    h = self._input_projection(x)
    h, caches = stacking.apply_stack_with_states(
        lambda name: _with_lengths(self._block(name, False).decode, lengths),
        self.num_layers, h, state.caches, scan_layers=self.scan_layers,
        unroll=self.scan_unroll)
    y = jnp.where(overflow[:, None, None], jnp.nan, layers.LayerNorm(name="final_norm")(h))
    if new_tokens is not None:  # An overflowing sequence still counts all T: it shows.
      time = jnp.where(overflow, time, new_tokens)
    return y, TransformerState(caches, state.lengths + time)

  @hk.transparent
  def _input_projection(self, x):
    if x.shape[-1] == self.model_dim:
      return x
    return layers.Linear(self.model_dim, name="input_projection")(x)

  @hk.transparent
  def _block(self, name, is_training):
    return TransformerBlock(
        self.num_heads, num_kv_heads=self.num_kv_heads,
        widening_factor=self.widening_factor, attention_fn=self.attention_fn,
        is_causal=self.is_causal, dropout_rate=self.dropout_rate,
        is_training=is_training, use_rope=self.use_rope,
        mlp_activation=self.mlp_activation, local_window_size=self.local_window_size,
        name=name)

  @hk.transparent
  def _attention_layer(self):
    """An attention module like the blocks' (its cache shapes; no parameters)."""
    return attention.MultiHeadAttention(self.num_heads, num_kv_heads=self.num_kv_heads,
                                        name="attention")

  def _check_decodable(self):
    if not self.is_causal:
      raise ValueError("Only a causal Transformer (`is_causal=True`) decodes: a "
                       "bidirectional one needs the future")

  def _check_state(self, state, x) -> int:
    """`state` must be a `TransformerState` for x's batch and dtype; returns S."""
    if not isinstance(state, TransformerState):
      raise ValueError(f"`state` must be a TransformerState (`initial_state`, `prefill` "
                       f"or `step`), got {type(state).__name__}")
    batch = x.shape[0]
    if state.lengths.shape != (batch,):
      raise ValueError(f"`state.lengths` must be [B]=({batch},), got {state.lengths.shape}")
    if self.scan_layers:
      caches = [state.caches] if isinstance(state.caches, attention.KVCache) else None
      lead = (self.num_layers,)
    else:
      caches = state.caches if (isinstance(state.caches, (list, tuple))
                                and len(state.caches) == self.num_layers) else None
      lead = ()
    if caches is None:
      layout = (f"one KVCache stacked on a leading axis of num_layers={self.num_layers}"
                if self.scan_layers else f"a list of num_layers={self.num_layers} KVCaches")
      raise ValueError(f"`state.caches` must be {layout} (scan_layers={self.scan_layers})")
    arrays = [a for c in caches for a in c]
    slots = arrays[0].shape[len(lead) + 1] if arrays[0].ndim == len(lead) + 4 else "S"
    want = (*lead, batch, slots, self.num_kv_heads or self.num_heads,
            self.model_dim // self.num_heads)
    if any(a.shape != want for a in arrays):
      raise ValueError(f"`state.caches` must hold {'[L, ' if lead else '['}B, S, K, H] = "
                       f"{want} arrays, got shapes {sorted({a.shape for a in arrays})}")
    if any(a.dtype != x.dtype for a in arrays):
      raise ValueError(f"`state` caches are {arrays[0].dtype} but the input is {x.dtype}; "
                       f"build the state with `initial_state(..., dtype={x.dtype})`")
    _check_room(state.lengths, x.shape[1], slots)
    return slots


def _check_room(lengths, time: int, slots: int) -> None:
  """Concrete `lengths` [B] must leave `time` of the `slots` free (a traced
  overflow shows in `TransformerState.overflowed`)."""
  if isinstance(lengths, jax.core.Tracer):
    return
  lengths = np.asarray(lengths)
  if lengths.min() < 0:
    raise ValueError(f"`state.lengths` must be >= 0, got {lengths.tolist()}")
  if lengths.max() + time > slots:
    raise ValueError(
        f"the cache of `state` is full: {time} new token(s) per sequence after "
        f"`state.lengths` up to {lengths.max()} exceed its max_length={slots} slots; "
        f"start from a state with a larger `max_length`")


def _ignore_state(block_fn, *args):
  """A `(x, state) -> (x, state)` block for `apply_stack_with_states` from
  `block_fn(x, *args)`, which builds the state (given state: None)."""
  return lambda x, state: block_fn(x, *args)


def _with_lengths(block_fn, lengths):
  """A `(x, cache) -> (x, cache)` block from `block_fn(x, cache, lengths)`."""
  return lambda x, cache: block_fn(x, cache, lengths)
