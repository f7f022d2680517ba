"""generate() and TokenModel: greedy decoding is the argmax of the full
forward pass at each position, sampling is reproducible and respects top_k;
each logits filter against a numpy version of Hugging Face's, stop tokens,
log-probabilities; a float32 model generating in bfloat16; bad arguments
raise.

Compilation dominates on a CPU: the prompt comes from NumPy, parameters are
drawn on the host (tests/models/random_params.py), and the Transformer has
one layer (generate sees a model only through prefill and step).
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import probjax_hk as pk
from probjax_hk import generation
from tests.models.random_params import random_params

V, B, T, G = 13, 3, 4, 6


def _transformer_lm(dtype=None):
  return generation.TokenModel(
      pk.Transformer(16, 4, 1, num_kv_heads=2, is_causal=True, use_rope=True,
                     local_window_size=5), vocab_size=V, dtype=dtype)


def _ssm_lm(dtype=None):
  return generation.TokenModel(
      pk.SSMModel(8, 16, 16, 2, cell=pk.Mamba2Cell,
                  cell_kwargs={"head_dim": 8, "state_dim": 4}, scan_layers=True),
      vocab_size=V, dtype=dtype)


def _forward(model_fn):
  return hk.without_apply_rng(hk.transform(lambda tokens: model_fn()(tokens)))


@functools.cache  # One prompt and parameter draw per model for the whole file.
def _setup(model_fn):
  prompt = np.random.default_rng(0).integers(0, V, (B, T)).astype(np.int32)
  forward = _forward(model_fn)
  return prompt, forward, random_params(forward, prompt)


@functools.cache
def _jitted_apply(forward):
  return jax.jit(forward.apply)


def _next_logits(forward, params, prompt, tokens):
  """[B, G, V] NumPy logits of the full forward pass at the positions that
  predict `tokens` [B, G] after `prompt` [B, T]."""
  logits = _jitted_apply(forward)(params, np.concatenate([prompt, tokens], axis=1))
  return np.asarray(logits)[:, T - 1:-1]


@pytest.mark.parametrize("model_fn", [_transformer_lm, _ssm_lm], ids=["transformer", "ssm"])
def test_greedy_is_the_argmax_of_the_full_forward(model_fn):
  prompt, forward, params = _setup(model_fn)
  tokens = generation.generate(model_fn, params, prompt, G, temperature=0)
  assert tokens.shape == (B, G) and tokens.dtype == jnp.int32
  np.testing.assert_array_equal(tokens, _next_logits(forward, params, prompt, tokens).argmax(-1))


def test_sampling_is_reproducible_and_stays_in_the_top_k():
  prompt, forward, params = _setup(_transformer_lm)
  sample = lambda seed, **kw: generation.generate(
      _transformer_lm, params, prompt, G, rng=jax.random.key(seed), temperature=2.0, **kw)
  tokens = sample(0, top_k=3)
  np.testing.assert_array_equal(sample(0, top_k=3), tokens)
  assert not np.array_equal(sample(1, top_k=3), tokens)
  top_3 = np.argsort(-_next_logits(forward, params, prompt, tokens), -1)[..., :3]  # [B, G, 3]
  assert (top_3 == np.asarray(tokens)[..., None]).any(-1).all()
  # Without top_k, a hot temperature leaves the top 3 somewhere.
  free = np.asarray(sample(0))
  top_3 = np.argsort(-_next_logits(forward, params, prompt, free), -1)[..., :3]
  assert not (top_3 == free[..., None]).any(-1).all()


# Plain numpy versions of Hugging Face's logits processors
# (transformers/generation/logits_process.py), the specification of the filters.
def _np_softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _np_log_softmax(x):
  x = np.asarray(x, np.float64) - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_repetition_penalty(scores, seen, penalty):
  return np.where(seen, np.where(scores < 0, scores * penalty, scores / penalty), scores)


def _np_top_k(scores, k):
  kth = np.sort(scores, axis=-1)[:, -k][:, None]
  return np.where(scores < kth, -np.inf, scores)


def _np_top_p(scores, top_p):
  order = np.argsort(scores, axis=-1)                               # ascending
  cumulative = np.cumsum(_np_softmax(np.take_along_axis(scores, order, -1)), -1)
  remove = cumulative <= 1 - top_p
  remove[:, -1] = False                                             # min_tokens_to_keep
  out = scores.copy()
  np.put_along_axis(out, order, np.where(remove, -np.inf, np.take_along_axis(scores, order, -1)),
                    -1)
  return out


def _np_min_p(scores, min_p):
  probs = _np_softmax(scores)
  return np.where(probs < min_p * probs.max(-1, keepdims=True), -np.inf, scores)


_LOGITS = np.random.default_rng(0).normal(0, 2, (4, 10)).astype(np.float32)   # [B, V]
_SEEN = np.random.default_rng(1).random((4, 10)) < 0.4
_TEMPERATURE = np.array([0.5, 1.0, 2.0, 0.7], np.float32)


@pytest.mark.parametrize("options,reference", [
    ({}, lambda x: x),
    ({"top_k": 3}, lambda x: _np_top_k(x, 3)),
    ({"top_p": 0.7}, lambda x: _np_top_p(x, 0.7)),
    ({"min_p": 0.2}, lambda x: _np_min_p(x, 0.2)),
    ({"top_k": 6, "top_p": 0.8, "min_p": 0.1},
     lambda x: _np_min_p(_np_top_p(_np_top_k(x, 6), 0.8), 0.1)),
], ids=["temperature", "top_k", "top_p", "min_p", "all"])
def test_warp_matches_numpy(options, reference):
  """The temperature, then top_k, top_p and min_p, as Hugging Face applies them."""
  got = generation._warp(jnp.asarray(_LOGITS), jnp.asarray(_TEMPERATURE), **options)
  want = reference(_LOGITS / _TEMPERATURE[:, None])
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert np.isfinite(got).any(-1).all()
  if options:  # Each case removes something, so the test sees the filter act.
    assert np.isinf(want).any()


def test_repetition_penalty_matches_numpy():
  got = generation._penalize(jnp.asarray(_LOGITS), jnp.asarray(_SEEN), 1.5)
  np.testing.assert_allclose(got, _np_repetition_penalty(_LOGITS, _SEEN, 1.5), rtol=1e-6)
  assert not np.allclose(got, _LOGITS)


def test_choose_samples_the_warped_distribution():
  """Frequencies and log-probabilities of the warped softmax; a row at
  temperature 0 takes the argmax of the penalized logits."""
  choose = jax.jit(generation._choose, static_argnames=(
      "greedy", "top_k", "top_p", "min_p", "repetition_penalty"))
  logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3]] * 4000, np.float32))
  temperature = np.ones(4000, np.float32)
  temperature[0] = 0.0
  # top_p=0.6 keeps 0.4 and 0.3 (the mass above 0.2 is 0.7).
  keys = jax.random.split(jax.random.key(0), 4000)                    # one per row
  tokens, log_probs = choose(logits, keys, None, temperature, greedy=False,
                             top_k=None, top_p=0.6, min_p=None, repetition_penalty=None)
  tokens, log_probs = np.asarray(tokens), np.asarray(log_probs)
  np.testing.assert_allclose(np.bincount(tokens[1:], minlength=4) / 3999,
                             [0, 4 / 7, 0, 3 / 7], atol=0.03)
  np.testing.assert_allclose(log_probs[1:], np.where(tokens[1:] == 1, np.log(4 / 7),
                                                     np.log(3 / 7)), rtol=1e-5)
  assert tokens[0] == 1 and np.isclose(log_probs[0], np.log(0.4))
  # A penalty of 4 on token 1 (logit log 0.4 < 0: times 4) hands the argmax to token 3.
  seen = np.zeros((2, 4), bool)
  seen[:, 1] = True
  tokens, log_probs = choose(logits[:2], None, seen, np.zeros(2, np.float32), greedy=True,
                             top_k=None, top_p=None, min_p=None, repetition_penalty=4.0)
  penalized = _np_repetition_penalty(np.log([0.1, 0.4, 0.2, 0.3]), [0, 1, 0, 0], 4.0)
  np.testing.assert_array_equal(tokens, 3)
  np.testing.assert_allclose(log_probs, np.log(_np_softmax(penalized)[3]), rtol=1e-5)


class _CountingLM:
  """`_transformer_lm` that counts its decoding steps (the loop's iterations)."""
  steps = []
  vocab_size = V

  def __init__(self):
    self.model = _transformer_lm()

  def prefill(self, tokens, **kwargs):
    return self.model.prefill(tokens, **kwargs)

  def step(self, tokens, state):
    jax.debug.callback(lambda: _CountingLM.steps.append(1))
    return self.model.step(tokens, state)


def test_stop_tokens_pad_the_rest_and_end_the_loop_early():
  prompt, forward, params = _setup(_transformer_lm)
  plain = np.asarray(generation.generate(_transformer_lm, params, prompt, G, temperature=0))
  # Every sequence meets one of these by its second token.
  stops = sorted(set(plain[:, 1].tolist()))
  ends = [min(i for i, t in enumerate(row) if t in stops) for row in plain]    # [B]
  _CountingLM.steps.clear()
  tokens, log_probs = generation.generate(_CountingLM, params, prompt, G, temperature=0,
                                          stop_tokens=stops, pad_token=V,
                                          return_log_probs=True)
  jax.effects_barrier()
  assert len(_CountingLM.steps) == max(ends) < G - 1        # no step once all are done
  plain_log_probs = np.take_along_axis(_np_log_softmax(
      _next_logits(forward, params, prompt, plain)), plain[..., None], axis=-1)[..., 0]
  for b, end in enumerate(ends):
    np.testing.assert_array_equal(tokens[b], [*plain[b, :end + 1], *[V] * (G - end - 1)])
    np.testing.assert_allclose(log_probs[b, :end + 1], plain_log_probs[b, :end + 1],
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(log_probs[b, end + 1:], 0)
  # The default pad is the first stop token; a single id works too.
  tokens = generation.generate(_CountingLM, params, prompt, G, temperature=0,
                               stop_tokens=stops)
  assert all(tokens[b, end + 1:].tolist() == [stops[0]] * (G - end - 1)
             for b, end in enumerate(ends))
  single = generation.generate(_transformer_lm, params, prompt, G, temperature=0,
                               stop_tokens=int(plain[0, 0]))
  assert single[0].tolist() == [plain[0, 0]] * G


def test_sampled_log_probs_are_the_filtered_forward_logits():
  """Every option at once, a greedy row among sampled ones: each token's
  log-probability is the numpy-filtered softmax of the forward pass's logits."""
  prompt, forward, params = _setup(_transformer_lm)
  temperature = np.array([0.0, 0.8, 1.5])
  tokens, log_probs = generation.generate(
      _transformer_lm, params, prompt, G, rng=3, temperature=temperature, top_k=8, top_p=0.9,
      min_p=0.05, repetition_penalty=1.3, return_log_probs=True)
  tokens = np.asarray(tokens)
  logits = _next_logits(forward, params, prompt, tokens).astype(np.float64)  # [B, G, V]
  sequences = np.concatenate([prompt, tokens], axis=1)
  for g in range(G):
    seen = np.zeros((B, V), bool)
    for b in range(B):
      seen[b, sequences[b, :T + g]] = True
    penalized = _np_repetition_penalty(logits[:, g], seen, 1.3)
    hot = np.where(temperature > 0, temperature, 1)[:, None]
    warped = _np_min_p(_np_top_p(_np_top_k(penalized / hot, 8), 0.9), 0.05)
    scores = np.where(temperature[:, None] > 0, warped, penalized)
    with np.errstate(divide="ignore"):  # log 0 for the removed tokens
      expected = np.log(_np_softmax(scores))[np.arange(B), tokens[:, g]]
    np.testing.assert_allclose(log_probs[:, g], expected, atol=1e-4, rtol=1e-4)
    assert tokens[0, g] == penalized[0].argmax()
  assert np.isinf(warped).any()   # the filters removed tokens, none of them drawn


# The same models computing in bfloat16 (the same parameters); one compile each.
_BF16 = {fn: functools.partial(fn, dtype=jnp.bfloat16) for fn in (_transformer_lm, _ssm_lm)}


@pytest.mark.parametrize("model_fn", [_transformer_lm, _ssm_lm], ids=["transformer", "ssm"])
def test_a_float32_model_generates_in_bfloat16(model_fn):
  """Greedy tokens in bf16 are the float32 forward's argmax up to bf16's
  rounding, with its log-probabilities; the body computes (and a Transformer
  caches) in bf16 from float32 parameters, the logits come out float32."""
  prompt, forward, params = _setup(model_fn)
  tokens, log_probs = generation.generate(_BF16[model_fn], params, prompt, G, temperature=0,
                                          return_log_probs=True)
  tokens = np.asarray(tokens)
  logits = _next_logits(forward, params, prompt, tokens)               # [B, G, V] float32
  chosen = np.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
  assert (chosen >= logits.max(-1) - 0.05).all()
  want = np.take_along_axis(_np_log_softmax(logits), tokens[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(log_probs, want, atol=0.05)
  # Shapes and dtypes only: traced, not run.
  prefill = jax.eval_shape(hk.transform(
      lambda p: _BF16[model_fn]().prefill(p, max_length=T + 1)).apply, params, None, prompt)
  init = jax.eval_shape(hk.transform(
      lambda: _BF16[model_fn]().initial_state(B, T + 1)).apply, params, None)
  states = {a.dtype for a in jax.tree.leaves((prefill[1], init)) if a.dtype != jnp.int32}
  assert prefill[0].dtype == jnp.float32
  # A Transformer's cache in bf16; the SSM cells keep float32 states.
  assert states == {jnp.dtype(jnp.bfloat16 if model_fn is _transformer_lm else jnp.float32)}


def test_token_model_follows_a_mixed_precision_policy():
  prompt, _, params = _setup(_transformer_lm)
  policy = jmp.get_policy("params=float32,compute=bfloat16,output=bfloat16")
  with hk.mixed_precision.push_policy(generation.TokenModel, policy):
    logits, state = jax.eval_shape(hk.transform(
        lambda p: _transformer_lm().prefill(p, max_length=T + 1)).apply, params, None, prompt)
  assert logits.dtype == jnp.bfloat16
  assert {c.key.dtype for c in state.caches} == {jnp.dtype(jnp.bfloat16)}


def test_token_model_embeds_with_the_bodys_width():
  prompt, _, params = _setup(_ssm_lm)
  assert params["token_model"]["embeddings"].shape == (V, 8)         # SSMModel's input_dim
  assert params["token_model/logits"]["w"].shape == (16, V)


def test_bad_arguments_raise():
  prompt, _, params = _setup(_transformer_lm)
  gen = lambda **kw: generation.generate(
      **{"model_fn": _transformer_lm, "params": params, "prompt": prompt, "num_tokens": 2,
         "rng": jax.random.key(0), **kw})
  for kwargs, match in [
      ({"model_fn": 3}, "model_fn"),
      ({"prompt": prompt.astype(jnp.float32)}, "prompt"),
      ({"prompt": prompt[0]}, "prompt"),
      ({"prompt": prompt[:, :0]}, "prompt"),
      ({"num_tokens": 0}, "num_tokens"),
      ({"temperature": -1.0}, "temperature"),
      ({"top_k": 0}, "top_k"),
      ({"top_k": V + 1}, "top_k"),
      ({"rng": None}, "rng"),
      ({"temperature": np.ones(B + 1)}, "temperature"),
      ({"temperature": np.array([1.0, -1.0, 1.0])}, "temperature"),
      ({"top_p": 1.5}, "top_p"),
      ({"min_p": -0.1}, "min_p"),
      ({"repetition_penalty": 0.0}, "repetition_penalty"),
      ({"stop_tokens": V}, "stop_tokens"),
      ({"stop_tokens": []}, "stop_tokens"),
      ({"pad_token": 0}, "pad_token"),
      ({"stop_tokens": 1, "pad_token": -1}, "pad_token"),
      ({"prompt_lengths": np.array([1, 0, 2])}, "prompt_lengths"),
      ({"prompt_lengths": np.array([1, T + 1, 2])}, "prompt_lengths"),
      ({"prompt_lengths": np.array([1, 2])}, "prompt_lengths"),
  ]:
    with pytest.raises(ValueError, match=match):
      gen(**kwargs)
  for kwargs in ({"num_tokens": 2.0}, {"temperature": "hot"}, {"top_k": 1.5},
                 {"top_p": "0.9"}, {"stop_tokens": 1.0}, {"pad_token": 1.0},
                 {"return_log_probs": 1}):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
      gen(**kwargs)
  with pytest.raises(ValueError, match="tokens"):
    _forward(_transformer_lm).init(jax.random.key(0), prompt.astype(jnp.float32))
  with pytest.raises(ValueError, match="embed_dim"):
    hk.transform(lambda: generation.TokenModel(hk.Linear(3), vocab_size=V)).init(None)
  for dtype in (jnp.int32, "hot"):
    with pytest.raises(TypeError, match="dtype"):
      hk.transform(lambda: generation.TokenModel(hk.Linear(3), vocab_size=V, embed_dim=3,
                                                 dtype=dtype)).init(None)
