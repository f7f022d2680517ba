"""Autoregressive generation: `TokenModel` (tokens in, logits out) and `generate`.

Glossary of shapes: B batch, T prompt tokens, G generated tokens, V vocabulary,
E embedding width.

Every sequence model of the library decodes through one interface:
`initial_state(batch_size, max_length)`, `prefill(x, state=None, *,
max_length=None, lengths=None) -> (y, state)` (a prompt in one parallel call;
`lengths` for right-padded prompts of different lengths) and
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
parameters fit; an `SSMModel` body works the same way. `generate` also takes
Hugging Face's sampling options (`top_p`, `min_p`, `repetition_penalty`, a
temperature per sequence), `stop_tokens`, `return_log_probs`,
`prompt_lengths` for a batch of right-padded prompts, and a draft model
(`draft_model_fn`) for speculative decoding (`probjax_hk/speculative.py`).

`TokenModel(..., dtype=jnp.bfloat16)` runs the body in bfloat16 (its
activations and a Transformer's cache) with the float32 parameters of a
model trained in float32; the logits stay float32 for sampling.

A token outside [0, V) raises a ValueError where the tokens are concrete; a
traced one embeds as NaN, so its logits are NaN, and `generate` returns -1 for
a token drawn from NaN logits (and raises when it runs eagerly).
"""

import functools
import numbers
from typing import Any, Callable, Sequence

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


def _floating_dtype(dtype) -> np.dtype:
  """`dtype` as a NumPy dtype; a TypeError unless it names a floating one."""
  try:
    parsed = jnp.dtype(dtype)
  except TypeError:
    parsed = None
  if parsed is None or not jnp.issubdtype(parsed, jnp.floating):
    raise TypeError(f"`dtype` must be None or a floating dtype (e.g. jnp.bfloat16), got "
                    f"{dtype=}")
  return parsed


