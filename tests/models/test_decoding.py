"""The decoding interface of every sequence model: a prompt's prefill, then
steps (or a second prefill), equal the sequence path on the whole sequence;
the Transformer's KV cache (GQA, sliding windows, scan_layers, remat, bf16),
`cached_attention`, and the errors.

Compilation dominates on a CPU, so inputs come from NumPy, parameters are
drawn on the host (tests/models/random_params.py) and the errors are raised
while tracing.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pk
from probjax_hk import attention
from tests.models.random_params import random_params

B, T, P, D_IN, D, N, L = 2, 7, 4, 5, 16, 4, 2
_F32_TOL = dict(atol=1e-5, rtol=1e-5)


def _x(dtype=np.float32, seed=0, shape=(B, T, D_IN)):
  return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def _decode_paths(model, x, max_length):
  """Two [B, T, D] decodings of x: prefill of x[:, :P] then steps, and
  prefill of x[:, :3] then of the rest (with a state: the Transformer's
  cached attention over several new tokens)."""
  y_prompt, state = model.prefill(x[:, :P], max_length=max_length)

  def one_step(state, x_t):
    y_t, state = model.step(x_t, state)
    return state, y_t
  _, y_steps = hk.scan(one_step, state, jnp.swapaxes(x[:, P:], 0, 1))
  stepped = jnp.concatenate([y_prompt, jnp.swapaxes(y_steps, 0, 1)], axis=1)
  y_first, state = model.prefill(x[:, :3], max_length=max_length)
  y_rest, _ = model.prefill(x[:, 3:], state)
  return stepped, jnp.concatenate([y_first, y_rest], axis=1)


def _check_decoding(make_model, x, tol, max_length=T + 2):
  """Every decoding path of `make_model()` equals its sequence path on x."""
  sequence = hk.without_apply_rng(hk.transform(lambda x: make_model()(x)))
  def decode(x):
    model = make_model()
    return model(x), *_decode_paths(model, x, max_length)
  decode = hk.without_apply_rng(hk.transform(decode))
  params = random_params(sequence, x.astype(np.float32))
  y, *decoded = jax.jit(decode.apply)(params, x)
  assert y.dtype == x.dtype and y.shape[:2] == (B, T)
  for path, y_path in zip(("prefill + steps", "two prefills"), decoded):
    assert y_path.dtype == x.dtype, path
    np.testing.assert_allclose(np.asarray(y_path, np.float32), np.asarray(y, np.float32),
                               err_msg=path, **tol)


def _transformer(**kwargs):
  return lambda: pk.Transformer(D, N, L, is_causal=True, use_rope=True, **kwargs)


@pytest.mark.parametrize("kwargs", [
    {},
    {"num_kv_heads": 2, "local_window_size": 2},
    {"num_kv_heads": 1, "local_window_size": (3, 1), "scan_layers": True,
     "remat_policy": "full", "mlp_activation": "swiglu"},
], ids=["mha", "gqa-window", "mqa-window-scan-remat"])
def test_transformer_decoding_matches_sequence(kwargs):
  _check_decoding(_transformer(**kwargs), _x(), _F32_TOL)


def test_transformer_window_changes_the_output():
  """The window the decoding tests respect is applied: the output differs."""
  outputs = []
  for window in (None, 2):
    f = hk.without_apply_rng(hk.transform(
        lambda x, window=window: pk.Transformer(D, N, 1, is_causal=True,
                                                local_window_size=window)(x)))
    params = random_params(f, _x()) if window is None else params
    outputs.append(jax.jit(f.apply)(params, _x()))
  np.testing.assert_allclose(outputs[1][:, :3], outputs[0][:, :3], **_F32_TOL)
  assert (np.abs(outputs[1][:, 3:] - outputs[0][:, 3:]).max(axis=(0, 2)) > 1e-3).all()


def test_transformer_decoding_bf16():
  x = _x(jnp.bfloat16)
  _check_decoding(_transformer(num_kv_heads=2, local_window_size=3), x,
                  dict(atol=5e-2, rtol=5e-2))
  state = hk.transform(lambda: _transformer(num_kv_heads=2)().initial_state(
      B, 9, dtype=jnp.bfloat16)).apply({}, None)
  assert {a.dtype for c in state.caches for a in c} == {jnp.dtype(jnp.bfloat16)}


def test_transformer_state_layout():
  """A cache per layer with K heads (stacked on a leading layer axis when
  scanned), and the lengths of the sequences."""
  for scan_layers, lead in ((False, ()), (True, (L,))):
    def f(x, scan_layers=scan_layers):
      return _transformer(num_kv_heads=2, scan_layers=scan_layers)().prefill(x, max_length=9)
    f = hk.without_apply_rng(hk.transform(f))
    x = _x()
    _, state = jax.eval_shape(f.apply, jax.eval_shape(f.init, jax.random.key(0), x), x)
    caches = [state.caches] if scan_layers else state.caches
    assert len(caches) == (1 if scan_layers else L)
    assert {a.shape for c in caches for a in c} == {(*lead, B, 9, 2, D // N)}
    assert state.lengths.shape == (B,) and state.lengths.dtype == jnp.int32


def test_transformer_steps_continue_at_each_sequences_length():
  """Sequences of different lengths in one state: each step writes and
  attends at its own sequence's position."""
  make_model = _transformer(num_kv_heads=2)

  def f(x):
    model = make_model()
    y = model(x)
    _, state = model.prefill(x[:, :P], max_length=T)
    # Sequence 0 holds one token fewer: its next token is x[0, P - 1] again.
    state = state._replace(lengths=state.lengths.at[0].add(-1))
    y_0, _ = model.step(jnp.stack([x[0, P - 1], x[1, P]]), state)
    return y, y_0
  f = hk.without_apply_rng(hk.transform(f))
  x = _x()
  y, y_0 = jax.jit(f.apply)(random_params(f, x), x)
  np.testing.assert_allclose(y_0, jnp.stack([y[0, P - 1], y[1, P]]), **_F32_TOL)


