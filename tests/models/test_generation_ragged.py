"""generate(prompt_lengths=): a batch of right-padded prompts of different
lengths gives each prompt's own tokens, for the Transformer and every SSM
cell; their log-probabilities are those of stepping through each unpadded
sequence alone. Also a Transformer's ragged prefill after a state."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pk

V, G = 11, 5
LENGTHS = (2, 5, 8, 9)
T = max(LENGTHS)

# SSDCell masks its steps as Mamba2Cell does (`ssd_inputs`), without the convolution.
_CELLS = {
    "lru": (pk.LRUCell, {"state_dim": 6}),
    "mamba": (pk.MambaCell, {"state_dim": 4, "conv_width": 3}),
    "mamba2": (pk.Mamba2Cell, {"head_dim": 4, "state_dim": 4, "conv_width": 3}),
    "gated_delta_net": (pk.GatedDeltaNetCell, {"num_heads": 2, "conv_width": 3}),
}


def _transformer_lm():
  return pk.TokenModel(pk.Transformer(16, 4, 2, num_kv_heads=2, is_causal=True,
                                      use_rope=True, local_window_size=4), vocab_size=V)


def _ssm_lm(cell):
  cls, kwargs = _CELLS[cell]
  # One layer: the chunked XLA forms are slow to compile; the state passing is per layer.
  return lambda: pk.TokenModel(pk.SSMModel(8, 8, 8, 1, cell=cls, cell_kwargs=kwargs,
                                           scan_layers=cell == "mamba2"), vocab_size=V)


_MODELS = {"transformer": _transformer_lm, **{cell: _ssm_lm(cell) for cell in _CELLS}}


def _random_params(transformed, *args):
  """Normal(0, 0.5) values in the shapes of `transformed.init`: traced, not
  compiled (any finite parameters decode the same ragged or alone)."""
  shapes = jax.eval_shape(transformed.init, jax.random.key(0), *args)
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(s.dtype), shapes)


def _stepped_logits(model_fn):
  """tokens [B, S] -> logits [B, S, V], one `step` at a time from
  `initial_state`: the reference, a path that neither pads nor prefills."""
  def logits(tokens):
    model = model_fn()
    def one_step(state, token):
      logits, state = model.step(token, state)
      return state, logits
    state = model.initial_state(tokens.shape[0], tokens.shape[1])
    return jnp.swapaxes(hk.scan(one_step, state, tokens.T)[1], 0, 1)
  return jax.jit(hk.without_apply_rng(hk.transform(logits)).apply)


@pytest.mark.parametrize("name", list(_MODELS))
def test_ragged_prompts_decode_as_if_alone(name):
  model_fn = _MODELS[name]
  lengths = np.array(LENGTHS)
  prompt = np.asarray(jax.random.randint(jax.random.key(0), (len(LENGTHS), T), 0, V))
  padded = np.where(np.arange(T) < lengths[:, None], prompt, -1)   # any padding will do
  forward = hk.without_apply_rng(hk.transform(lambda tokens: model_fn()(tokens)))
  params = _random_params(forward, prompt)
  tokens, log_probs = pk.generate(model_fn, params, padded, G, temperature=0,
                                  prompt_lengths=lengths, return_log_probs=True)
  # Each sequence alone, unpadded, then right-padded to one shape: a causal
  # model's logits at a position depend only on the tokens up to it.
  alone = np.zeros((len(LENGTHS), T + G), np.int32)
  for b, n in enumerate(LENGTHS):
    alone[b, :n + G] = np.concatenate([prompt[b, :n], tokens[b]])
  logits = _stepped_logits(model_fn)(params, alone)                  # [B, T + G, V]
  positions = lengths[:, None] - 1 + np.arange(G)                    # [B, G]
  logits = np.take_along_axis(np.asarray(logits), positions[..., None], axis=1)
  np.testing.assert_array_equal(tokens, logits.argmax(-1))
  expected = np.take_along_axis(jax.nn.log_softmax(logits), np.asarray(tokens)[..., None],
                                axis=-1)[..., 0]
  np.testing.assert_allclose(log_probs, expected, atol=2e-5, rtol=2e-5)


def test_sampling_with_per_sequence_keys_is_as_if_alone():
  """Each sequence of a ragged batch samples, with its own key, the tokens it
  samples alone with that key."""
  model_fn = _MODELS[next(iter(_MODELS))]
  lengths = np.array(LENGTHS)
  prompt = np.asarray(jax.random.randint(jax.random.key(1), (len(LENGTHS), T), 0, V))
  forward = hk.without_apply_rng(hk.transform(lambda tokens: model_fn()(tokens)))
  params = _random_params(forward, prompt)
  keys = jax.random.split(jax.random.key(7), len(LENGTHS))
  sample = lambda p, n, k: pk.generate(model_fn, params, p, G, rng=k, temperature=1.0,
                                       top_k=8, prompt_lengths=n)
  together = np.asarray(sample(prompt, lengths, keys))
  for b, n in enumerate(LENGTHS):
    alone = sample(prompt[b:b + 1], lengths[b:b + 1], keys[b:b + 1])
    np.testing.assert_array_equal(together[b], np.asarray(alone)[0])
  assert len({tuple(row) for row in together}) > 1  # the rows drew different tokens
  with pytest.raises(ValueError, match=r"`rng` must be one PRNG key or \[B\]"):
    sample(prompt, lengths, keys[:2])


def test_transformer_ragged_chunk_after_a_state():
  """A ragged prefill that continues a state: each sequence's valid outputs
  and its next step are those of its own unpadded sequence."""
  chunk_lengths = np.array([1, 4])
  total = 2 + chunk_lengths                                           # [3, 6]
  x = jax.random.normal(jax.random.key(0), (2, 7, 16))                # [B, T, D]

  def f(x):
    model = pk.Transformer(16, 4, 1, is_causal=True, use_rope=True)
    _, state = model.prefill(x[:, :2], max_length=8)
    y_chunk, state = model.prefill(x[:, 2:6], state, lengths=chunk_lengths)
    # The next token of sequence b is x[b, 6], at position total[b].
    y_next, state = model.step(x[:, 6], state)
    alone = jnp.stack([jnp.concatenate([x[b, :n], x[b, 6:], jnp.zeros((6 - n, 16))])
                       for b, n in enumerate(total)])                 # [B, 7, D]
    return y_chunk, y_next, state.lengths, model(alone)
  f = hk.without_apply_rng(hk.transform(f))
  y_chunk, y_next, lengths, y_alone = jax.jit(f.apply)(_random_params(f, x), x)
  np.testing.assert_array_equal(lengths, total + 1)
  for b, n in enumerate(total):
    np.testing.assert_allclose(y_chunk[b, :n - 2], y_alone[b, 2:n], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(y_next[b], y_alone[b, n], atol=1e-5, rtol=1e-5)