class TokenModel(hk.Module):
  """A sequence model over discrete tokens: an embedding in, logits out.

  ::

      logits = Linear(vocab_size)(body(embedding[tokens]))

  `body` is any sequence model of the library (a causal `Transformer`, an
  `SSMModel`), or any module with the decoding interface they share:
  `initial_state(batch_size, max_length)`, `prefill(x, state=None, *,
  max_length=None, lengths=None) -> (y, state)` and `step(x_t, state) -> (y_t,
  state)`. `TokenModel` has the same interface over tokens, which is what
  `generate` drives.

  The parameters are float32. The body computes in `dtype` (the embedding is
  cast to it), or without `dtype` in the embedding's dtype: float32, or the
  compute dtype of an `hk.mixed_precision` policy. The logits are float32
  (under a policy, its output dtype).
  """

  def __init__(self, body: Any, vocab_size: int, *, embed_dim: int | None = None,
               dtype: Any = None, name: str | None = None):
    """Constructs the model.

    Args:
      body: the sequence model, [B, T, E] -> [B, T, D]; for decoding it must
        have `initial_state`, `prefill` and `step`.
      vocab_size: V, the number of tokens.
      embed_dim: E, the embedding width; default the body's `input_dim`
        (SSMModel) or `model_dim` (Transformer).
      dtype: None or a floating dtype (`jnp.bfloat16`): the dtype the body
        computes in, so a Transformer's cache's too; the parameters stay
        float32 (a model trained in float32 decodes in bfloat16 with them).
        With it, `initial_state` passes `dtype=` to the body.
      name: module name.

    Raises:
      TypeError: for a size that is not an integer, a `body` that is not
        callable or a `dtype` that is not a floating dtype.
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
    if dtype is not None:
      dtype = _floating_dtype(dtype)
    self.body = body
    self.vocab_size = vocab_size
    self.embed_dim = embed_dim
    self.dtype = dtype

  def __call__(self, tokens: jax.Array, **kwargs) -> jax.Array:
    """The sequence path.

    Args:
      tokens: [B, T] integers in [0, V) (checked when concrete; a traced
        token outside embeds as NaN).
      **kwargs: passed to the body (e.g. `is_training=True`).

    Returns:
      [B, T, V] float32 logits.
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
      The body's state (a Transformer's caches in `dtype`; float32 without it).
    """
    kwargs = {} if self.dtype is None else {"dtype": self.dtype}
    return self.body.initial_state(batch_size, max_length, **kwargs)

  @hk.name_like("__call__")
  def prefill(self, tokens: jax.Array, state=None, *, max_length: int | None = None,
              lengths: jax.Array | None = None):
    """Runs a prompt in one parallel call.

    Args:
      tokens: [B, T] integers in [0, V), the next T tokens of each sequence.
      state: None (the tokens start the sequences) or a state of
        `initial_state`, `prefill` or `step`.
      max_length: the most tokens a sequence will hold (needed by a
        Transformer body when `state` is None).
      lengths: None, or [B] ints in [0, T] for right-padded sequences: the
        body's state continues after each sequence's `lengths[b]` tokens
        (the padding, whatever its values, is never read); the logits past
        them are unspecified.

    Returns:
      (logits [B, T, V] float32, the state after the tokens).
    """
    _check_token_array("tokens", tokens, 2)
    ragged = {}
    if lengths is not None:
      ragged["lengths"], valid = layers.sequence_mask(lengths, tokens)
      tokens = jnp.where(valid, tokens, 0)
    _check_token_values("tokens", tokens, self.vocab_size)
    y, state = self.body.prefill(self._embed(tokens), state, max_length=max_length, **ragged)
    return self._logits(y), state

  @hk.name_like("__call__")
  def step(self, tokens: jax.Array, state):
    """One decoding step.

    Args:
      tokens: [B] integers in [0, V), each sequence's next token.
      state: a state of `initial_state`, `prefill` or `step`.

    Returns:
      (logits [B, V] float32 of the token after it, the state).
    """
    self._check_tokens(tokens, 1)
    y, state = self.body.step(self._embed(tokens), state)
    return self._logits(y), state

  def _check_tokens(self, tokens, ndim: int) -> None:
    _check_token_array("tokens", tokens, ndim)
    _check_token_values("tokens", tokens, self.vocab_size)

  @hk.transparent
  def _embed(self, tokens):
    """[...] ints -> [..., E] in `dtype` (default the table's, float32 but
    under a policy); NaN rows for tokens outside [0, V)."""
    table = hk.get_parameter("embeddings", [self.vocab_size, self.embed_dim], jnp.float32,
                             init=hk.initializers.TruncatedNormal())
    valid = (tokens >= 0) & (tokens < self.vocab_size)
    # NaN rather than a wrapped (-1 -> V - 1) or clipped row: the logits show it.
    x = jnp.where(valid[..., None], _rows(table, tokens), jnp.nan)
    return x if self.dtype is None else x.astype(self.dtype)

  @hk.transparent
  def _logits(self, y):
    """[..., D] in the compute dtype -> [..., V] float32 (the projection runs
    in y's dtype; the softmax and sampling want float32)."""
    return layers.Linear(self.vocab_size, name="logits")(y).astype(jnp.float32)


def _rows(table, tokens):
  """table [V, E] at tokens [...] (clipped) -> [..., E], split like `tokens`
  where Explicit mesh axes split them (JAX cannot infer a gather's layout)."""
  sharding = getattr(jax.typeof(tokens), "sharding", None)
  if sharding is None or not any(sharding.spec):
    return jnp.take(table, tokens, axis=0, mode="clip")
  out = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
      *sharding.spec, None))
  return table.at[tokens].get(mode="clip", out_sharding=out)


def _penalize(logits, seen, penalty):
  """The repetition penalty (Hugging Face's): logits [B, V] of the tokens
  `seen` [B, V] bool divided by `penalty` where positive, multiplied by it
  where negative."""
  return jnp.where(seen, jnp.where(logits < 0, logits * penalty, logits / penalty), logits)


