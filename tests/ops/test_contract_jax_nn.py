"""`probjax_hk.dot_product_attention` against `jax.nn.dot_product_attention`.

One table of calls that jax.nn takes, written from its documented arguments
and the grid its own attention tests use: float32, bfloat16 and float16; one,
two and four query heads per key/value head; rank-3 inputs and `jax.vmap`
over the batch; bias, causal, padding and custom masks and their
combinations; windows; bias and mask broadcasting; scale; `return_residual`.
Each row runs on every implementation the function has on a CPU: the default
(XLA) and 'flex' (the Pallas kernel in interpret mode). An implementation
either matches jax.nn (outputs, and gradients where the row asks, within the
tolerances of JAX's tests) or, for an argument it cannot take, raises a
ValueError naming it.
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pk
from ops import _backend
from ops import _measured
from ops import flex_attention_reference

B, T, S, N, H = 2, 16, 16, 4, 16
# JAX's attention tests hold 16-bit outputs to 0.01 and gradients to 0.02.
_TOL = {jnp.float32: (2e-5, 1e-4), jnp.bfloat16: (1e-2, 2e-2), jnp.float16: (1e-2, 2e-2)}


def _normal(i, shape, dtype=jnp.float32):
  """Standard normal draws of seed `i` (NumPy's: an eager jax.random call
  compiles a program for each new shape)."""
  return jnp.asarray(np.random.default_rng(i).standard_normal(shape, np.float32).astype(dtype))


def _lengths(*values):
  return jnp.array(values, jnp.int32)


def _tril(t=T, s=S):
  return jnp.tril(jnp.ones((t, s), bool))


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  options: Callable[[], dict] = dict  # built at test time: no arrays at import
  dtype: type = jnp.float32
  kv_heads: int = N
  seq: tuple[int, int] = (T, S)
  batch: int = B
  form: str = "rank4"  # 'rank3': [T, N, H] inputs (batch 1); 'vmap': jax.vmap over B
  mapped: tuple[str, ...] = ()  # options `jax.vmap` maps over their axis 0
  flex_refuses: str | None = None  # the argument 'flex' cannot take
  # Also compare d(query, key, value[, bias]); the kernel's own gradients are
  # tests/ops/test_flex_attention.py's, so rows ask where the call path is new.
  grad: bool = False


CASES = [
    # JAX's grid, dtype x query heads per key/value head x vmap, thinned out so
    # that each value of each axis appears (float16 runs the XLA path in float32).
    *(Case(f"{jnp.dtype(d).name} groups={g}", dtype=d, kv_heads=N // g, grad=d == jnp.float16)
      for d, g in ((jnp.float32, 2), (jnp.bfloat16, 4), (jnp.float16, 1))),
    *(Case(f"vmap {jnp.dtype(d).name} groups={g}", dtype=d, kv_heads=N // g, form="vmap",
           grad=d == jnp.float32)
      for d, g in ((jnp.float32, 1), (jnp.bfloat16, 2))),
    # JAX's mask modes: causal alone, the others in its combinations.
    Case("causal", lambda: dict(is_causal=True)),
    Case("causal, padding", lambda: dict(is_causal=True, query_seq_lengths=_lengths(T // 2, T),
                                         key_value_seq_lengths=_lengths(S // 4, S // 2)),
         flex_refuses="query_seq_lengths"),
    Case("custom mask, padding", lambda: dict(mask=_tril()[None, None],
                                              query_seq_lengths=_lengths(T // 2, T // 4),
                                              key_value_seq_lengths=_lengths(S // 4, S // 2)),
         flex_refuses="mask"),
    Case("bias, causal", lambda: dict(bias=_normal(4, (1, N, T, S)), is_causal=True),
         flex_refuses="bias", grad=True),
    Case("causal, window (3, 2)", lambda: dict(is_causal=True, local_window_size=(3, 2))),
    Case("window (3, 0)", lambda: dict(local_window_size=(3, 0))),
    # The rest of the documented arguments.
    Case("key padding", lambda: dict(key_value_seq_lengths=_lengths(5, S))),
    Case("window 3 (an int), key padding", lambda: dict(
        local_window_size=3, key_value_seq_lengths=_lengths(13, S))),
    Case("scale, cross, causal", lambda: dict(scale=0.3, is_causal=True), seq=(8, S),
         kv_heads=2),
    # Bias and mask broadcasting, from rank 2 up.
    Case("bias [T, S], mask [1, 1, S]", lambda: dict(
        bias=_normal(4, (T, S)), mask=jnp.arange(S)[None, None] % 3 > 0), flex_refuses="bias"),
    Case("bias [B, N, 1, S], mask [B, 1, T, S], causal", lambda: dict(
        bias=_normal(4, (B, N, 1, S)), mask=_normal(5, (B, 1, T, S)) > -1, is_causal=True),
         flex_refuses="bias"),
    Case("return_residual", lambda: dict(return_residual=True),
         flex_refuses="return_residual"),
    Case("return_residual bf16, causal, padding", lambda: dict(
        return_residual=True, is_causal=True, query_seq_lengths=_lengths(T // 2, T),
        key_value_seq_lengths=_lengths(S // 4, S)), dtype=jnp.bfloat16, kv_heads=1,
         flex_refuses="return_residual"),
    Case("return_residual f16", lambda: dict(return_residual=True), dtype=jnp.float16,
         flex_refuses="return_residual"),
    # Rank-3 inputs: one sequence [T, N, H].
    Case("rank 3 bf16, GQA, window, key padding", lambda: dict(
        local_window_size=(4, 1), key_value_seq_lengths=_lengths(13)),
         form="rank3", batch=1, dtype=jnp.bfloat16, kv_heads=2),
    Case("rank 3, bias [N, T, S], return_residual", lambda: dict(
        bias=_normal(4, (N, T, S)), return_residual=True), form="rank3", batch=1,
         flex_refuses="return_residual"),
    # jax.vmap over the batch with a per-example bias and a shared mask.
    Case("vmap, bias [N, T, S] per example, shared mask [1, 1, S]", lambda: dict(
        bias=_normal(4, (B, N, T, S)), mask=jnp.arange(S)[None, None] < S - 3),
         form="vmap", mapped=("bias",), flex_refuses="bias"),
    Case("vmap, causal, window", lambda: dict(is_causal=True, local_window_size=(5, 0)),
         form="vmap", dtype=jnp.bfloat16),
]


def _inputs(case):
  t, s = case.seq
  return (_normal(1, (case.batch, t, N, H), case.dtype),
          _normal(2, (case.batch, s, case.kv_heads, H), case.dtype),
          _normal(3, (case.batch, s, case.kv_heads, H), case.dtype))


def _called(fn, case, options):
  """fn(query, key, value, bias) -> output: jax.nn's call, or the case's form
  of it (rank-3 arrays, or jax.vmap over the batch) when `fn` is ours."""
  bias = options.pop("bias", None)
  if fn is jax.nn.dot_product_attention or case.form == "rank4":
    return lambda q, k, v, bias: fn(q, k, v, bias, **options)
  if case.form == "rank3":
    return lambda q, k, v, bias: jax.tree.map(lambda x: x[None], fn(q[0], k[0], v[0], bias,
                                                                   **options))
  mapped = {n: options.pop(n) for n in case.mapped if n != "bias"}
  in_bias = 0 if "bias" in case.mapped else None
  per_example = lambda q, k, v, bias, mapped: fn(q, k, v, bias, **mapped, **options)
  return lambda q, k, v, bias: jax.vmap(per_example, in_axes=(0, 0, 0, in_bias, 0))(
      q, k, v, bias, mapped)


def _run(fn, case, *, compiled=True):
  """(outputs, gradients or None) of `fn` on the case's inputs; `compiled`:
  as one jitted program (one compile), else op by op (each op compiles at
  each new shape)."""
  options = case.options()
  bias = options.get("bias")
  call = _called(fn, case, dict(options))

  def run(q, k, v, bias):
    if not case.grad:
      return call(q, k, v, bias), None
    wrt = (q, k, v) + ((bias,) if bias is not None else ())
    out, vjp = jax.vjp(lambda *a: call(*a[:3], a[3] if len(a) > 3 else bias), *wrt)
    primal = out[0] if isinstance(out, tuple) else out
    cotangent = _normal(6, primal.shape, primal.dtype)
    cotangents = (cotangent, jnp.zeros_like(out[1])) if isinstance(out, tuple) else cotangent
    return out, vjp(cotangents)
  return (jax.jit(run) if compiled else run)(*_inputs(case), bias)


def _assert_close(ours, want, tol):
  assert jax.tree.structure(ours) == jax.tree.structure(want)
  for o, w in zip(jax.tree.leaves(ours), jax.tree.leaves(want)):
    assert o.shape == w.shape and o.dtype == w.dtype, (o.shape, o.dtype, w.shape, w.dtype)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(w, np.float32),
                               atol=tol, rtol=tol)


_REFERENCE = {}  # case name -> jax.nn's (outputs, gradients), shared by the implementations


@pytest.mark.parametrize("implementation", [None, "flex"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_jax_nn(case, implementation):
  ours = lambda *a, **kw: pk.dot_product_attention(*a, **kw, implementation=implementation)
  if implementation == "flex" and case.flex_refuses:
    with pytest.raises(ValueError, match=case.flex_refuses):
      _run(ours, case)
    return
  if implementation is None:
    q, k, v = _inputs(case)
    options = case.options()
    assert pk.choose_attention_implementation(
        q, k, v, options.pop("bias", None), options.pop("mask", None), **options) == "xla"
  out, grads = _run(ours, case)
  if case.name not in _REFERENCE:
    # jax.nn's float16 dot does not compile on a CPU (test_jit_16_bit).
    _REFERENCE[case.name] = _run(jax.nn.dot_product_attention, case,
                                 compiled=case.dtype != jnp.float16)
  want, want_grads = _REFERENCE[case.name]
  out_tol, grad_tol = _TOL[case.dtype]
  _assert_close(out, want, out_tol)
  if case.grad:
    _assert_close(grads, want_grads, grad_tol)


@pytest.mark.parametrize("implementation", [None, "flex"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_jit_16_bit(dtype, implementation):
  """Compiled 16-bit calls run on a CPU (jax.nn's XLA path asks for a float16
  dot algorithm XLA:CPU does not compile) and keep the dtype."""
  q, k, v = _inputs(Case("", dtype=dtype))
  options = dict(is_causal=True, return_residual=implementation is None)
  ours = jax.jit(lambda q, k, v: pk.dot_product_attention(
      q, k, v, **options, implementation=implementation))(q, k, v)
  want = jax.nn.dot_product_attention(q, k, v, **options)  # eager: its dot falls back
  _assert_close(ours, want, _TOL[dtype][0])


def test_rows_that_see_no_key():
  """The documented difference: where a query sees no key, jax.nn (and the
  default path) return the mean of the values, 'flex' returns zeros."""
  q, k, v = _inputs(Case(""))
  options = dict(key_value_seq_lengths=_lengths(0, S), is_causal=True)
  want, ours, flex = jax.jit(lambda q, k, v: (  # one program
      jax.nn.dot_product_attention(q, k, v, **options),
      pk.dot_product_attention(q, k, v, **options),
      pk.dot_product_attention(q, k, v, **options, implementation="flex")))(q, k, v)
  _assert_close(ours, want, 0.0)
  _assert_close(flex[1], want[1], _TOL[jnp.float32][0])
  np.testing.assert_array_equal(flex[0], 0.0)
  np.testing.assert_allclose(want[0], np.broadcast_to(np.asarray(v[0]).mean(0), (T, N, H)),
                             atol=1e-6)


def test_float64_takes_the_xla_path():
  with jax.enable_x64(True):
    q, k, v = (x.astype(jnp.float64) for x in _inputs(Case("")))
    both = jax.jit(lambda q, k, v: (jax.nn.dot_product_attention(q, k, v, is_causal=True),
                                    pk.dot_product_attention(q, k, v, is_causal=True)))
    want, out = both(q, k, v)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="flex.*query.dtype=float64"):
      pk.dot_product_attention(q, k, v, implementation="flex")


def test_float64_default_on_nvidia_gpu_is_xla(monkeypatch):
  """Where flex and cuDNN are candidates, float64 falls back to XLA."""
  monkeypatch.setattr(_backend, "on_nvidia_gpu", lambda: True)
  monkeypatch.setattr(_measured, "load", lambda table: None)
  q = jax.ShapeDtypeStruct((B, T, N, H), np.float64)
  assert pk.choose_attention_implementation(q, q, q) == "xla"
  assert pk.choose_attention_implementation(q, q, q, return_residual=True) == "xla"


@pytest.mark.parametrize("options, argument", [
    (dict(bias=jnp.zeros((B, N, T, S + 1))), "bias"),
    (dict(bias=jnp.zeros((3, N, T, S))), "bias"),
    (dict(bias=jnp.zeros((1, 1, B, N, T, S))), "bias"),
    (dict(mask=jnp.ones((N, T, 2), bool)), "mask"),
    (dict(mask=jnp.ones((T, S))), "mask"),
    (dict(key_value_seq_lengths=jnp.array([3.0, 4.0])), "key_value_seq_lengths"),
    (dict(query_seq_lengths=jnp.array([3.5, 4.0])), "query_seq_lengths"),
    (dict(key_value_seq_lengths=jnp.array([3, 4, 5])), "key_value_seq_lengths"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_bias_mask_and_lengths_raise_naming_the_argument(options, argument):
  """Calls jax.nn refuses too (some with a TypeError from the broadcast)."""
  q, k, v = _inputs(Case(""))
  with pytest.raises(ValueError, match=argument):
    pk.dot_product_attention(q, k, v, **options)


def test_flex_reference_log_sum_exp_is_jax_nn_residual():
  """`ops.flex_attention_reference(return_lse=True)`: the natural log-sum-exp
  [B, N, T] that jax.nn returns as [B, T, N] (-inf for a row with no key)."""
  q, k, v = _inputs(Case(""))
  lengths = _lengths(0, 11)
  options = dict(is_causal=True, key_value_seq_lengths=lengths)
  (out, lse), (want, residual) = jax.jit(lambda q, k, v: (  # one program
      flex_attention_reference(q, k, v, **options, return_lse=True),
      jax.nn.dot_product_attention(q, k, v, **options, return_residual=True)))(q, k, v)
  np.testing.assert_allclose(lse[1].transpose(1, 0), residual[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[1], want[1], rtol=1e-5, atol=1e-5)
  assert np.all(np.isneginf(lse[0]))
