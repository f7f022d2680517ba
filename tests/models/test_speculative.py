"""generate(draft_model_fn=): speculative decoding gives plain greedy
decoding's tokens (ragged prompts, stop tokens and log-probabilities
included) with a Transformer or an SSM as model and draft, samples the
model's own distribution, and refuses bad arguments."""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pk
from probjax_hk import generation

V, B, T, G, K = 13, 4, 5, 12, 3


def _transformer_lm():
  return pk.TokenModel(pk.Transformer(16, 4, 2, num_kv_heads=2, is_causal=True,
                                      use_rope=True, local_window_size=5), vocab_size=V)


def _ssm_lm():
  return pk.TokenModel(pk.SSMModel(8, 16, 16, 2, cell=pk.Mamba2Cell,
                                   cell_kwargs={"head_dim": 8, "state_dim": 4},
                                   scan_layers=True), vocab_size=V)


def _small_transformer_lm(vocab_size=V):
  return pk.TokenModel(pk.Transformer(8, 2, 1, is_causal=True, use_rope=True),
                       vocab_size=vocab_size)


_PROMPT = np.asarray(jax.random.randint(jax.random.key(0), (B, T), 0, V))


def _random_params(model_fn, prompt, seed=0, scale=0.5):
  """Normal(0, scale) values in the shapes of the forward pass's parameters:
  traced, not compiled."""
  shapes = jax.eval_shape(hk.transform(lambda tokens: model_fn()(tokens)).init,
                          jax.random.key(0), prompt)
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: rng.normal(0, scale, s.shape).astype(s.dtype), shapes)


def _perturbed(params, scale):
  """A draft that agrees with the model often, not always: its parameters
  plus noise."""
  rng = np.random.default_rng(9)
  return jax.tree.map(lambda x: x + rng.normal(0, scale, x.shape).astype(x.dtype), params)


# Scales at which greedy decoding of these random models does not collapse to one token.
@pytest.mark.parametrize("model_fn, scale, seed", [(_transformer_lm, 0.3, 1), (_ssm_lm, 0.5, 0)],
                         ids=["transformer", "ssm"])
def test_greedy_tokens_are_plain_greedy_decodings(model_fn, scale, seed):
  """Ragged prompts, a stop token and log-probabilities as without a draft;
  drafts accepted in part, so both states roll back (a cache by its
  lengths, an SSM's to a kept state)."""
  params = _random_params(model_fn, _PROMPT, seed, scale)
  options = dict(temperature=0, prompt_lengths=np.array([5, 2, 4, 1]), return_log_probs=True)
  plain, plain_log_probs = map(np.asarray, pk.generate(model_fn, params, _PROMPT, G, **options))
  # A stop token that ends some sequences early and not others.
  stop = next(t for t in range(V) if 0 < sum(t in row for row in plain) < B)
  ends = [list(row).index(stop) + 1 if stop in row else G for row in plain]
  tokens, log_probs, rate = pk.generate(
      model_fn, params, _PROMPT, G, **options, stop_tokens=stop, pad_token=V,
      draft_model_fn=model_fn, draft_params=_perturbed(params, 0.05), num_draft_tokens=K,
      return_acceptance_rate=True)
  for b, end in enumerate(ends):
    np.testing.assert_array_equal(tokens[b], [*plain[b, :end], *[V] * (G - end)])
    np.testing.assert_allclose(log_probs[b, :end], plain_log_probs[b, :end], atol=1e-5,
                               rtol=1e-5)
    np.testing.assert_array_equal(log_probs[b, end:], 0)
  assert rate.shape == (B,) and 0.1 < np.nanmean(rate) < 0.9