def _warp(logits, temperature, *, top_k=None, top_p=None, min_p=None):
  """The logits a token is sampled from, in Hugging Face's order.

  Args:
    logits: [B, V] float32.
    temperature: [B] > 0, dividing each row.
    top_k: keep the k largest (ties with the k-th kept); None keeps all.
    top_p: keep the smallest set of most likely tokens whose probability
      reaches top_p (a token stays while the mass of the tokens above it is
      below top_p; ties with the last kept stay); None keeps all.
    min_p: keep the tokens at least min_p times as likely as the most
      likely one; None keeps all.

  Returns:
    [B, V] float32, -inf where a filter removed the token.
  """
  logits = logits / temperature[:, None]
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]                      # [B, 1]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p is not None:
    ordered = -jnp.sort(-logits, axis=-1)                              # [B, V] descending
    probs = jax.nn.softmax(ordered, axis=-1)
    above = jnp.cumsum(probs, axis=-1) - probs                         # mass of the likelier
    # The most likely token always stays (its mass above is 0 < top_p).
    cutoff = jnp.min(jnp.where(above < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  if min_p is not None:
    probs = jax.nn.softmax(logits, axis=-1)
    logits = jnp.where(probs < min_p * probs.max(axis=-1, keepdims=True), -jnp.inf, logits)
  return logits


def _scores(logits, seen, temperature, *, greedy: bool, top_k, top_p, min_p,
            repetition_penalty):
  """The logits each row's token is chosen from.

  Args:
    logits: [B, V], the model's.
    seen: [B, V] bool, the tokens in each sequence so far (None without a
      repetition penalty).
    temperature: [B] >= 0; 0 takes the argmax of that row.
    greedy: every row's temperature is 0.
    top_k, top_p, min_p, repetition_penalty: as for `generate` (None: off).

  Returns:
    (scores [B, V] float32: the warped logits of a sampled row, the
    penalized ones of a greedy row; hot [B] bool, the sampled rows, or None
    when `greedy`).
  """
  logits = logits.astype(jnp.float32)
  scores = logits if repetition_penalty is None else _penalize(logits, seen,
                                                               repetition_penalty)
  if greedy:
    return scores, None
  hot = temperature > 0                                                # [B]
  warped = _warp(scores, jnp.where(hot, temperature, 1.0), top_k=top_k, top_p=top_p,
                 min_p=min_p)
  return jnp.where(hot[:, None], warped, scores), hot


def _draw(scores, keys, hot):
  """A token per row of `_scores`: drawn with the row's key of `keys` [B]
  where `hot`, the argmax elsewhere (everywhere when `hot` is None)."""
  tokens = jnp.argmax(scores, axis=-1)
  if hot is None:
    return tokens
  return jnp.where(hot, jax.vmap(jax.random.categorical)(keys, scores), tokens)


def _sequence_keys(rng, batch: int):
  """[B] PRNG keys, one per sequence: `rng` itself when it is [B] keys, else
  its split in B. A sequence's draws depend only on its own key, so it
  samples the same tokens whatever else is in the batch."""
  if jnp.issubdtype(getattr(rng, "dtype", None), jax.dtypes.prng_key) and rng.ndim == 1:
    if rng.shape != (batch,):
      raise ValueError(f"`rng` must be one PRNG key or [B] = ({batch},) keys, one per "
                       f"sequence, got shape {rng.shape}")
    return rng
  arguments.check_key(rng=rng)
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(rng)
  return jax.random.split(rng, batch)


def _split_rows(keys, num: int):
  """[B] keys -> [num, B]: `num` keys of each sequence, the draws' order."""
  return jnp.swapaxes(jax.vmap(lambda key: jax.random.split(key, num))(keys), 0, 1)


def _choose(logits, key, seen, temperature, *, greedy: bool, top_k, top_p, min_p,
            repetition_penalty):
  """The next token of each sequence and its log-probability.

  Args:
    logits: [B, V], the model's.
    key: [B] PRNG keys, one per sequence (None when `greedy`).
    seen, temperature, greedy, top_k, top_p, min_p, repetition_penalty: as
      for `_scores`.

  Returns:
    (tokens [B] int32, log-probabilities [B] float32 of each token under
    the distribution it was chosen from: the penalized logits for a greedy
    row, the warped ones for a sampled row). -1 and NaN for a row holding
    a NaN.
  """
  scores, hot = _scores(logits, seen, temperature, greedy=greedy, top_k=top_k, top_p=top_p,
                        min_p=min_p, repetition_penalty=repetition_penalty)
  tokens = _draw(scores, key, hot)
  log_probs = jnp.take_along_axis(jax.nn.log_softmax(scores, axis=-1), tokens[:, None],
                                  axis=-1)[:, 0]
  # Fed back, -1 embeds as NaN again: a sequence stays marked once marked.
  marked = jnp.isnan(logits).any(axis=-1)
  return (jnp.where(marked, -1, tokens).astype(jnp.int32),
          jnp.where(marked, jnp.nan, log_probs))


def _mark_seen(seen, tokens, valid=None):
  """`seen` [B, V] with each row's `tokens` ([B] or [B, T], where `valid`)
  set; -1 and other tokens outside [0, V) are left out."""
  if seen is None:
    return None
  tokens = tokens.reshape(tokens.shape[0], -1)
  keep = (tokens >= 0) & (tokens < seen.shape[-1])
  if valid is not None:
    keep &= valid
  rows = jnp.arange(seen.shape[0])[:, None]
  return seen.at[rows, jnp.where(keep, tokens, seen.shape[-1])].set(True, mode="drop")


def _prompt_end(logits, prompt, prompt_lengths, *, top_k, repetition_penalty):
  """What the first token is chosen from, after the prompt's prefill.

  Args:
    logits: [B, T, V], the prefill's.
    prompt: [B, T] tokens; prompt_lengths: None or [B] ints.
    top_k, repetition_penalty: as for `generate` (None: off).

  Returns:
    (logits [B, V] after each prompt's last token, NaN for a traced length
    outside [1, T]; seen [B, V] bool, the prompt's tokens, or None without a
    repetition penalty).
  """
  batch, time, vocab_size = logits.shape
  if top_k is not None and top_k > vocab_size:
    raise ValueError(f"`top_k` must be at most the vocabulary size {vocab_size}, got {top_k=}")
  valid = None
  if prompt_lengths is None:
    last = logits[:, -1]
  else:
    valid = jnp.arange(time) < prompt_lengths[:, None]                # [B, T]
    ends = jnp.clip(prompt_lengths, 1, time) - 1
    last = jnp.take_along_axis(logits, ends[:, None, None], axis=1)[:, 0]
    # A traced length outside [1, T] has no last token: its sequence is marked.
    last = jnp.where(((prompt_lengths < 1) | (prompt_lengths > time))[:, None], jnp.nan, last)
  seen = None
  if repetition_penalty is not None:
    seen = _mark_seen(jnp.zeros((batch, vocab_size), bool), prompt, valid)
  return last, seen


@functools.partial(jax.jit, static_argnames=("model_fn", "num_tokens", "greedy", "top_k"))
def _generate(params, prompt, prompt_lengths, rng, temperature, top_p, min_p,
              repetition_penalty, stop_tokens, pad_token, *, model_fn, num_tokens, greedy,
              top_k):
  """The whole loop, compiled once per model_fn, shapes, static options and
  which of the optional arrays are None. Returns (tokens [B, G], log-probs
  [B, G])."""
  batch, time = prompt.shape
  max_length = time + num_tokens - 1  # The last token is never fed back.

  def prefill_fn(tokens, lengths):
    ragged = {} if lengths is None else {"lengths": lengths}
    return model_fn().prefill(tokens, max_length=max_length, **ragged)
  prefill = hk.transform(prefill_fn).apply
  step = hk.transform(lambda tokens, state: model_fn().step(tokens, state)).apply
  logits, state = prefill(params, None, prompt, prompt_lengths)       # [B, T, V]
  last, seen = _prompt_end(logits, prompt, prompt_lengths, top_k=top_k,
                           repetition_penalty=repetition_penalty)
  choose = functools.partial(_choose, temperature=temperature, greedy=greedy, top_k=top_k,
                             top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
  keys = None if greedy else _split_rows(rng, num_tokens)              # [G, B]

  def finish(i, token, log_prob, done, tokens, log_probs):
    """Writes column i (the pad and log-probability 0 where a sequence was
    done before it) and updates which sequences are done."""
    tokens = tokens.at[:, i].set(jnp.where(done, pad_token, token))
    log_probs = log_probs.at[:, i].set(jnp.where(done, 0.0, log_prob))
    if stop_tokens is not None:
      done = done | (token[:, None] == stop_tokens).any(axis=-1)
    return done, tokens, log_probs

  token, log_prob = choose(last, None if greedy else keys[0], seen)
  done, tokens, log_probs = finish(
      0, token, log_prob, jnp.zeros((batch,), bool),
      jnp.zeros((batch, num_tokens), jnp.int32), jnp.zeros((batch, num_tokens), jnp.float32))

  def body(carry):
    i, token, state, seen, done, tokens, log_probs = carry
    logits, state = step(params, None, token, state)                  # [B, V]
    seen = _mark_seen(seen, token)
    token, log_prob = choose(logits, None if greedy else keys[i], seen)
    return (i + 1, token, state, seen, *finish(i, token, log_prob, done, tokens, log_probs))

  def more(carry):
    i, done = carry[0], carry[4]
    return (i < num_tokens) & ~done.all()

  carry = (jnp.int32(1), token, state, seen, done, tokens, log_probs)
  if stop_tokens is None:  # A fixed trip count: no predicate to read back every step.
    carry = jax.lax.fori_loop(1, num_tokens, lambda _, carry: body(carry), carry)
  else:
    carry = jax.lax.while_loop(more, body, carry)
  i, tokens, log_probs = carry[0], carry[5], carry[6]
  # Columns never reached: every sequence was done before them.
  later = jnp.arange(num_tokens) >= i
  return jnp.where(later, pad_token, tokens), jnp.where(later, 0.0, log_probs)


def _declared_vocab_size(model_fn) -> int | None:
  """The model's `vocab_size` attribute (a `TokenModel`'s), built without
  parameters; None for a model without one."""
  return hk.transform(lambda: getattr(model_fn(), "vocab_size", None)).apply({}, None)


def _as_temperature(temperature, batch: int) -> np.ndarray:
  """A Python, NumPy or concrete JAX real number, or a concrete [B] array of
  them -> float32 [B]."""
  if (isinstance(temperature, (bool, np.bool_, jax.core.Tracer))
      or not isinstance(temperature, (numbers.Real, np.ndarray, np.generic, jax.Array))
      or not jnp.issubdtype(jnp.result_type(temperature), jnp.number)
      or jnp.issubdtype(jnp.result_type(temperature), jnp.complexfloating)
      or jnp.issubdtype(jnp.result_type(temperature), jnp.bool_)):
    raise TypeError(f"`temperature` must be a concrete real number >= 0 or a concrete [B] "
                    f"array of them (0: greedy, chosen when `generate` compiles), got "
                    f"{temperature!r}")
  values = np.asarray(temperature, np.float64)
  if values.ndim and values.shape != (batch,):
    raise ValueError(f"`temperature` must be a number or [B]=({batch},) numbers, got shape "
                     f"{values.shape}")
  if not (values >= 0).all() or not np.isfinite(values).all():
    raise ValueError(f"`temperature` must be finite and >= 0 (0: greedy), got "
                     f"temperature={values.tolist() if values.ndim else float(values)}")
  return np.broadcast_to(values, (batch,)).astype(np.float32)


def _as_option(name: str, value, limit: str, fits, off: float):
  """A sampling option: None (off) for None or the value `off` that changes
  nothing; a float32 otherwise (traced: taken as it is)."""
  if value is None:
    return None
  number = arguments._number(name, value, limit)
  if number is None:
    return value
  if not fits(number):
    raise ValueError(f"`{name}` must be a number {limit}, got {name}={value!r}")
  return None if number == off else np.float32(number)


def _as_token_ids(name: str, tokens, vocab_size: int | None):
  """A token id or a sequence of them -> int32 [S], each in [0, V) (checked
  when concrete)."""
  if isinstance(tokens, jax.core.Tracer):
    if jnp.ndim(tokens) > 1 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise TypeError(f"`{name}` must be a token id or a sequence of them (integers), got "
                      f"{tokens!r}")
    return jnp.reshape(tokens, -1).astype(jnp.int32)
  values = np.asarray(tokens)
  if not values.size:
    raise ValueError(f"`{name}` must hold at least one token id, got {tokens!r}")
  if (values.dtype == object or values.dtype == bool or values.ndim > 1
      or not np.issubdtype(values.dtype, np.integer)):
    raise TypeError(f"`{name}` must be a token id or a sequence of them (integers), got "
                    f"{tokens!r}")
  values = values.reshape(-1)
  _check_token_values(name, values, vocab_size)
  return values.astype(np.int32)


def generate(model_fn: Callable[[], Any], params: hk.Params, prompt: jax.Array,
             num_tokens: int, *, rng: jax.Array | int | None = None,
             temperature: float | jax.Array = 1.0, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None,
             repetition_penalty: float | None = None,
             stop_tokens: int | Sequence[int] | None = None, pad_token: int | None = None,
             prompt_lengths: jax.Array | None = None, return_log_probs: bool = False,
             draft_model_fn: Callable[[], Any] | None = None, draft_params: hk.Params | None = None,
             num_draft_tokens: int | None = None, return_acceptance_rate: bool = False):
  """Samples `num_tokens` tokens after a prompt, in one compiled call.

  Runs `model_fn().prefill` on the prompt, then a loop of `model_fn().step`
  (a `lax.while_loop` that ends early with `stop_tokens`, a fixed-length
  one without), choosing each token from the last logits (an example: the
  user guide's :ref:`token-model-and-generate`). The logits go through, in this order
  (Hugging Face's): the repetition penalty, the temperature, `top_k`,
  `top_p`, `min_p`; then a token is drawn (the argmax at temperature 0).
  Compiled once per `model_fn` (define it once: a new function object
  compiles again), prompt shape, `num_tokens`, `top_k`, whether decoding is
  greedy, which of `top_p`, `min_p`, `repetition_penalty`, `stop_tokens`
  (and how many) and `prompt_lengths` are set; their values, the
  temperature, the parameters and the rng are arguments of the compiled call.

  With `draft_model_fn`, decoding is speculative (Leviathan et al. 2023,
  https://arxiv.org/abs/2211.17192; the user guide's
  :ref:`speculative-decoding`): each round the draft model proposes
  `num_draft_tokens` tokens one step at a time, the model scores them all in
  one call (a Transformer's `prefill` on its cache; the steps of any other
  body in one scan, keeping its state after each token), keeps each with
  probability min(1, p / q) of the two models' distributions after the
  options above, and draws the token after the last one kept from the
  normalized max(0, p - q) (from p when all were kept); both states go back
  to the tokens kept. The tokens are distributed exactly as without a draft
  (greedy ones are the same tokens); a round costs the model one call and
  yields 1 to `num_draft_tokens` + 1 of them.

  Args:
    model_fn: builds the model inside `hk.transform`; it needs
      `prefill(tokens [B, T], *, max_length) -> (logits [B, T, V], state)`
      (and its `lengths=` for `prompt_lengths`) and
      `step(tokens [B], state) -> (logits [B, V], state)` (a `TokenModel`).
    params: the model's parameters (as from `hk.transform(...).init` of a
      forward pass that builds the model with `model_fn`).
    prompt: [B, T] integer tokens in [0, V), T >= 1; right-padded with
      `prompt_lengths` (the padding is never read).
    num_tokens: G >= 1, how many tokens to generate.
    rng: a PRNG key, an int seed (`jax.random.key(seed)`), or [B] keys, one
      per sequence; required unless every temperature is 0. The same key
      gives the same tokens. One key is split into one per sequence, and a
      sequence's draws depend only on its own key: with [B] keys a
      sequence samples the tokens it samples alone with its key.
    temperature: >= 0, a Python, NumPy or concrete JAX scalar, or a concrete
      [B] array (one per sequence); the logits are divided by it before
      sampling, and 0 decodes greedily (the argmax at every step, for that
      sequence).
    top_k: sample among the k most likely tokens only (1 <= k <= V; ties
      with the k-th are kept); None samples from all.
    top_p: nucleus sampling, in (0, 1]: sample among the smallest set of most
      likely tokens whose probability reaches `top_p` (after the
      temperature and `top_k`); None or 1 samples from all.
    min_p: in [0, 1]: sample among the tokens at least `min_p` times as
      likely as the most likely one; None or 0 samples from all.
    repetition_penalty: > 0: the logits of the tokens already in a sequence
      (its prompt included) are divided by it where positive and multiplied
      by it where negative (> 1 discourages repeats); None or 1 does nothing.
      It also applies to greedy decoding.
    stop_tokens: a token id or a sequence of them, each in [0, V): a
      sequence is done once it generates one (the stop token is returned);
      its later tokens are `pad_token`, and the loop ends early once every
      sequence is done. None generates `num_tokens` for every sequence.
    pad_token: the id (>= 0) returned after a sequence's stop token; default
      the first of `stop_tokens`. Needs `stop_tokens`.
    prompt_lengths: None (every prompt has T tokens) or [B] ints in [1, T]:
      prompt b is `prompt[b, :prompt_lengths[b]]` and its tokens follow
      them, exactly as if it were alone (checked when concrete; a traced
      one outside gives that sequence -1 tokens).
    return_log_probs: also return each generated token's log-probability
      under the distribution it was chosen from: after the repetition
      penalty, temperature and filters for a sampled sequence (Hugging
      Face's processed scores, log-softmaxed), after the repetition penalty
      only for a greedy one (temperature 0), where the filters do not
      change the argmax.
    draft_model_fn: None, or builds the draft model as `model_fn` builds the
      model (any model `generate` takes, over the same V tokens): decode
      speculatively.
    draft_params: the draft model's parameters; required with
      `draft_model_fn`.
    num_draft_tokens: K >= 1, the tokens the draft proposes per round;
      default 4 with `draft_model_fn`, which it needs.
    return_acceptance_rate: also return each sequence's acceptance rate,
      [B] float32: the fraction of its draft tokens the model kept (NaN for a
      sequence that never drafted: G = 1, or a stop token first). Needs
      `draft_model_fn`.

  Returns:
    [B, G] int32, the generated tokens (the prompt not included); with
    `return_log_probs`, (tokens, log-probabilities [B, G] float32; 0 for the
    pads after a stop, so a row sums to its sequence's log-probability). A
    token drawn from logits holding a NaN (non-finite parameters, a traced
    prompt token outside [0, V), a body whose cache overflowed) is -1 (its
    log-probability NaN), and so are the later tokens of its sequence;
    called eagerly, `generate` raises instead of returning them. With
    `return_acceptance_rate`, the rates [B] come last.

  Raises:
    ValueError: for a `model_fn` that is not callable, a prompt that is not
      [B, T] integers or holds a token outside [0, V) (V when the model has
      a `vocab_size`), `num_tokens` < 1, a negative `temperature` or one not
      of shape [B], `top_k` outside [1, V], `top_p` outside (0, 1], `min_p`
      outside [0, 1], a `repetition_penalty` <= 0, stop tokens outside
      [0, V), a negative `pad_token` or one without `stop_tokens`,
      `prompt_lengths` that is not [B] integers in [1, T], no `rng` when
      sampling, a `draft_model_fn` that is not callable, whose vocabulary
      is not the model's or that comes without `draft_params`,
      `num_draft_tokens` < 1, or `draft_params`, `num_draft_tokens` or
      `return_acceptance_rate` without `draft_model_fn`.
    TypeError: for a `temperature`, `num_tokens`, `top_k`, `top_p`,
      `min_p`, `repetition_penalty`, `stop_tokens` or `pad_token` that is
      not a number (an integer for sizes and tokens; a concrete one for the
      temperature), a `num_draft_tokens` that is not an integer, or a
      `return_log_probs` or `return_acceptance_rate` that is not a bool.
    FloatingPointError: when a generated token was drawn from NaN logits.
  """
  from probjax_hk import speculative  # It builds on this module's sampling.
  if not callable(model_fn):
    raise ValueError(f"`model_fn` must be a callable that builds the model, got "
                     f"{type(model_fn).__name__}")
  _check_token_array("prompt", prompt, 2)
  if min(jnp.shape(prompt)) < 1:
    raise ValueError(f"`prompt` needs at least one sequence of one token, got shape "
                     f"{jnp.shape(prompt)}")
  batch, time = jnp.shape(prompt)
  prompt = jnp.asarray(prompt)
  if prompt_lengths is not None:
    if not isinstance(prompt_lengths, jax.core.Tracer) and jnp.size(prompt_lengths):
      values = np.asarray(prompt_lengths)
      if values.min() < 1 or values.max() > time:
        raise ValueError(f"`prompt_lengths` must lie in [1, T={time}] (a prompt needs a "
                         f"token), got {values.tolist()}")
    _, valid = layers.sequence_mask(prompt_lengths, prompt, "prompt_lengths")
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)  # Unclipped: bad ones get marked.
    prompt = jnp.where(valid, prompt, 0)  # The padding is never read: any value will do.
  vocab_size = _declared_vocab_size(model_fn)
  _check_token_values("prompt", prompt, vocab_size)
  arguments.check_positive_ints(num_tokens=num_tokens)
  temperature = _as_temperature(temperature, batch)
  if top_k is not None:
    arguments.check_positive_ints(top_k=top_k)
  top_p = _as_option("top_p", top_p, "in (0, 1]", lambda p: 0 < p <= 1, off=1.0)
  min_p = _as_option("min_p", min_p, "in [0, 1]", lambda p: 0 <= p <= 1, off=0.0)
  repetition_penalty = _as_option("repetition_penalty", repetition_penalty, "> 0 (finite)",
                                  lambda r: 0 < r < np.inf, off=1.0)
  if stop_tokens is not None:
    stop_tokens = _as_token_ids("stop_tokens", stop_tokens, vocab_size)
  if pad_token is not None:
    if not isinstance(pad_token, numbers.Integral) or isinstance(pad_token, bool):
      raise TypeError(f"`pad_token` must be a token id (an integer >= 0), got {pad_token!r}")
    if pad_token < 0:
      raise ValueError(f"`pad_token` must be >= 0 (-1 marks tokens drawn from NaN logits), "
                       f"got {pad_token=}")
    if stop_tokens is None:
      raise ValueError(f"`pad_token` pads after a stop token: it needs `stop_tokens`, got "
                       f"{pad_token=} and stop_tokens=None")
  arguments.check_bools(return_log_probs=return_log_probs,
                        return_acceptance_rate=return_acceptance_rate)
  num_draft_tokens = speculative.check_arguments(
      draft_model_fn, draft_params, num_draft_tokens, return_acceptance_rate, vocab_size)
  greedy = not temperature.any()
  if not greedy and rng is None:
    raise ValueError("`rng` (a PRNG key or an int seed) is required to sample with "
                     "temperature > 0; temperature=0 decodes greedily without one")
  if isinstance(rng, numbers.Integral) and not isinstance(rng, bool):
    rng = jax.random.key(int(rng))
  if not greedy:
    rng = _sequence_keys(rng, prompt.shape[0])
  if pad_token is None:
    pad_token = 0 if stop_tokens is None else stop_tokens[0]
  arrays = (prompt, prompt_lengths, None if greedy else rng, temperature, top_p, min_p,
            repetition_penalty, stop_tokens, jnp.asarray(pad_token, jnp.int32))
  static = dict(model_fn=model_fn, num_tokens=int(num_tokens), greedy=bool(greedy),
                top_k=None if top_k is None else int(top_k))
  if draft_model_fn is None:
    tokens, log_probs = _generate(params, *arrays, **static)
  else:
    tokens, log_probs, accepted, drafted = speculative._generate(
        params, draft_params, *arrays, draft_model_fn=draft_model_fn,
        num_draft_tokens=num_draft_tokens, **static)
  if not isinstance(tokens, jax.core.Tracer):
    marked = np.asarray(tokens) < 0                                   # [B, G]
    if marked.any():
      rows = np.flatnonzero(marked.any(axis=1))
      raise FloatingPointError(
          f"`generate`: the logits of sequence(s) {rows.tolist()} held NaN from generated "
          f"token {int(marked.any(axis=0).argmax())} on (non-finite `params`"
          f"{'' if draft_model_fn is None else ' or `draft_params`'}, or a body whose state "
          "overflowed); under jit these tokens are returned as -1")
  outputs = (tokens, log_probs) if return_log_probs else (tokens,)
  if return_acceptance_rate:
    outputs += (accepted / jnp.where(drafted > 0, drafted, jnp.nan),)
  return outputs if len(outputs) > 1 else tokens
