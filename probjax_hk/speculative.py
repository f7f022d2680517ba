"""Speculative decoding: a small draft model proposes tokens, the model verifies them.

Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers via
Speculative Decoding" (https://arxiv.org/abs/2211.17192); Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling"
(https://arxiv.org/abs/2302.01318). `generate(..., draft_model_fn=...)` runs
it; this module holds its compiled loop.

Glossary of shapes: B batch, T prompt tokens, G generated tokens, K draft
tokens per round, V vocabulary.

Each round, for every sequence of the batch at once:

1. the draft steps K + 1 times from the last token, drawing d_1 .. d_K from
   its distributions q_1 .. q_K (its last step only reads d_K, which it
   needs when all K are accepted);
2. the target reads [last, d_1, .., d_K] in one call: p_1 .. p_{K+1};
3. d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order;
   at the first rejection a token is drawn from max(0, p_i - q_i)
   normalized, after K acceptances from p_{K+1}. A round adds 1 to K + 1
   tokens, distributed exactly as the target's own;
4. both models' states go back to the tokens kept.

p and q are the distributions `generate` draws from: after the repetition
penalty, the temperature and the filters; for a greedy row (temperature 0)
the one-hot argmax, so a draft token is accepted while it is the target's
argmax and the output is plain greedy decoding's.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp

from probjax_hk import arguments
from probjax_hk import generation
from probjax_hk import transformer


def check_arguments(draft_model_fn, draft_params, num_draft_tokens, return_acceptance_rate,
                    vocab_size: int | None) -> int | None:
  """Checks `generate`'s speculative arguments (`vocab_size`: the model's V,
  None when it declares none); returns K, None without a draft."""
  if num_draft_tokens is not None:
    arguments.check_positive_ints(num_draft_tokens=num_draft_tokens)
  if draft_model_fn is None:
    for name, value in [("draft_params", draft_params), ("num_draft_tokens", num_draft_tokens),
                        ("return_acceptance_rate", return_acceptance_rate or None)]:
      if value is not None:
        raise ValueError(f"`{name}` is for speculative decoding: it needs `draft_model_fn`, "
                         f"got {name}={value!r} and draft_model_fn=None")
    return None
  if not callable(draft_model_fn):
    raise ValueError(f"`draft_model_fn` must be None or a callable that builds the draft "
                     f"model, got {type(draft_model_fn).__name__}")
  if draft_params is None:
    raise ValueError("`draft_params` (the draft model's parameters) is required with "
                     "`draft_model_fn`, got draft_params=None")
  draft_vocab_size = generation._declared_vocab_size(draft_model_fn)
  if None not in (vocab_size, draft_vocab_size) and draft_vocab_size != vocab_size:
    raise ValueError(f"`draft_model_fn` must build a model over the model's vocabulary: "
                     f"got {draft_vocab_size=} for {vocab_size=}")
  return 4 if num_draft_tokens is None else int(num_draft_tokens)


class _Decoder:
  """A model's `prefill` and `step` as functions of its parameters."""

  def __init__(self, model_fn, max_length: int):
    def prefill(tokens, state=None, lengths=None):
      ragged = {} if lengths is None else {"lengths": lengths}
      return model_fn().prefill(tokens, state=state, max_length=max_length, **ragged)
    self.prefill = hk.without_apply_rng(hk.transform(prefill)).apply
    self.step = hk.without_apply_rng(hk.transform(
        lambda tokens, state: model_fn().step(tokens, state))).apply


def _is_cache(state) -> bool:
  """A state that rewinds by its `lengths`: a KV cache, whose slots past a
  sequence's length are never read."""
  return isinstance(state, transformer.TransformerState)