def test_sampled_tokens_follow_the_models_distribution():
  """N sequences of one prompt, each a first token from the prefill and a
  second from a round of speculative sampling with a draft that disagrees
  often: the joint frequencies of the two are the model's filtered
  distribution. E[TV] <= sqrt(C / N) / 2 over C cells (Cauchy-Schwarz on
  the binomial deviations), and TV moves by at most 1 / N per sample, so it
  exceeds its mean by t with probability at most exp(-2 N t^2) (McDiarmid):
  the bound fails a correct sampler about once in 10^4 runs."""
  vocab, n = 6, 20_000
  model_fn = functools.partial(_small_transformer_lm, vocab)
  draft_fn = lambda: pk.TokenModel(pk.Transformer(8, 2, 1, is_causal=True), vocab_size=vocab)
  prompt = np.array([[1, 4, 2]])
  params = _random_params(model_fn, prompt, seed=1)
  draft_params = _random_params(draft_fn, prompt, seed=2)
  options = dict(temperature=0.9, top_k=5, top_p=0.95, repetition_penalty=1.3)
  tokens, rate = pk.generate(model_fn, params, np.repeat(prompt, n, axis=0), 2, rng=0,
                             draft_model_fn=draft_fn, draft_params=draft_params,
                             num_draft_tokens=2, return_acceptance_rate=True, **options)
  counts = np.zeros((vocab, vocab))
  np.add.at(counts, tuple(np.asarray(tokens).T), 1)

  def filtered(logits, seen):                                     # [R, V] -> probabilities
    scores, _ = generation._scores(logits, seen, jnp.full(len(logits), 0.9), greedy=False,
                                   top_k=5, top_p=0.95, min_p=None, repetition_penalty=1.3)
    return np.asarray(jax.nn.softmax(scores))

  apply = jax.jit(hk.without_apply_rng(hk.transform(lambda t: model_fn()(t))).apply)
  seen = np.isin(np.arange(vocab), prompt)[None]                  # [1, V]
  first = filtered(apply(params, prompt)[:, -1], seen)[0]         # [V]
  both = np.concatenate([np.repeat(prompt, vocab, 0), np.arange(vocab)[:, None]], axis=1)
  second = filtered(apply(params, both)[:, -1], seen | np.eye(vocab, dtype=bool))   # [V, V]
  joint = first[:, None] * second
  bound = np.sqrt(joint.size / n) / 2 + np.sqrt(np.log(1e4) / (2 * n))
  assert 0.5 * np.abs(counts / n - joint).sum() < bound
  # The draft alone is far off, and the model often rejects it.
  draft_apply = jax.jit(hk.without_apply_rng(hk.transform(lambda t: draft_fn()(t))).apply)
  draft_second = filtered(draft_apply(draft_params, both)[:, -1],
                          seen | np.eye(vocab, dtype=bool))
  assert 0.5 * np.abs(first[:, None] * draft_second - joint).sum() > 3 * bound
  assert 0.1 < float(np.mean(rate)) < 0.9


def test_bad_arguments_raise():
  params = _random_params(_transformer_lm, _PROMPT)
  draft = dict(draft_model_fn=_small_transformer_lm,
               draft_params=_random_params(_small_transformer_lm, _PROMPT))
  gen = lambda **kw: pk.generate(_transformer_lm, params, _PROMPT, 2, temperature=0, **kw)
  wrong_vocab = functools.partial(_small_transformer_lm, V + 1)
  for kwargs, match in [
      ({**draft, "num_draft_tokens": 0}, "num_draft_tokens"),
      ({**draft, "draft_model_fn": wrong_vocab}, "draft_model_fn"),
      ({**draft, "draft_params": None}, "draft_params"),
      ({**draft, "draft_model_fn": "small"}, "draft_model_fn"),
      ({"draft_params": draft["draft_params"]}, "draft_params"),
      ({"num_draft_tokens": 2}, "num_draft_tokens"),
      ({"return_acceptance_rate": True}, "return_acceptance_rate"),
  ]:
    with pytest.raises(ValueError, match=f"`{match}`"):
      gen(**kwargs)
  with pytest.raises(TypeError, match="num_draft_tokens"):
    gen(**draft, num_draft_tokens=2.0)
