"""ops.flex_attention: the Pallas kernel (interpret mode on CPU) vs reference.py
(its dense XLA path).

Each case runs forward and backward in one jitted `jax.vjp`, so one compile
checks the three kernels (forward, dK/dV, dQ) against the f32 reference.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import tolerances
from ops import _backend
from ops import _mosaic_gpu
from ops import flex_attention, flex_attention_reference
from ops.flex_attention import api

# Relative L2 error bounds, by input dtype.
_TOL = tolerances.FLEX_ATTENTION


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(shape_q, shape_kv, dtype, seed=0):
  """q [shape_q], k, v [shape_kv] in `dtype` and the output cotangent w
  [shape_q] in f32, standard normal. NumPy draws them: an eager jax.random
  call compiles a program for each new shape."""
  rng = np.random.default_rng(seed)
  normal = lambda shape, dtype: jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))
  return (normal(shape_q, dtype), normal(shape_kv, dtype), normal(shape_kv, dtype),
          normal(shape_q, np.float32))


def _vjp(fn, q, k, v, w):
  out, pullback = jax.vjp(fn, q, k, v)
  return out, pullback(w.astype(out.dtype))


def _check(b, t, s, n, kh, h, dtype, **options):
  q, k, v, w = _inputs((b, t, n, h), (b, s, kh, h), dtype)
  kernel = lambda q, k, v: flex_attention(q, k, v, implementation="pallas", **options)
  ref = lambda q, k, v: flex_attention(
      q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
      implementation="xla", **options)
  out, grads = jax.jit(lambda *a: _vjp(kernel, *a))(q, k, v, w)
  out_r, grads_r = jax.jit(lambda *a: _vjp(ref, *a))(q, k, v, w)
  assert out.dtype == dtype and out.shape == (b, t, n, h)
  assert all(g.dtype == dtype for g in grads)
  for name, x in [("out", out), *zip(("dq", "dk", "dv"), grads)]:
    assert not np.isnan(np.asarray(x, np.float32)).any(), name
  tol = _TOL[dtype]
  assert _rel(out, out_r) < tol, ("out", _rel(out, out_r))
  for name, g, g_r in zip(("dq", "dk", "dv"), grads, grads_r):
    assert _rel(g, g_r) < tol, (name, _rel(g, g_r))
  return out, grads


# b, t, s, n, kh, h, dtype, options: together they cover causal and not,
# windows, segments, key lengths, GQA 8:2, 4:2 and MQA 4:1 / 8:1, cross
# attention, T in {1, 17, 128, 300}, H in {32, 64, 80, 128}, f32 and bf16.
_CASES = {
    "causal_t17_h32_f32": (1, 17, 17, 2, 2, 32, jnp.float32, dict(is_causal=True)),
    "gqa8to2_cross_h64_bf16": (1, 40, 72, 8, 2, 64, jnp.bfloat16, {}),
    "mqa4to1_t1_h80_lengths_f32": (2, 1, 50, 4, 1, 80, jnp.float32,
                                   dict(key_value_seq_lengths=np.array([50, 9]))),
    "window_causal_t128_h128_bf16": (1, 128, 128, 2, 1, 128, jnp.bfloat16,
                                     dict(is_causal=True, local_window_size=(40, 0))),
    "window_both_sides_lengths_f32": (2, 64, 64, 4, 2, 32, jnp.float32,
                                      dict(local_window_size=(9, 5),
                                           key_value_seq_lengths=np.array([64, 23]))),
    "segments_causal_t300_f32": (1, 300, 300, 1, 1, 32, jnp.float32,
                                 dict(is_causal=True, segment_ids=np.repeat(
                                     np.arange(3), [120, 101, 79])[None])),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_kernel_matches_reference(name):
  b, t, s, n, kh, h, dtype, options = _CASES[name]
  options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
             for k, v in options.items()}
  _check(b, t, s, n, kh, h, dtype, **options)


def test_gqa_8_to_1_matches_repeated_heads():
  """MQA 8:1 equals ordinary attention with K/V repeated over the 8 heads."""
  q, k, v, _ = _inputs((1, 32, 8, 32), (1, 32, 1, 32), jnp.float32, seed=3)
  rep = lambda x: jnp.repeat(x, 8, axis=2)
  out, expected = jax.jit(lambda q, k, v: (
      flex_attention(q, k, v, is_causal=True, implementation="pallas"),
      flex_attention_reference(q, rep(k), rep(v), is_causal=True)))(q, k, v)
  assert _rel(out, expected) < _TOL[jnp.float32]


def test_empty_rows_give_zeros_and_finite_gradients():
  """Zero key length, and a query segment no key shares: zeros, no NaN."""
  b, t, h = 2, 32, 16
  q, k, v, w = _inputs((b, t, 2, h), (b, t, 2, h), jnp.float32, seed=5)
  q_ids = np.zeros((b, t), np.int32)
  q_ids[:, 20:] = 7  # segment 7: no keys
  q_ids, kv_ids = jnp.asarray(q_ids), jnp.asarray(np.zeros_like(q_ids))
  lengths = jnp.array([0, 32])
  out, grads = _check(b, t, t, 2, 2, h, jnp.float32, segment_ids=(q_ids, kv_ids),
                      key_value_seq_lengths=lengths)
  out = np.asarray(out)
  assert (out[0] == 0).all() and (out[1, 20:] == 0).all()
  assert np.abs(out[1, :20]).sum() > 0
  assert (np.asarray(grads[0])[0] == 0).all()


def test_head_size_256_forward():
  """The largest head size (H = 16, the smallest, is in the mod cases)."""
  q, k, v, _ = _inputs((1, 16, 1, 256), (1, 20, 1, 256), jnp.bfloat16, seed=2)
  f32 = lambda x: x.astype(jnp.float32)
  out, ref = jax.jit(lambda q, k, v: (flex_attention(q, k, v, implementation="pallas"),
                                      flex_attention_reference(f32(q), f32(k), f32(v))))(q, k, v)
  assert _rel(out, ref) < _TOL[jnp.bfloat16]


def test_default_implementation_on_cpu_is_xla_and_matches_reference():
  q, k, v, _ = _inputs((1, 16, 2, 32), (1, 16, 2, 32), jnp.float32)
  call = dict(q=q, k=k, q_ids=None, mask_mod=None, score_mod=None)
  assert api.IMPLEMENTATIONS.choose(None, call).name == "xla"  # no dispatch table
  out, ref = jax.jit(lambda q, k, v: (flex_attention(q, k, v, is_causal=True),
                                      flex_attention_reference(q, k, v, is_causal=True)))(q, k, v)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(q=(2, 8, 4, 32, 1)), "`q` must have rank 4"),
    (dict(k=(2, 8, 3, 32), v=(2, 8, 3, 32)), "multiple of `k` heads"),
    (dict(k=(2, 8, 2, 16), v=(2, 8, 2, 16)), "`k` head size"),
    (dict(v=(2, 9, 2, 32)), "`k` and `v` must have the same shape"),
    (dict(key_value_seq_lengths=np.array([3, 9])), "`key_value_seq_lengths` must lie in"),
    (dict(key_value_seq_lengths=np.array([3])), "`key_value_seq_lengths` must have shape"),
    (dict(local_window_size=(-1, 2)), "`local_window_size`"),
    (dict(segment_ids=np.zeros((2, 7), np.int32)), "`segment_ids`"),
    (dict(is_causal=1), "`is_causal`"),
    (dict(implementation="cuda"), "`implementation`"),
    (dict(q=(2, 8, 4, 512), k=(2, 8, 2, 512), v=(2, 8, 2, 512),
          implementation="pallas"), "head size must be <= 256"),
])
def test_bad_inputs_raise(kwargs, match):
  shapes = dict(q=(2, 8, 4, 32), k=(2, 8, 2, 32), v=(2, 8, 2, 32))
  args = {name: jnp.asarray(np.zeros(kwargs.pop(name, shape), np.float32))
          for name, shape in shapes.items()}
  kwargs = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
  with pytest.raises(ValueError, match=match):
    flex_attention(args["q"], args["k"], args["v"], **kwargs)


def test_mixed_dtypes_raise():
  q = jnp.zeros((1, 4, 1, 16), jnp.float32)
  with pytest.raises(ValueError, match="share a dtype"):
    flex_attention(q, q.astype(jnp.bfloat16), q.astype(jnp.bfloat16))


# mask_mod / score_mod: index arithmetic only (kernels cannot close over arrays).
_HEADS = 4


def _alibi(score, b, n, t, s):
  slope = jnp.exp2(-8.0 * (n + 1).astype(jnp.float32) / _HEADS)
  return score + slope * (s - t).astype(jnp.float32)


def _softcap(score, b, n, t, s):
  return 5.0 * jnp.tanh(score / 5.0)


def _prefix_lm(b, n, t, s):  # The first 10 tokens are a bidirectional prefix.
  return (s < 10) | (s <= t)


def _documents(b, n, t, s):  # Fixed 24-token documents.
  return (t // 24) == (s // 24)


_MOD_CASES = {
    "alibi_causal_gqa": (2, 48, 48, _HEADS, 2, 32, jnp.float32,
                         dict(score_mod=_alibi, is_causal=True)),
    "prefix_lm_bf16": (1, 40, 40, _HEADS, 1, 32, jnp.bfloat16, dict(mask_mod=_prefix_lm)),
    "documents_softcap_lengths": (1, 70, 70, _HEADS, 2, 16, jnp.float32,
                                  dict(mask_mod=_documents, score_mod=_softcap,
                                       key_value_seq_lengths=np.array([60]))),
}


@pytest.mark.parametrize("name", list(_MOD_CASES))
def test_mods_match_reference(name):
  b, t, s, n, kh, h, dtype, options = _MOD_CASES[name]
  options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
             for k, v in options.items()}
  _check(b, t, s, n, kh, h, dtype, **options)


def test_mask_mod_tile_lists_skip_empty_tiles():
  """A block-diagonal mask_mod: each 16-query tile visits 2 of 8 key tiles."""
  from ops.flex_attention import masks, reference

  @jax.jit  # one program
  def lists():
    dense = reference.allowed_mask(1, 1, 128, 128,
                                   mask_mod=lambda b, n, t, s: (t // 32) == (s // 32))
    # The dK/dV lists' counts: the transpose, grouped by key/value head (G = 3).
    return (masks.tile_lists(dense, 16, 16, 2, 3),
            masks.tile_lists(dense, 16, 16, 2, 3, groups=3)[0])
  (full_count, full_index, part_count, _), counts = lists()
  assert full_count.shape == (2, 3, 8, 1) and (full_count == 2).all()
  assert (part_count == 0).all()
  rows = np.asarray(full_index[0, 0, :, :2])
  np.testing.assert_array_equal(rows, (np.arange(8)[:, None] // 2) * 2 + np.arange(2))
  assert counts.shape == (2, 1, 3, 8, 1) and (counts == 2).all()


def test_score_mod_minus_inf_rows_give_zeros():
  """A score_mod that sends every logit of some rows to -inf: zeros there,
  as the reference gives, never NaN (the rows' running max stays -inf)."""
  q, k, v, w = _inputs((1, 64, 1, 32), (1, 64, 1, 32), jnp.float32, seed=4)
  mod = lambda score, b, n, t, s: jnp.where(t < 8, -jnp.inf, score)
  kernel = lambda q, k, v: flex_attention(q, k, v, score_mod=mod, implementation="pallas")
  # The output and the gradients from one program.
  out, grads = jax.jit(lambda *a: _vjp(kernel, *a))(q, k, v, w)
  expected = jax.jit(lambda q, k, v: flex_attention_reference(q, k, v, score_mod=mod))(q, k, v)
  assert not np.isnan(np.asarray(out)).any()
  assert (np.asarray(out)[0, :8] == 0).all()
  assert _rel(out, expected) < _TOL[jnp.float32]
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def _pallas_int_operands(jaxpr):
  """The shapes of the int32 operands of every pallas_call in `jaxpr` (nested)."""
  shapes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      shapes += [v.aval.shape for v in eqn.invars if v.aval.dtype == jnp.int32]
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      shapes += _pallas_int_operands(sub)
  return shapes


@pytest.mark.parametrize("lengths", [False, True])
def test_key_lengths_are_an_operand_only_when_given(lengths):
  """Without `key_value_seq_lengths` the kernels take the static S: no [B, 1] array
  is built (an XLA broadcast kernel per call on the GPU) or read; with them,
  forward and both gradient kernels read it. (S = 200 pads the keys, so the
  kernels still mask s >= S.) The traced program only: the numerics of both
  forms are test_kernel_matches_reference's (gqa8to2_cross pads the keys
  without lengths, mqa4to1 and window_both_sides pass them)."""
  q = jax.ShapeDtypeStruct((2, 100, 2, 32), jnp.float32)
  k = v = jax.ShapeDtypeStruct((2, 200, 2, 32), jnp.float32)
  kw = dict(key_value_seq_lengths=jnp.array([200, 150])) if lengths else {}
  fn = lambda q, k, v: jnp.sum(flex_attention(q, k, v, implementation="pallas", **kw))
  jaxpr = jax.make_jaxpr(jax.grad(fn, (0, 1, 2)))(q, k, v).jaxpr
  assert _pallas_int_operands(jaxpr) == ([(2, 1)] * 3 if lengths else [])


def test_named_lowerings_triton_and_mosaic():
  q, k, v, _ = _inputs((1, 16, 2, 32), (1, 16, 2, 32), jnp.float32)
  causal = lambda implementation: jax.jit(lambda q, k, v: flex_attention(
      q, k, v, is_causal=True, implementation=implementation))
  ref = jax.jit(lambda q, k, v: flex_attention_reference(q, k, v, is_causal=True))(q, k, v)
  out = causal("triton")(q, k, v)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
  if not _mosaic_gpu.on_hopper():
    with pytest.raises(ValueError, match=r"implementation='mosaic'\): .*Hopper GPU"):
      flex_attention(q, k, v, is_causal=True, implementation="mosaic")
    out = causal(("mosaic", "xla"))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)