def _batch_axes(decoder: _Decoder, params, prompt, argument: str):
  """The batch axis of each leaf of the model's state: the one whose size
  follows B (the prefill traced at B and B + 1, nothing run)."""
  def state_shape(batch):
    tokens = jax.ShapeDtypeStruct((batch, prompt.shape[1]), prompt.dtype)
    return jax.eval_shape(lambda t: decoder.prefill(params, t)[1], tokens)

  def axis(small, large):
    moved = [i for i, (m, n) in enumerate(zip(small.shape, large.shape)) if m != n]
    if len(moved) != 1:
      raise ValueError(f"`{argument}`: every leaf of the model's state needs one batch axis to "
                       f"be rewound per sequence, got shapes {small.shape} at B={prompt.shape[0]}"
                       f" and {large.shape} at B={prompt.shape[0] + 1}")
    return moved[0]
  return jax.tree.map(axis, state_shape(prompt.shape[0]), state_shape(prompt.shape[0] + 1))


def _stacked_steps(step, params, tokens, state):
  """`step` over tokens [B, K] in one scan: (logits [B, K, V], the states
  before and after each token, stacked on a leading axis of K + 1)."""
  def one(state, token):
    logits, state = step(params, token, state)
    return state, (logits, state)
  _, (logits, states) = jax.lax.scan(one, state, tokens.T)
  return jnp.swapaxes(logits, 0, 1), _prepend(state, states)


def _prepend(state, states):
  """`state` put before the scan's stacked `states` (leading axis K + 1)."""
  return jax.tree.map(lambda s, ss: jnp.concatenate([s[None], ss]), state, states)


def _rewind(before, after, advance, axes):
  """The state `advance` [B] tokens of the round after `before`.

  Args:
    before: the state at the round's start.
    after: a cache after all the round's tokens, or any other state before
      and after each token, stacked on a leading axis.
    advance: [B] ints in [0, K + 1].
    axes: each leaf's batch axis (None for a cache).
  """
  if _is_cache(before):
    return after._replace(lengths=before.lengths + advance)

  def pick(stack, axis):
    stack = jnp.moveaxis(stack, axis + 1, 1)                          # [K + 2, B, ...]
    return jnp.moveaxis(stack[advance, jnp.arange(stack.shape[1])], 0, axis)
  return jax.tree.map(pick, after, axes)


def _distribution(scores, hot):
  """Probabilities [B, J, V] of scores [B, J, V] (`generation._scores`):
  the softmax of a sampled row, the one-hot argmax of a greedy one (all rows
  when `hot` is None)."""
  one_hot = jax.nn.one_hot(jnp.argmax(scores, axis=-1), scores.shape[-1], dtype=jnp.float32)
  if hot is None:
    return one_hot
  return jnp.where(hot[:, None, None], jax.nn.softmax(scores, axis=-1), one_hot)


def _verify(p_scores, q_scores, drafts, hot, keys):
  """The acceptance rule of Leviathan et al. and Chen et al.

  Args:
    p_scores: [B, K + 1, V], the target's scores after the last token and
      each draft token; NaN rows mark tokens that must not be accepted.
    q_scores: [B, K, V], the draft's scores the drafts were drawn from.
    drafts: [B, K] int.
    hot: [B] bool, the sampled rows; None when every row is greedy.
    keys: [2, B] PRNG keys, two per sequence (None when `hot` is None).

  Returns:
    (accepted [B] ints in [0, K], the leading drafts kept; token [B], drawn
    from max(0, p - q) normalized at the first rejection, from p_{K+1}
    after K acceptances; marked [B] bool, a token drawn from NaN scores).
  """
  batch, k = drafts.shape
  p_nan = jnp.isnan(p_scores).any(axis=-1)                            # [B, K + 1]
  q_nan = jnp.pad(jnp.isnan(q_scores).any(axis=-1), ((0, 0), (0, 1)))
  p = _distribution(p_scores, hot)
  q = _distribution(q_scores, hot)
  p_draft = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]   # [B, K]
  q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
  # u < p / q as u q < p (q > 0 where drawn); u = 0 for greedy rows: "p's argmax".
  u = 0.0 if hot is None else jnp.where(
      hot[:, None], jax.vmap(lambda key: jax.random.uniform(key, (k,)))(keys[0]), 0.0)
  keep = (u * q_draft < p_draft) & ~p_nan[:, :k] & ~q_nan[:, :k]
  accepted = jnp.cumprod(keep, axis=1).sum(axis=1)                    # [B]
  rows = jnp.arange(batch)
  p_next = p[rows, accepted]                                          # [B, V]
  # After K acceptances nothing is subtracted: the token comes from p_{K+1}.
  q_next = jnp.pad(q, ((0, 0), (0, 1), (0, 0)))[rows, accepted]
  residual = jnp.maximum(p_next - q_next, 0.0)
  residual = jnp.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p_next)
  token = generation._draw(jnp.log(residual), None if hot is None else keys[1], hot)
  return accepted, token, p_nan[rows, accepted] | q_nan[rows, accepted]


