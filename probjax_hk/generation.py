"""Autoregressive generation: `TokenModel` (tokens in, logits out) and `generate`.

Glossary of shapes: B batch, T prompt tokens, G generated tokens, V vocabulary,
E embedding width.

Every sequence model of the library decodes through one interface:
`initial_state(batch_size, max_length)`, `prefill(x, state=None, *,
max_length=None) -> (y, state)` (a prompt in one parallel call) and
`step(x_t, state) -> (y_t, state)`. `TokenModel` puts an embedding in front of
such a model and a vocabulary projection behind it; `generate` runs the prefill
and then every step inside one compiled call:

    import haiku as hk
    import jax
    import probjax_hk as pk

    def model_fn():
      return pk.TokenModel(
          pk.Transformer(64, 4, 2, is_causal=True, use_rope=True), vocab_size=256)

    forward = hk.transform(lambda tokens: model_fn()(tokens))   # [B, T] -> [B, T, 256]
    params = forward.init(jax.random.key(0), prompt)            # or trained with fit()
    tokens = pk.generate(model_fn, params, prompt, 64, rng=jax.random.key(1),
                         temperature=0.8, top_k=40)             # [B, 64] int32

`model_fn` builds the same modules as the training forward pass, so the
parameters fit; an `SSMModel` body works the same way.

A token outside [0, V) raises a ValueError where the tokens are concrete; a
traced one embeds as NaN, so its logits are NaN, and `generate` returns -1 for
a token drawn from NaN logits (and raises when it runs eagerly).
"""

import functools
import numbers
from typing import Any, Callable

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from probjax_hk import arguments
from probjax_hk import layers


def _check_token_array(name: str, tokens, ndim: int) -> None:
  shape = "[B, T]" if ndim == 2 else "[B]"
  if jnp.ndim(tokens) != ndim or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(f"`{name}` must be {shape} integer tokens, got shape "
                     f"{jnp.shape(tokens)} and dtype {jnp.result_type(tokens)}")


def _check_token_values(name: str, tokens, vocab_size: int | None) -> None:
  """Concrete tokens must lie in [0, vocab_size) ([0, inf) for None); traced
  ones are left to the NaN embedding."""
  if isinstance(tokens, jax.core.Tracer) or not jnp.size(tokens):
    return
  values = np.asarray(tokens)
  lo, hi = int(values.min()), int(values.max())
  if lo < 0 or (vocab_size is not None and hi >= vocab_size):
    limit = "" if vocab_size is None else f", {vocab_size=}"
    raise ValueError(f"`{name}` must lie in [0, vocab_size){limit}, got values in "
                     f"[{lo}, {hi}]")


