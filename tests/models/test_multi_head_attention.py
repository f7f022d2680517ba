"""MultiHeadAttention: `bias` and `mask` as jax.nn.dot_product_attention takes
them, passed to its attention_fn, and a constructor that documents itself."""

import inspect
import pydoc

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pk

B, T, S, D, N, K = 2, 6, 9, 32, 4, 2
_LENGTHS = jnp.array([9, 4])


def _inputs(dtype=jnp.float32):
  x = jax.random.normal(jax.random.PRNGKey(0), (B, T, D), jnp.float32).astype(dtype)
  context = jax.random.normal(jax.random.PRNGKey(1), (B, S, D), jnp.float32).astype(dtype)
  return x, context


def _apply(call, attention_fn=pk.dot_product_attention, dtype=jnp.float32):
  """`call(module, x, context)` with one set of parameters for every test."""
  model = hk.without_apply_rng(hk.transform(
      lambda x, c: call(pk.MultiHeadAttention(N, num_kv_heads=K, use_rope=True,
                                              attention_fn=attention_fn), x, c)))
  x, context = _inputs()
  params = model.init(jax.random.PRNGKey(2), x, context)
  x, context = _inputs(dtype)
  return model.apply(params, x, context)


def _key_padding_mask():  # [B, 1, 1, S]: the keys s < length of each example
  return (jnp.arange(S)[None, :] < _LENGTHS[:, None])[:, None, None, :]


def test_mask_equals_the_key_lengths_it_encodes():
  want = _apply(lambda m, x, c: m(x, c, key_value_seq_lengths=_LENGTHS))
  narrow = _apply(lambda m, x, c: m(x, c, mask=_key_padding_mask()))
  full = _apply(lambda m, x, c: m(x, c, mask=jnp.broadcast_to(_key_padding_mask(),
                                                             (B, N, T, S))))
  unmasked = _apply(lambda m, x, c: m(x, c))
  np.testing.assert_allclose(narrow, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(full, want, rtol=1e-5, atol=1e-5)
  assert not np.allclose(unmasked[1], want[1], atol=1e-3)  # example 1 is padded


def test_bias_is_added_to_the_logits():
  """A bias given to the call equals the same bias inside attention_fn; a
  large negative bias on the padding equals the mask."""
  bias = jax.random.normal(jax.random.PRNGKey(3), (1, N, T, S))
  got = _apply(lambda m, x, c: m(x, c, bias=bias))
  inside = lambda q, k, v, **kw: pk.dot_product_attention(q, k, v, bias=bias, **kw)
  want = _apply(lambda m, x, c: m(x, c), attention_fn=inside)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert not np.allclose(got, _apply(lambda m, x, c: m(x, c)), atol=1e-3)
  padding = jnp.where(_key_padding_mask(), 0.0, -1e9)
  np.testing.assert_allclose(_apply(lambda m, x, c: m(x, c, bias=padding)),
                             _apply(lambda m, x, c: m(x, c, mask=_key_padding_mask())),
                             rtol=1e-5, atol=1e-5)


def test_attention_fn_gets_bias_and_mask_only_when_given():
  seen = []

  def recording(q, k, v, **kwargs):
    seen.append(sorted(kwargs))
    return pk.dot_product_attention(q, k, v, **kwargs)

  def plain(q, k, v, *, is_causal=False, key_value_seq_lengths=None):  # no bias, no mask
    return pk.dot_product_attention(q, k, v, is_causal=is_causal,
                                    key_value_seq_lengths=key_value_seq_lengths)

  _apply(lambda m, x, c: m(x, c), attention_fn=recording)
  _apply(lambda m, x, c: m(x, c, mask=_key_padding_mask(), bias=jnp.zeros((S,))),
         attention_fn=recording)
  assert seen[-1] == ["bias", "is_causal", "key_value_seq_lengths", "mask"]
  assert "bias" not in seen[0] and "mask" not in seen[0]
  _apply(lambda m, x, c: m(x, c), attention_fn=plain)


def test_bfloat16_in_bfloat16_out_with_a_mask():
  out = _apply(lambda m, x, c: m(x, c, mask=_key_padding_mask()), dtype=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("kwargs, match", [
    (dict(mask=jnp.ones((B, N, T, S + 1), bool)),
     r"`mask` must be broadcastable to \[B, N, T, S\]"),
    (dict(mask=jnp.ones((1, B, N, T, S), bool)), "`mask` must be broadcastable"),
    (dict(mask=jnp.ones((B, 3, T, S), bool)), "`mask` must be broadcastable"),
    (dict(mask=jnp.ones((B, 1, 1, S), jnp.float32)), "`mask` must be boolean"),
    (dict(bias=jnp.ones((T + 1, S))),
     r"`bias` must be broadcastable to \[B, N, T, S\] = \(2, 4, 6, 9\)"),
])
def test_bad_mask_or_bias_raises(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _apply(lambda m, x, c: m(x, c, **kwargs))


def test_constructor_documents_its_arguments():
  """help() shows the constructor's own Args, not hk.Module's generic text."""
  doc = inspect.getdoc(pk.MultiHeadAttention.__init__)
  assert "Initializes the current module" not in doc and "Args:" in doc
  for name in inspect.signature(pk.MultiHeadAttention).parameters:
    assert f"{name}:" in doc, name
  page = pydoc.render_doc(pk.MultiHeadAttention, renderer=pydoc.plaintext)
  assert "num_kv_heads: K, the key/value heads" in page