@functools.partial(jax.jit, static_argnames=(
    "model_fn", "draft_model_fn", "num_tokens", "num_draft_tokens", "greedy", "top_k"))
def _generate(params, draft_params, prompt, prompt_lengths, rng, temperature, top_p, min_p,
              repetition_penalty, stop_tokens, pad_token, *, model_fn, draft_model_fn,
              num_tokens, num_draft_tokens, greedy, top_k):
  """The whole loop, compiled once per pair of model functions, shapes and
  static options. Returns (tokens [B, G], log-probs [B, G], accepted [B]
  and drafted [B] draft tokens)."""
  batch, time = prompt.shape
  k = num_draft_tokens
  # A sequence that is not done holds fewer than G tokens; a round feeds K + 1 more.
  max_length = time + num_tokens + k - 1
  target, draft = _Decoder(model_fn, max_length), _Decoder(draft_model_fn, max_length)
  logits, state = target.prefill(params, prompt, lengths=prompt_lengths)      # [B, T, V]
  draft_logits, draft_state = draft.prefill(draft_params, prompt, lengths=prompt_lengths)
  if draft_logits.shape[-1] != logits.shape[-1]:
    raise ValueError(f"`draft_model_fn` must give logits over the target's vocabulary of "
                     f"{logits.shape[-1]}, got {draft_logits.shape[-1]}")
  axes = None if _is_cache(state) else _batch_axes(target, params, prompt, "model_fn")
  draft_axes = (None if _is_cache(draft_state)
                else _batch_axes(draft, draft_params, prompt, "draft_model_fn"))
  last, seen = generation._prompt_end(logits, prompt, prompt_lengths, top_k=top_k,
                                      repetition_penalty=repetition_penalty)
  options = dict(temperature=temperature, greedy=greedy, top_k=top_k, top_p=top_p,
                 min_p=min_p, repetition_penalty=repetition_penalty)

  def score(logits, seen):
    """`generation._scores`, NaN rows kept NaN: no token is accepted from them."""
    scores = generation._scores(logits, seen, **options)[0]
    return jnp.where(jnp.isnan(logits).any(axis=-1, keepdims=True), jnp.nan, scores)

  hot = None if greedy else temperature > 0
  first_key, rng = (None, None) if greedy else generation._split_rows(rng, 2)  # [B] each
  token, log_prob = generation._choose(last, first_key, seen, **options)
  seen = generation._mark_seen(seen, token)

  def is_stop(tokens):
    return (tokens[..., None] == stop_tokens).any(axis=-1)

  done = jnp.full((batch,), num_tokens == 1)
  if stop_tokens is not None:
    done |= is_stop(token)
  tokens = jnp.full((batch, num_tokens), pad_token, jnp.int32).at[:, 0].set(token)
  log_probs = jnp.zeros((batch, num_tokens), jnp.float32).at[:, 0].set(log_prob)
  count = jnp.ones((batch,), jnp.int32)                               # tokens generated

  def propose(carry, key):
    token, draft_state, seen = carry
    logits, draft_state = draft.step(draft_params, token, draft_state)
    scores = score(logits, seen)
    drawn = generation._draw(scores, key, hot)
    kept = None if draft_axes is None else draft_state
    return (drawn, draft_state, generation._mark_seen(seen, drawn)), (drawn, scores, seen, kept)

  def round_(carry):
    i, token, count, done, state, draft_state, seen, tokens, log_probs, accepted, drafted = carry
    keys = None if greedy else generation._split_rows(                 # [K + 3, B]
        jax.vmap(jax.random.fold_in, (0, None))(rng, i), k + 3)
    (_, draft_after, _), (drafts, q_scores, seens, draft_states) = jax.lax.scan(
        propose, (token, draft_state, seen), None if greedy else keys[:k + 1], length=k + 1)
    drafts = drafts[:k].T                                             # [B, K]
    if draft_axes is not None:
      draft_after = _prepend(draft_state, draft_states)
    chunk = jnp.concatenate([token[:, None], drafts], axis=1)         # [B, K + 1]
    if _is_cache(state):
      p_logits, after = target.prefill(params, chunk, state)          # [B, K + 1, V]
    else:
      # A recurrence's state overwrites itself: stepping keeps it after every
      # token, exactly plain decoding's; a prefill returns the last one only.
      p_logits, after = _stacked_steps(target.step, params, chunk, state)
    p_scores = jax.vmap(score, in_axes=(1, 0), out_axes=1)(p_logits, seens)
    q_scores = jnp.swapaxes(q_scores[:k], 0, 1)                       # [B, K, V]
    n, new, marked = _verify(p_scores, q_scores, drafts, hot,
                             None if greedy else keys[k + 1:])
    # The round's tokens: the n accepted drafts, then the new one.
    positions = jnp.arange(k + 1)
    at_new = positions == n[:, None]                                  # [B, K + 1]
    block = jnp.where(at_new, new[:, None], jnp.pad(drafts, ((0, 0), (0, 1))))
    block_log_probs = jnp.take_along_axis(jax.nn.log_softmax(p_scores, axis=-1),
                                          block[..., None], axis=-1)[..., 0]
    # Fed back, -1 embeds as NaN again: a sequence stays marked once marked.
    new = jnp.where(marked, -1, new)
    block = jnp.where(at_new & marked[:, None], -1, block)
    block_log_probs = jnp.where(at_new & marked[:, None], jnp.nan, block_log_probs)
    rows = jnp.arange(batch)
    valid = positions <= n[:, None]
    stopped = jnp.zeros((batch,), bool)
    if stop_tokens is not None:
      stops = valid & is_stop(block)
      valid &= jnp.cumsum(stops, axis=1) - stops == 0                 # up to the first stop
      stopped = stops.any(axis=1)
    columns = jnp.where(valid & ~done[:, None], count[:, None] + positions, num_tokens)
    tokens = tokens.at[rows[:, None], columns].set(block, mode="drop")
    log_probs = log_probs.at[rows[:, None], columns].set(block_log_probs, mode="drop")
    active = ~done
    count = count + jnp.where(active, n + 1, 0)
    done = done | stopped | (count >= num_tokens)
    # A finished sequence stays where it was: its cache never outgrows max_length.
    advance = jnp.where(done, 0, n + 1)
    state = _rewind(state, after, advance, axes)
    draft_state = _rewind(draft_state, draft_after, advance, draft_axes)
    if seen is not None:
      seen = generation._mark_seen(seens[n, rows], new)
    return (i + 1, new, count, done, state, draft_state, seen, tokens, log_probs,
            accepted + jnp.where(active, n, 0), drafted + jnp.where(active, k, 0))

  zeros = jnp.zeros((batch,), jnp.int32)
  carry = (jnp.int32(0), token, count, done, state, draft_state, seen, tokens, log_probs,
           zeros, zeros)
  carry = jax.lax.while_loop(lambda carry: ~carry[3].all(), round_, carry)
  return carry[7], carry[8], carry[9], carry[10]
