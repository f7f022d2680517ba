"""The Triton forward's bounded softmax (`FlexConfig.fwd_softmax='bound'`).

Interpret mode on CPU, against reference.py: forward and gradients with the
bound in place of the running maximum, the fallback to the online softmax
when a row's logits sit far below their bound, and the calls that keep the
online softmax (float16, score_mod).
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.flex_attention import configs
from ops.flex_attention import pallas
from tests.ops import test_flex_attention as flex_tests


@pytest.fixture
def bounded(monkeypatch):
  """Every call in the test takes the interpret-mode tiles with the bound."""
  config = dataclasses.replace(configs._INTERPRET, fwd_softmax="bound")
  monkeypatch.setattr(configs, "get_config", lambda *a, **kw: config)
  return config


# b, t, s, n, kh, h, dtype, options.
_CASES = {
    # An empty batch row (key length 0), a window on both sides, GQA 4:2.
    "window_lengths_gqa_bf16": (2, 64, 64, 4, 2, 32, jnp.bfloat16,
                                dict(local_window_size=(9, 5),
                                     kv_seq_lengths=np.array([64, 0]))),
    "causal_cross_f32": (1, 40, 72, 2, 1, 64, jnp.float32, dict(is_causal=True)),
    "segments_bf16": (1, 70, 70, 2, 2, 32, jnp.bfloat16, dict(segment_ids=np.repeat(
        np.arange(2), [30, 40])[None])),
    "documents_mask_mod_bf16": (1, 48, 48, 2, 1, 32, jnp.bfloat16,
                                dict(mask_mod=flex_tests._documents)),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_bounded_softmax_matches_reference(name, bounded):
  b, t, s, n, kh, h, dtype, options = _CASES[name]
  options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
             for k, v in options.items()}
  flex_tests._check(b, t, s, n, kh, h, dtype, **options)


def _far_below_the_bound():
  """Large q and k that are nearly orthogonal: Cauchy-Schwarz bounds the
  logits by |q| |k| scale = 300 * 300 / 8 (base e), while they stay near 0,
  so every p = 2^(s c - r) underflows."""
  keys = jax.random.split(jax.random.PRNGKey(7), 3)
  q = jnp.zeros((1, 40, 1, 64)).at[..., 0].set(300.0)
  q = q.at[..., 1].set(jax.random.normal(keys[0], (1, 40, 1)))
  k = jnp.zeros((1, 40, 1, 64)).at[..., 2].set(300.0)
  k = k.at[..., 1].set(jax.random.normal(keys[1], (1, 40, 1)))
  v = jax.random.normal(keys[2], (1, 40, 1, 64))
  return q, k, v


def _forward(q, k, v):
  st, args = pallas.prepare(q, k, v, scale=q.shape[-1] ** -0.5, is_causal=False,
                            window=None, q_segment_ids=None, kv_segment_ids=None,
                            kv_seq_lengths=None, interpret=True)
  return pallas._forward(st, *args)[0][:, :q.shape[1]]


def test_rows_far_below_the_bound_fall_back_to_the_online_softmax(bounded, monkeypatch):
  q, k, v = _far_below_the_bound()
  expected = flex_tests.flex_attention_reference(q, k, v)
  out = _forward(q, k, v)
  assert flex_tests._rel(out, expected) < flex_tests._TOL[jnp.float32]
  # Without the fallback the bounded walk alone loses these rows.
  no_fallback = types.SimpleNamespace(cond=lambda pred, true_fn, false_fn: false_fn())
  monkeypatch.setattr(pallas, "lax", no_fallback)
  assert not flex_tests._rel(_forward(q, k, v), expected) < 0.5


@pytest.mark.parametrize("dtype, score_mod, expected", [
    (jnp.bfloat16, None, "bound"),
    (jnp.float32, None, "bound"),
    (jnp.float16, None, "online"),  # P in float16 cannot hold p up to 2^32
    (jnp.bfloat16, flex_tests._softcap, "online"),  # the bound is on raw logits
])
def test_which_calls_take_the_bound(dtype, score_mod, expected, bounded):
  q = jnp.zeros((1, 32, 2, 32), dtype)
  st, _ = pallas.prepare(q, q, q, scale=0.2, is_causal=False, window=None,
                         q_segment_ids=None, kv_segment_ids=None, kv_seq_lengths=None,
                         interpret=True, score_mod=score_mod)
  assert st.config.fwd_softmax == expected


def test_config_names_the_softmax():
  with pytest.raises(ValueError, match="fwd_softmax"):
    dataclasses.replace(configs._INTERPRET, fwd_softmax="maximum")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_to_triton_for_hopper(dtype, hopper_lowering):
  """The bounded walk, its fallback and the row sums' dot lower for sm90."""
  config = dataclasses.replace(configs._TABLE[(32, "bfloat16", "sm90")],
                               fwd_softmax="bound", mosaic_fwd=None)
  spec = jax.ShapeDtypeStruct((2, 512, 4, 32), dtype)
  fn = lambda q, k, v: pallas.flex_attention_pallas(
      q, k, v, scale=0.17, is_causal=True, window=None, q_segment_ids=None,
      kv_segment_ids=None, kv_seq_lengths=None, interpret=False, config=config)
  text = jax.jit(fn).trace(spec, spec, spec).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