_CELLS = {
    "lru": (pk.LRUCell, {"state_dim": 6}),
    "mamba": (pk.MambaCell, {"state_dim": 4, "conv_width": 3}),
    "ssd": (pk.SSDCell, {"num_heads": 2, "state_dim": 4}),
    "mamba2": (pk.Mamba2Cell, {"head_dim": 4, "state_dim": 4, "conv_width": 3}),
    "gated_delta_net": (pk.GatedDeltaNetCell, {"num_heads": 2, "conv_width": 3}),
}


@pytest.mark.parametrize("cell,scan_layers", [
    ("lru", False), ("mamba", True), ("ssd", False), ("mamba2", True),
    ("gated_delta_net", False)])
def test_ssm_decoding_matches_sequence(cell, scan_layers):
  cls, cell_kwargs = _CELLS[cell]
  # One layer of the gated delta rule: its chunked XLA form is slow to compile.
  num_layers = 1 if cell == "gated_delta_net" else L
  _check_decoding(lambda: pk.SSMModel(D_IN, 8, 3, num_layers, cell=cls,
                                      cell_kwargs=cell_kwargs, scan_layers=scan_layers),
                  _x(), _F32_TOL)


def test_ssm_cell_prefill_state_is_the_stepped_state():
  """A cell's prefill returns the state its steps reach, conv state included."""
  cls, cell_kwargs = _CELLS["mamba2"]

  def f(x):
    cell = cls(**cell_kwargs, model_dim=x.shape[-1])
    _, prefilled = cell.prefill(x)
    state = cell.initial_state(B)
    for t in range(x.shape[1]):
      _, state = cell.step(x[:, t], state)
    return prefilled, state
  f = hk.transform(f)
  x = _x(shape=(B, 4, 8))
  prefilled, stepped = jax.jit(f.apply)(random_params(f, x), None, x)
  conv_state = prefilled[0]
  assert conv_state.shape == (B, 2, conv_state.shape[-1])
  for a, b in zip(jax.tree.leaves(prefilled), jax.tree.leaves(stepped)):
    np.testing.assert_allclose(a, b, **_F32_TOL)


def test_cached_attention_matches_causal_attention():
  """The last T_q rows of causal attention over S tokens, whatever the cache
  holds past each sequence's length, with GQA and a window."""
  s, t_q, heads, kv_heads, h = 9, 3, 4, 2, 8
  q = _x(shape=(2, s, heads, h))
  k, v = _x(seed=1, shape=(2, s, kv_heads, h)), _x(seed=2, shape=(2, s, kv_heads, h))
  lengths = (6, 9)

  @jax.jit
  def cached_and_full(q, k, v):
    valid = (jnp.arange(s) < jnp.array(lengths)[:, None])[:, :, None, None]
    garbage = lambda a: jnp.where(valid, a, 1e4)  # Past the lengths: never attended to.
    out = {}
    for window in (None, 2, (1, 5)):
      cached = attention.cached_attention(
          jnp.stack([q[b, n - t_q:n] for b, n in enumerate(lengths)]), garbage(k),
          garbage(v), jnp.array(lengths), local_window_size=window)
      full = [attention.dot_product_attention(
          q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], is_causal=True,
          local_window_size=window, implementation="xla")[0, -t_q:]
              for b, n in enumerate(lengths)]
      out[str(window)] = cached, jnp.stack(full)
    return out

  for window, (cached, full) in cached_and_full(q, k, v).items():
    np.testing.assert_allclose(cached, full, atol=1e-6, rtol=1e-6, err_msg=window)


