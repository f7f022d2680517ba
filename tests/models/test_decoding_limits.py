"""Tokens outside the vocabulary and decoding past the cache: a ValueError
naming the argument where the values are concrete; under `jit`, NaN outputs
for the affected sequences only, `TransformerState.overflowed`, and -1 tokens
from `generate` (which raises when it runs eagerly). Also `generate`'s int
seed and scalar temperatures."""

import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pk

B, D, V, G = 2, 16, 11, 3


def _transformer(**kwargs):
  return pk.Transformer(D, 4, 1, is_causal=True, use_rope=True, **kwargs)


def _lm():
  return pk.TokenModel(_transformer(), vocab_size=V)


def _raises(fn, match, *args):
  with pytest.raises(ValueError, match=match):
    hk.transform(fn).init(jax.random.key(0), *args)


def _x():
  return jax.random.normal(jax.random.key(0), (B, 6, D))              # [B, T, D]


def test_overflowing_the_cache_raises_eagerly():
  """Concrete lengths are checked before anything runs."""
  x = _x()

  def decode_after(lengths, max_length, fn):
    def f(x):
      model = _transformer()
      state = model.initial_state(B, max_length)
      return fn(model, x, state._replace(lengths=jnp.full((B,), lengths, jnp.int32)))
    return f

  step = lambda model, x, state: model.step(x[:, 4], state)
  chunk = lambda model, x, state: model.prefill(x[:, 3:], state)
  _raises(decode_after(4, 4, step), r"cache of `state` is full: 1 new .* max_length=4", x)
  _raises(decode_after(4, 6, chunk), r"cache of `state` is full: 3 new .* max_length=6", x)
  _raises(decode_after(-1, 6, step), "state.lengths", x)


def test_overflowing_the_cache_under_jit_gives_nan_and_the_flag():
  """Sequence 0 overflows a 5-slot cache with a 3-token chunk, sequence 1
  fills it exactly: only sequence 0 is NaN and flagged, sequence 1 equals the
  sequence path; a step after that overflows both."""
  def f(x):
    model = _transformer()
    y = model(x)
    _, state = model.prefill(x[:, :3], max_length=5)
    state = state._replace(lengths=jnp.array([3, 2], jnp.int32))
    chunk = jnp.stack([x[0, 3:6], x[1, 2:5]])                         # [B, 3, D]
    y_chunk, state = model.prefill(chunk, state)
    overflowed_chunk = state.overflowed
    y_t, state = model.step(x[:, 5], state)
    return y, y_chunk, overflowed_chunk, y_t, state
  f = hk.without_apply_rng(hk.transform(f))
  x = _x()
  y, y_chunk, overflowed_chunk, y_t, state = jax.jit(f.apply)(
      jax.jit(f.init)(jax.random.key(1), x), x)
  assert overflowed_chunk.tolist() == [True, False]
  assert np.isnan(y_chunk[0]).all()
  np.testing.assert_allclose(y_chunk[1], y[1, 2:5], atol=1e-5, rtol=1e-5)
  assert np.isnan(y_t).all() and state.overflowed.tolist() == [True, True]
  assert state.lengths.tolist() == [7, 6] and state.max_length == 5
  # The stacked layout of scan_layers has the same cache size.
  stacked = hk.transform(lambda: _transformer(scan_layers=True).initial_state(B, 5))
  stacked = stacked.apply({}, None)
  assert stacked.max_length == 5 and not stacked.overflowed.any()


def test_ssm_checks_max_length_as_the_transformer_does():
  x = _x()
  ssm = lambda: pk.SSMModel(D, 8, 3, 1, cell=pk.LRUCell, cell_kwargs={"state_dim": 4})
  _raises(lambda x: ssm().prefill(x, max_length=5), "max_length", x)
  _raises(lambda: ssm().initial_state(B, 0), "max_length")


def _lm_setup():
  prompt = jax.random.randint(jax.random.key(2), (B, 4), 0, V)       # [B, T]
  forward = hk.without_apply_rng(hk.transform(lambda tokens: _lm()(tokens)))
  return prompt, forward, jax.jit(forward.init)(jax.random.key(3), prompt)


@pytest.mark.parametrize("bad", [V, -1])
def test_out_of_range_tokens(bad):
  """Eagerly a ValueError naming the argument; under jit NaN logits for the
  sequence holding the token, the other unchanged; never a wrapped row."""
  prompt, forward, params = _lm_setup()
  bad_prompt = prompt.at[0, 2].set(bad)
  with pytest.raises(ValueError, match=r"`tokens` must lie in \[0, vocab_size\)"):
    forward.apply(params, bad_prompt)
  _raises(lambda t: _lm().step(t, _lm().initial_state(B, 4)), "tokens", bad_prompt[:, 2])
  with pytest.raises(ValueError, match="`prompt`"):
    pk.generate(_lm, params, bad_prompt, G, temperature=0)
  apply = jax.jit(forward.apply)
  logits = apply(params, bad_prompt)                                  # [B, T, V]
  assert np.isnan(logits[0, 2:]).all()
  np.testing.assert_array_equal(logits[1], apply(params, prompt)[1])


def test_generate_marks_and_raises_on_nan_logits():
  prompt, _, params = _lm_setup()
  greedy = lambda params, prompt: pk.generate(_lm, params, prompt, G, temperature=0)
  clean = greedy(params, prompt)
  assert (clean >= 0).all()
  # A NaN embedding row for the first token of sequence 0: eagerly an error
  # naming the sequences that hold that token.
  token = int(prompt[0, 0])
  embeddings = params["token_model"]["embeddings"].at[token].set(jnp.nan)
  poisoned = {**params, "token_model": {"embeddings": embeddings}}
  rows = [b for b in range(B) if token in prompt[b].tolist()]
  with pytest.raises(FloatingPointError, match=re.escape(f"sequence(s) {rows}")):
    greedy(poisoned, prompt)
  # Traced, an out-of-range prompt token gives -1 tokens for its sequence.
  traced = jax.jit(greedy)(params, prompt.at[0, 1].set(V))
  assert traced[0].tolist() == [-1] * G
  np.testing.assert_array_equal(traced[1], clean[1])


def test_generate_takes_an_int_seed_and_scalar_temperatures():
  prompt, _, params = _lm_setup()
  sample = lambda rng, temperature: pk.generate(_lm, params, prompt, G, rng=rng,
                                                temperature=temperature, top_k=None)
  tokens = sample(42, jnp.float32(0.8))
  np.testing.assert_array_equal(tokens, sample(jax.random.key(42), np.float32(0.8)))
  np.testing.assert_array_equal(tokens, sample(jax.random.key(42), 0.8))
  assert not np.array_equal(tokens, sample(43, 0.8))
  for temperature in (True, jnp.ones(B) > 0, "hot"):
    with pytest.raises(TypeError, match="temperature"):
      sample(0, temperature)
  with pytest.raises(TypeError, match="temperature"):
    jax.jit(lambda t: sample(0, t))(0.8)
  with pytest.raises(ValueError, match="temperature"):
    sample(0, jnp.float32(-1.0))
