"""generate() and TokenModel: greedy decoding is the argmax of the full
forward pass at each position, sampling is reproducible and respects top_k,
bad arguments raise."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pk
from probjax_hk import generation

V, B, T, G = 13, 3, 4, 6


def _transformer_lm():
  return generation.TokenModel(
      pk.Transformer(16, 4, 2, num_kv_heads=2, is_causal=True, use_rope=True,
                     local_window_size=5), vocab_size=V)


def _ssm_lm():
  return generation.TokenModel(
      pk.SSMModel(8, 16, 16, 2, cell=pk.Mamba2Cell,
                  cell_kwargs={"head_dim": 8, "state_dim": 4}, scan_layers=True),
      vocab_size=V)


def _forward(model_fn):
  return hk.without_apply_rng(hk.transform(lambda tokens: model_fn()(tokens)))


def _setup(model_fn):
  prompt = jax.random.randint(jax.random.key(0), (B, T), 0, V)
  forward = _forward(model_fn)
  return prompt, forward, jax.jit(forward.init)(jax.random.key(1), prompt)


@pytest.mark.parametrize("model_fn", [_transformer_lm, _ssm_lm], ids=["transformer", "ssm"])
def test_greedy_is_the_argmax_of_the_full_forward(model_fn):
  prompt, forward, params = _setup(model_fn)
  tokens = generation.generate(model_fn, params, prompt, G, temperature=0)
  assert tokens.shape == (B, G) and tokens.dtype == jnp.int32
  logits = jax.jit(forward.apply)(params, jnp.concatenate([prompt, tokens], axis=1))
  np.testing.assert_array_equal(tokens, jnp.argmax(logits[:, T - 1:-1], axis=-1))


def test_sampling_is_reproducible_and_stays_in_the_top_k():
  prompt, forward, params = _setup(_transformer_lm)
  sample = lambda seed, **kw: generation.generate(
      _transformer_lm, params, prompt, G, rng=jax.random.key(seed), temperature=2.0, **kw)
  tokens = sample(0, top_k=3)
  np.testing.assert_array_equal(sample(0, top_k=3), tokens)
  assert not np.array_equal(sample(1, top_k=3), tokens)
  logits = jax.jit(forward.apply)(params, jnp.concatenate([prompt, tokens], axis=1))
  top_3 = jax.lax.top_k(logits[:, T - 1:-1], 3)[1]                       # [B, G, 3]
  assert (top_3 == tokens[..., None]).any(-1).all()
  # Without top_k, a hot temperature leaves the top 3 somewhere.
  free = sample(0)
  logits = jax.jit(forward.apply)(params, jnp.concatenate([prompt, free], axis=1))
  assert not (jax.lax.top_k(logits[:, T - 1:-1], 3)[1] == free[..., None]).any(-1).all()


def test_sample_top_k_and_temperature():
  logits = jnp.log(jnp.array([[0.1, 0.4, 0.2, 0.3]] * 4000))
  draw = lambda key, **kw: generation._sample(logits, jax.random.key(key), jnp.float32(1.0),
                                              greedy=False, **kw)
  np.testing.assert_array_equal(draw(0, top_k=1), 1)
  np.testing.assert_array_equal(
      generation._sample(logits, None, 1.0, greedy=True, top_k=None), 1)
  two = np.bincount(np.asarray(draw(0, top_k=2)), minlength=4) / 4000
  np.testing.assert_allclose(two, [0, 4 / 7, 0, 3 / 7], atol=0.03)
  every = np.bincount(np.asarray(draw(1, top_k=None)), minlength=4) / 4000
  np.testing.assert_allclose(every, [0.1, 0.4, 0.2, 0.3], atol=0.03)


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
  ]:
    with pytest.raises(ValueError, match=match):
      gen(**kwargs)
  for kwargs in ({"num_tokens": 2.0}, {"temperature": "hot"}, {"top_k": 1.5}):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
      gen(**kwargs)
  with pytest.raises(ValueError, match="tokens"):
    _forward(_transformer_lm).init(jax.random.key(0), prompt.astype(jnp.float32))
  with pytest.raises(ValueError, match="embed_dim"):
    hk.transform(lambda: generation.TokenModel(hk.Linear(3), vocab_size=V)).init(None)