class TokenModel(hk.Module):
  """A sequence model over discrete tokens: an embedding in, logits out.

  ::

      logits = Linear(vocab_size)(body(embedding[tokens]))

  `body` is any sequence model of the library (a causal `Transformer`, an
  `SSMModel`), or any module with the decoding interface (see the module
  docstring); `TokenModel` has the same interface over tokens, which is what
  `generate` drives.
  """

  def __init__(self, body: Any, vocab_size: int, *, embed_dim: int | None = None,
               name: str | None = None):
    """Constructs the model.

    Args:
      body: the sequence model, [B, T, E] -> [B, T, D]; for decoding it must
        have `initial_state`, `prefill` and `step`.
      vocab_size: V, the number of tokens.
      embed_dim: E, the embedding width; default the body's `input_dim`
        (SSMModel) or `model_dim` (Transformer).
      name: module name.

    Raises:
      TypeError: for a size that is not an integer or a `body` that is not
        callable.
      ValueError: for a size below 1, or no `embed_dim` for a body that has
        neither `input_dim` nor `model_dim`.
    """
    arguments.check_name(name)
    super().__init__(name=name)
    arguments.check_callables(body=body)
    if embed_dim is None:
      embed_dim = getattr(body, "input_dim", None) or getattr(body, "model_dim", None)
      if embed_dim is None:
        raise ValueError("`embed_dim` is required for a body without `input_dim` or "
                         f"`model_dim`, got body={type(body).__name__}")
    arguments.check_positive_ints(vocab_size=vocab_size, embed_dim=embed_dim)
    self.body = body
    self.vocab_size = vocab_size
    self.embed_dim = embed_dim

  def __call__(self, tokens: jax.Array, **kwargs) -> jax.Array:
    """The sequence path.

    Args:
      tokens: [B, T] integers in [0, V) (checked when concrete; a traced
        token outside embeds as NaN).
      **kwargs: passed to the body (e.g. `is_training=True`).

    Returns:
      [B, T, V] logits.
    """
    self._check_tokens(tokens, 2)
    return self._logits(self.body(self._embed(tokens), **kwargs))

  @hk.name_like("__call__")
  def initial_state(self, batch_size: int, max_length: int | None = None):
    """The body's decoding state before the first token.

    Args:
      batch_size: B, the number of sequences.
      max_length: the most tokens a sequence holds, prompt included (the
        Transformer's cache size; an SSM ignores it).

    Returns:
      The body's state.
    """
    return self.body.initial_state(batch_size, max_length)

  @hk.name_like("__call__")
  def prefill(self, tokens: jax.Array, state=None, *, max_length: int | None = None):
    """Runs a prompt in one parallel call.

    Args:
      tokens: [B, T] integers in [0, V), the next T tokens of each sequence.
      state: None (the tokens start the sequences) or a state of
        `initial_state`, `prefill` or `step`.
      max_length: the most tokens a sequence will hold (needed by a
        Transformer body when `state` is None).

    Returns:
      (logits [B, T, V], the state after the tokens).
    """
    self._check_tokens(tokens, 2)
    y, state = self.body.prefill(self._embed(tokens), state, max_length=max_length)
    return self._logits(y), state

  @hk.name_like("__call__")
  def step(self, tokens: jax.Array, state):
    """One decoding step.

    Args:
      tokens: [B] integers in [0, V), each sequence's next token.
      state: a state of `initial_state`, `prefill` or `step`.

    Returns:
      (logits [B, V] of the token after it, the state).
    """
    self._check_tokens(tokens, 1)
    y, state = self.body.step(self._embed(tokens), state)
    return self._logits(y), state

  def _check_tokens(self, tokens, ndim: int) -> None:
    _check_token_array("tokens", tokens, ndim)
    _check_token_values("tokens", tokens, self.vocab_size)

  @hk.transparent
  def _embed(self, tokens):
    """[...] ints -> [..., E] float32; NaN rows for tokens outside [0, V)."""
    table = hk.get_parameter("embeddings", [self.vocab_size, self.embed_dim], jnp.float32,
                             init=hk.initializers.TruncatedNormal())
    valid = (tokens >= 0) & (tokens < self.vocab_size)
    # NaN rather than a wrapped (-1 -> V - 1) or clipped row: the logits show it.
    return jnp.where(valid[..., None], jnp.take(table, tokens, axis=0, mode="clip"), jnp.nan)

  @hk.transparent
  def _logits(self, y):
    return layers.Linear(self.vocab_size, name="logits")(y)


def _sample(logits, key, temperature, *, greedy: bool, top_k: int | None):
  """[B, V] logits -> [B] int32 tokens; -1 where a row holds a NaN."""
  logits = logits.astype(jnp.float32)
  if greedy:
    tokens = jnp.argmax(logits, axis=-1)
  else:
    if top_k is not None:
      kth = jax.lax.top_k(logits, top_k)[0][:, -1:]                   # [B, 1]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    tokens = jax.random.categorical(key, logits / temperature, axis=-1)
  # Fed back, -1 embeds as NaN again: a sequence stays marked once marked.
  return jnp.where(jnp.isnan(logits).any(axis=-1), -1, tokens).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("model_fn", "num_tokens", "greedy", "top_k"))
def _generate(params, prompt, rng, temperature, *, model_fn, num_tokens, greedy, top_k):
  """The whole loop, compiled once per model_fn, shapes and static options."""
  max_length = prompt.shape[1] + num_tokens - 1  # The last token is never fed back.
  prefill = hk.transform(
      lambda tokens: model_fn().prefill(tokens, max_length=max_length)).apply
  step = hk.transform(lambda tokens, state: model_fn().step(tokens, state)).apply
  logits, state = prefill(params, None, prompt)                       # [B, T, V]
  vocab_size = logits.shape[-1]
  if top_k is not None and top_k > vocab_size:
    raise ValueError(f"`top_k` must be at most the vocabulary size {vocab_size}, got {top_k=}")
  sample = functools.partial(_sample, temperature=temperature, greedy=greedy, top_k=top_k)
  keys = None if greedy else jax.random.split(rng, num_tokens)
  first = sample(logits[:, -1], None if greedy else keys[0])          # [B]

  def one_step(carry, key):
    token, state = carry
    logits, state = step(params, None, token, state)                  # [B, V]
    token = sample(logits, key)
    return (token, state), token

  _, rest = jax.lax.scan(one_step, (first, state), None if greedy else keys[1:],
                         length=num_tokens - 1)                        # [G - 1, B]
  return jnp.concatenate([first[:, None], rest.T], axis=1)


def _declared_vocab_size(model_fn) -> int | None:
  """The model's `vocab_size` attribute (a `TokenModel`'s), built without
  parameters; None for a model without one."""
  return hk.transform(lambda: getattr(model_fn(), "vocab_size", None)).apply({}, None)