def _raises(fn, match, *args):
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(hk.transform(fn).init, jax.random.key(0), *args)


def test_bad_decoding_arguments_raise():
  x = _x()
  causal = _transformer(num_kv_heads=2)
  _raises(lambda: pk.Transformer(D, N, L).initial_state(B, T), "is_causal")
  _raises(lambda x: pk.Transformer(D, N, L).prefill(x, max_length=T), "is_causal", x)
  _raises(lambda x: causal().prefill(x), "max_length", x)
  _raises(lambda x: causal().prefill(x, max_length=T - 1), "max_length", x)
  _raises(lambda: causal().initial_state(B, 0), "max_length")
  _raises(lambda x: causal().step(x, causal().initial_state(B, T)), "x_t", x)
  _raises(lambda x: causal().step(x[:, 0], causal().initial_state(B, T, dtype=jnp.bfloat16)),
          "initial_state", x)
  _raises(lambda x: causal().step(x[:1, 0], causal().initial_state(B, T)), "lengths", x)
  _raises(lambda x: causal().prefill(x, causal().initial_state(B, T + 1), max_length=T),
          "max_length", x)
  scanned = _transformer(num_kv_heads=2, scan_layers=True)
  _raises(lambda x: scanned().step(x[:, 0], causal().initial_state(B, T)), "scan_layers", x)
  _raises(lambda x: causal().step(x[:, 0], (None, None)), "TransformerState", x)
  _raises(lambda: pk.Transformer(D, N, L, is_causal=True, local_window_size=-1),
          "local_window_size")
  _raises(lambda: pk.Transformer(D, N, L, is_causal=True, local_window_size=(2, "1")),
          "local_window_size")
  ssm = lambda **kw: pk.SSMModel(D_IN, 8, 3, L, cell=pk.Mamba2Cell,
                                 cell_kwargs={"head_dim": 4, "state_dim": 4}, **kw)
  _raises(lambda x: ssm(bidirectional=True).prefill(x), "bidirectional", x)
  _raises(lambda x: ssm().prefill(x[..., :2]), "input_dim", x)
  _raises(lambda x: ssm().prefill(x, [None] * (L + 1)), "num_layers", x)
  _raises(lambda x: ssm().prefill(x, ssm().initial_state(B + 1)), "initial_state", x)
  _raises(lambda x: pk.LRUCell(model_dim=D_IN).prefill(x[:, 0]), "`x`", x)


def test_bad_cache_arguments_raise():
  q = jnp.zeros((B, 3, 4, 8))
  cache = jnp.zeros((B, 2, 2, 8))
  with pytest.raises(ValueError, match="T=3"):
    attention.cached_attention(q, cache, cache, jnp.array([2, 2]))
  with pytest.raises(ValueError, match="lengths"):
    attention.cached_attention(q[:, :1], cache, cache, jnp.array([1.0, 2.0]))
  with pytest.raises(ValueError, match="lengths"):
    attention.cached_attention(q[:, :1], cache, cache, jnp.array([1]))
  mha = lambda: pk.MultiHeadAttention(4, num_kv_heads=2)
  x = jnp.zeros((B, 1, 32))
  four_heads = jnp.zeros((B, 2, 4, 8))
  _raises(lambda x: mha().decode(x, attention.KVCache(four_heads, four_heads),
                                 jnp.zeros(B, jnp.int32)), "cache.key", x)
  _raises(lambda x: mha().decode(x, attention.KVCache(cache, cache), jnp.zeros(B)),
          "lengths", x)
  _raises(lambda x: mha().decode(x, mha().initial_cache(B, 4, 32, jnp.bfloat16),
                                 jnp.zeros(B, jnp.int32)), "dtype", x)
  _raises(lambda x: mha().prefill(x, 0), "max_length", x)