def _as_temperature(temperature) -> float:
  """A Python, NumPy or concrete 0-d JAX real number -> float."""
  if (isinstance(temperature, (bool, np.bool_, jax.core.Tracer)) or jnp.ndim(temperature)
      or not isinstance(temperature, (numbers.Real, np.ndarray, np.generic, jax.Array))
      or not jnp.issubdtype(jnp.result_type(temperature), jnp.number)
      or jnp.issubdtype(jnp.result_type(temperature), jnp.complexfloating)):
    raise TypeError(f"`temperature` must be a concrete real number >= 0 (0: greedy, "
                    f"chosen when `generate` compiles), got {temperature!r}")
  return float(temperature)


def generate(model_fn: Callable[[], Any], params: hk.Params, prompt: jax.Array,
             num_tokens: int, *, rng: jax.Array | int | None = None,
             temperature: float = 1.0, top_k: int | None = None) -> jax.Array:
  """Samples `num_tokens` tokens after a prompt, in one compiled call.

  Runs `model_fn().prefill` on the prompt, then a `lax.scan` of
  `model_fn().step`, sampling each token from the last logits (see the
  module docstring for an example). Compiled once per `model_fn` (define it
  once: a new function object compiles again), prompt shape, `num_tokens`,
  `top_k` and whether decoding is greedy; the temperature, the parameters
  and the rng are arguments of the compiled call.

  Args:
    model_fn: builds the model inside `hk.transform`; it needs
      `prefill(tokens [B, T], *, max_length) -> (logits [B, T, V], state)` and
      `step(tokens [B], state) -> (logits [B, V], state)` (a `TokenModel`).
    params: the model's parameters (as from `hk.transform(...).init` of a
      forward pass that builds the model with `model_fn`).
    prompt: [B, T] integer tokens in [0, V), T >= 1.
    num_tokens: G >= 1, how many tokens to generate.
    rng: a PRNG key or an int seed (`jax.random.key(seed)`); required unless
      `temperature` is 0. The same key gives the same tokens.
    temperature: >= 0, a Python, NumPy or concrete JAX scalar; the logits are
      divided by it before sampling, and 0 decodes greedily (the argmax at
      every step).
    top_k: sample among the k most likely tokens only (1 <= k <= V; ties
      with the k-th are kept); None samples from all.

  Returns:
    [B, G] int32, the generated tokens (the prompt not included). A token
    drawn from logits holding a NaN (non-finite parameters, a traced prompt
    token outside [0, V), a body whose cache overflowed) is -1, and so are
    the later tokens of its sequence; called eagerly, `generate` raises
    instead of returning them.

  Raises:
    ValueError: for a `model_fn` that is not callable, a prompt that is not
      [B, T] integers or holds a token outside [0, V) (V when the model has
      a `vocab_size`), `num_tokens` < 1, a negative `temperature`, `top_k`
      outside [1, V], or no `rng` when sampling.
    TypeError: for a `temperature`, `num_tokens` or `top_k` that is not a
      number (an integer for the last two; a concrete scalar for the first).
    FloatingPointError: when a generated token was drawn from NaN logits.
  """
  if not callable(model_fn):
    raise ValueError(f"`model_fn` must be a callable that builds the model, got "
                     f"{type(model_fn).__name__}")
  _check_token_array("prompt", prompt, 2)
  if min(jnp.shape(prompt)) < 1:
    raise ValueError(f"`prompt` needs at least one sequence of one token, got shape "
                     f"{jnp.shape(prompt)}")
  _check_token_values("prompt", prompt, _declared_vocab_size(model_fn))
  arguments.check_positive_ints(num_tokens=num_tokens)
  temperature = _as_temperature(temperature)
  if not temperature >= 0:
    raise ValueError(f"`temperature` must be >= 0 (0: greedy), got {temperature=}")
  if top_k is not None:
    arguments.check_positive_ints(top_k=top_k)
  greedy = temperature == 0
  if not greedy and rng is None:
    raise ValueError("`rng` (a PRNG key or an int seed) is required to sample with "
                     "temperature > 0; temperature=0 decodes greedily without one")
  if isinstance(rng, numbers.Integral) and not isinstance(rng, bool):
    rng = jax.random.key(int(rng))
  if not greedy:
    arguments.check_key(rng=rng)
  tokens = _generate(params, jnp.asarray(prompt), None if greedy else rng,
                     jnp.float32(temperature), model_fn=model_fn, num_tokens=int(num_tokens),
                     greedy=greedy, top_k=None if top_k is None else int(top_k))
  if not isinstance(tokens, jax.core.Tracer):
    marked = np.asarray(tokens) < 0                                   # [B, G]
    if marked.any():
      rows = np.flatnonzero(marked.any(axis=1))
      raise FloatingPointError(
          f"`generate`: the logits of sequence(s) {rows.tolist()} held NaN from generated "
          f"token {int(marked.any(axis=0).argmax())} on (non-finite `params`, or a body "
          "whose state overflowed); under jit these tokens are returned as -1")
  return tokens
