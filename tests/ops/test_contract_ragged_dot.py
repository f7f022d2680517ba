"""`ops.grouped_matmul` against `jax.lax.ragged_dot`, its peer contract.

One table of calls, each run on every implementation of the op (XLA, the
Triton kernels and, for 16-bit operands, the Mosaic GPU kernels, in interpret
mode here) and on ragged_dot with the same arguments: the result dtype, the
values, and both gradients with their dtypes. The rows come from ragged_dot's
documented semantics and from the argument grids of its tests in JAX
(`tests/lax_test.py`: one and two groups at m = 64, small m with rows after
the last group, every floating dtype) and in tokamax
(`ops/ragged_dot/test_base.py`: equal groups, groups summing to less than m,
empty groups, `preferred_element_type` None / bf16 / f32, the VJP under
`BF16_BF16_F32`, uint32 group sizes), shrunk to a dozen small rows.

Tolerance: two summation orders of the same float32 products differ by a few
float32 roundings of the terms, not of their (possibly cancelling) sum, so a
result is compared to 1e-6 of `|lhs| @ |rhs|` (its gradients to 1e-6 of the
same products of absolute values), plus the rounding of each narrower dtype
on the way.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
from ops import _backend
from ops import _mosaic_gpu
from ops.grouped_matmul import api
from ops.grouped_matmul import mosaic

_PRESET = jax.lax.DotAlgorithmPreset
_F32, _BF16, _F16 = jnp.float32, jnp.bfloat16, jnp.float16


class Case(NamedTuple):
  lhs: type
  rhs: type
  sizes: tuple[int, ...]      # group sizes (their length is G)
  m: int = 40
  k: int = 24
  n: int = 16
  preferred: type | None = None
  precision: object = None
  sizes_dtype: type = jnp.int32


# JAX's grid: one and two groups of m = 64 (here two, with K and N far from
# any tile) in every floating dtype, and a small m with groups of one row.
_JAX = dict(m=64, k=9, n=8)
# tokamax's grid (8 equal groups; m, K and N shrunk from 1024, 128, 256).
_TOKAMAX = dict(m=64, k=32, n=32)
_PADDED = (5, 0, 17, 9, 0, 3, 11, 6)  # sums to 51 < m, two empty groups

CASES = {
    "jax_two_groups_f32": Case(_F32, _F32, (23, 41), **_JAX),
    "jax_two_groups_bf16": Case(_BF16, _BF16, (23, 41), preferred=_F32, **_JAX),
    "jax_small_m_f16": Case(_F16, _F16, (1, 1), m=10, k=9, n=8),
    # f32 at HIGHEST and bf16 into f32, uint32 group sizes
    "tokamax_simple_f32": Case(_F32, _F32, (8,) * 8, preferred=_F32, precision="highest",
                               sizes_dtype=jnp.uint32, **_TOKAMAX),
    "tokamax_simple_bf16": Case(_BF16, _BF16, (8,) * 8, preferred=_F32,
                                sizes_dtype=jnp.uint32, **_TOKAMAX),
    # groups summing to less than m, some empty
    "tokamax_padded": Case(_BF16, _BF16, _PADDED, preferred=_F32, **_TOKAMAX),
    # the VJP under the kernels' own algorithm
    "tokamax_vjp": Case(_BF16, _BF16, _PADDED, preferred=_F32,
                        precision=_PRESET.BF16_BF16_F32, **_TOKAMAX),
    # preferred_element_type: None (the operands' bf16), another 16-bit one
    "preferred_none_bf16": Case(_BF16, _BF16, _PADDED, **_TOKAMAX),
    "preferred_f16_from_bf16": Case(_BF16, _BF16, _PADDED, preferred=_F16, **_TOKAMAX),
    # operands of two dtypes: ragged_dot's result dtype, the wider one (the
    # kernels multiply in float32: into float32, and rounded to bfloat16)
    "mixed_bf16_f32": Case(_BF16, _F32, _PADDED, **_TOKAMAX),
    "mixed_f16_bf16": Case(_F16, _BF16, _PADDED, **_TOKAMAX),
    # F32_F32_F32 on 16-bit operands (more precisions: below)
    "precision_f32_on_bf16": Case(_BF16, _BF16, _PADDED, preferred=_F32,
                                  precision=_PRESET.F32_F32_F32, **_TOKAMAX),
}

# The Mosaic GPU kernels take 16-bit operands. Interpret mode simulates every
# warpgroup, so one row runs there: a float32 result and its gradients
# (test_grouped_matmul_mosaic.py checks the kernels' tiling).
MOSAIC_CASES = ("jax_two_groups_bf16",)


def _mosaic_on_16_bit(dtype):
  """`mosaic.preferred` as on a Hopper GPU (it also picks the Mosaic weight
  gradient)."""
  return jnp.dtype(dtype) in _mosaic_gpu.DTYPES


def _eps(dtype) -> float:
  """The relative rounding of a dtype narrower than float32 (0 otherwise)."""
  dtype = jnp.dtype(dtype)
  return float(jnp.finfo(dtype).eps) if dtype.itemsize < 4 else 0.0


@functools.partial(jax.jit, static_argnums=range(5))
def _draw(m, k, g, n, seed):
  """Float32 lhs, rhs and cotangent, drawn in one program per shape (eager
  `jax.random` calls compile one each)."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(k1, (m, k), jnp.float32),
          jax.random.normal(k2, (g, k, n), jnp.float32),
          jax.random.normal(k3, (m, n), jnp.float32))


def _inputs(case: Case, seed: int = 0):
  lhs, rhs, cotangent = _draw(case.m, case.k, len(case.sizes), case.n, seed)
  # Rounded on the host (round to nearest even, as XLA's convert).
  lhs, rhs = (jnp.asarray(np.asarray(x).astype(dtype))
              for x, dtype in ((lhs, case.lhs), (rhs, case.rhs)))
  return lhs, rhs, jnp.asarray(np.asarray(case.sizes, case.sizes_dtype)), cotangent


def _value_and_grads(fn, lhs, rhs, sizes, cotangent):
  """(out, dlhs, drhs) of `fn(lhs, rhs, sizes)` for a cotangent."""
  out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
  return (out, *vjp(cotangent.astype(out.dtype)))


@functools.cache
def _function(impl: str, name: str):
  case = CASES[name]
  kwargs = dict(precision=case.precision, preferred_element_type=case.preferred)
  if impl == "ragged_dot":
    return functools.partial(jax.lax.ragged_dot, **kwargs)
  # "mosaic": the Pallas path, traced where the Mosaic kernels are preferred.
  implementation = "pallas" if impl == "mosaic" else impl
  return functools.partial(ops.grouped_matmul, implementation=implementation, **kwargs)


def _magnitudes(lhs, rhs, sizes, cotangent):
  """The scales of the roundings in (out, dlhs, drhs): |lhs| @ |rhs| and its
  gradients' products of absolute values, per group (float64)."""
  lhs, rhs, cotangent = (np.abs(np.asarray(x, np.float64)) for x in (lhs, rhs, cotangent))
  out, dlhs, drhs = np.zeros_like(cotangent), np.zeros_like(lhs), np.zeros_like(rhs)
  ends = np.cumsum(np.asarray(sizes, np.int64))
  for g, (start, end) in enumerate(zip(ends - np.asarray(sizes), ends)):
    out[start:end] = lhs[start:end] @ rhs[g]
    dlhs[start:end] = cotangent[start:end] @ rhs[g].T
    drhs[g] = lhs[start:end].T @ cotangent[start:end]
  return out, dlhs, drhs


@functools.cache
def _reference(name: str):
  """ragged_dot's (out, dlhs, drhs) for the case, and `_magnitudes`."""
  args = _inputs(CASES[name])
  theirs = functools.partial(_value_and_grads, _function("ragged_dot", name))
  return jax.jit(theirs)(*args), _magnitudes(*args)


def _assert_matches(case: Case, got, want, scales, sizes) -> None:
  """ours (out, dlhs, drhs) against ragged_dot's: dtypes, values to the
  roundings each side may make, and zero rows after the last group."""
  assert [g.dtype for g in got] == [w.dtype for w in want], [g.dtype for g in got]
  # Each side may round once more per narrower dtype on its way: the result's
  # (both), and for a gradient its own, the result's (ragged_dot's transpose
  # multiplies into `preferred_element_type`) and the operands' (the kernels
  # round the cotangent to their operand dtype).
  out_eps = _eps(got[0].dtype)
  grad_eps = out_eps + _eps(api.operand_dtype(case.lhs, case.rhs))
  for what, g, w, scale in zip(("out", "dlhs", "drhs"), got, want, scales):
    rtol = 1e-6 + 2 * (_eps(g.dtype) + (0.0 if what == "out" else grad_eps))
    err = np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))
    bound = rtol * scale + np.finfo(np.float32).tiny
    assert (err <= bound).all(), (what, float((err / bound).max()))
  out, dlhs, _ = got
  total = int(np.sum(sizes))
  if total < case.m:  # Rows after the last group: zero output, zero gradient.
    assert not np.asarray(out[total:], np.float32).any()
    assert not np.asarray(dlhs[total:], np.float32).any()


def _check(impl: str, name: str):
  case = CASES[name]
  got = jax.jit(functools.partial(_value_and_grads, _function(impl, name)))(*_inputs(case))
  _assert_matches(case, got, *_reference(name), case.sizes)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_matches_ragged_dot(impl, name):
  _check(impl, name)


@pytest.mark.parametrize("name", MOSAIC_CASES)
def test_mosaic_kernels_match_ragged_dot(name, monkeypatch):
  assert api.operand_dtype(CASES[name].lhs, CASES[name].rhs).itemsize == 2
  monkeypatch.setattr(mosaic, "preferred", _mosaic_on_16_bit)
  _check("mosaic", name)



def test_group_sizes_with_empty_groups():
  """tokamax's sweep of zeroed groups (eight of its 256 patterns), on one
  compiled kernel: the sizes are traced."""
  case = CASES["tokamax_simple_bf16"]
  lhs, rhs, _, cotangent = _inputs(case)
  ours, theirs = (jax.jit(functools.partial(_value_and_grads, _function(impl, "tokamax_simple_bf16")))
                  for impl in ("pallas", "ragged_dot"))
  for pattern in (0x00, 0x01, 0x80, 0x55, 0xAA, 0x0F, 0xF0, 0xFF):
    sizes = jnp.asarray([size * ((pattern >> g) & 1) for g, size in enumerate(case.sizes)],
                        case.sizes_dtype)
    args = (lhs, rhs, sizes, cotangent)
    _assert_matches(case, ours(*args), theirs(*args), _magnitudes(*args), sizes)


_DTYPES = (_F32, _BF16, _F16)


@pytest.mark.parametrize("lhs_dtype", _DTYPES)
@pytest.mark.parametrize("rhs_dtype", _DTYPES)
def test_result_and_gradient_dtypes_are_ragged_dots(lhs_dtype, rhs_dtype):
  """Every pair of the kernels' dtypes with every preferred_element_type they
  write (traced only)."""
  case = Case(lhs_dtype, rhs_dtype, (3, 5))
  args = _inputs(case)
  for preferred in (None, *_DTYPES):
    kwargs = dict(preferred_element_type=preferred)
    want = jax.eval_shape(functools.partial(
        _value_and_grads, functools.partial(jax.lax.ragged_dot, **kwargs)), *args)
    for impl in ("xla", "pallas"):
      got = jax.eval_shape(functools.partial(_value_and_grads, functools.partial(
          ops.grouped_matmul, implementation=impl, **kwargs)), *args)
      assert [g.dtype for g in got] == [w.dtype for w in want], (impl, preferred)


# --- what only XLA takes: implementation=None falls back, 'pallas' refuses ----

_FALLBACK = {
    # (lhs dtype, rhs dtype, options): the argument the kernels refuse
    "int8 operands": (jnp.int8, jnp.int8, dict(preferred_element_type=jnp.int32), "`lhs`"),
    "complex operands": (jnp.complex64, jnp.complex64, {}, "`lhs`"),
    "int8 weights": (_BF16, jnp.int8, {}, "`rhs`"),
    "integer result": (_F32, _F32, dict(preferred_element_type=jnp.int32),
                       "`preferred_element_type`"),
    "tf32 algorithm": (_F32, _F32, dict(precision="tf32_tf32_f32"), "`precision`"),
    "bf16 algorithm on f32": (_F32, _F32, dict(precision=_PRESET.BF16_BF16_F32),
                              "`precision`"),
    "bf16 accumulation": (_BF16, _BF16, dict(precision=_PRESET.BF16_BF16_BF16),
                          "`precision`"),
}


def _operands(lhs_dtype, rhs_dtype):
  lhs = (np.arange(8 * 4) % 7 - 3).reshape(8, 4).astype(lhs_dtype)
  rhs = (np.arange(2 * 4 * 3) % 5 - 2).reshape(2, 4, 3).astype(rhs_dtype)
  return jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(np.array([3, 4], np.int32))


@pytest.mark.parametrize("name", sorted(_FALLBACK))
def test_what_the_kernels_refuse_runs_on_xla(name, monkeypatch):
  lhs_dtype, rhs_dtype, kwargs, argument = _FALLBACK[name]
  lhs, rhs, sizes = _operands(lhs_dtype, rhs_dtype)
  with pytest.raises(ValueError, match=rf"implementation='pallas'\): .*{argument}"):
    ops.grouped_matmul(lhs, rhs, sizes, implementation="pallas", **kwargs)
  # implementation=None on an NVIDIA GPU runs XLA instead (traced here only).
  monkeypatch.setattr(_backend, "on_nvidia_gpu", lambda: True)
  jaxpr = str(jax.make_jaxpr(functools.partial(ops.grouped_matmul, **kwargs))(
      lhs, rhs, sizes))
  assert "ragged_dot" in jaxpr and "pallas_call" not in jaxpr


@pytest.mark.parametrize("name", ["int8 operands", "complex operands", "int8 weights"])
def test_xla_takes_every_dtype_ragged_dot_takes(name):
  """Small integers: every path computes them exactly."""
  lhs_dtype, rhs_dtype, kwargs, _ = _FALLBACK[name]
  args = _operands(lhs_dtype, rhs_dtype)
  got = ops.grouped_matmul(*args, **kwargs)
  want = jax.lax.ragged_dot(*args, **kwargs)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("precision", [
    None, "default", jax.lax.Precision.HIGHEST, ("high", "highest"),
    _PRESET.DEFAULT, _PRESET.F32_F32_F32])
def test_the_kernels_take_what_they_compute(precision):
  """The kernels multiply float32 exactly: every lax.Precision, their own
  algorithm and DEFAULT run them, with ragged_dot's result."""
  lhs, rhs, sizes, _ = _inputs(CASES["jax_two_groups_f32"])
  got = ops.grouped_matmul(lhs, rhs, sizes, precision=precision, implementation="pallas")
  want = jax.lax.ragged_dot(lhs, rhs, sizes, precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


def _ragged_dot_precisions(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args)
  return [e.params["precision"] for e in jaxpr.jaxpr.eqns if "ragged_dot" in e.primitive.name]


def test_precision_reaches_ragged_dot():
  lhs, rhs, sizes = _operands(_F32, _F32)
  for precision, want in [
      ("highest", (jax.lax.Precision.HIGHEST,) * 2),
      ((jax.lax.Precision.HIGH, "default"), (jax.lax.Precision.HIGH, jax.lax.Precision.DEFAULT)),
      (_PRESET.F32_F32_F32, _PRESET.F32_F32_F32)]:
    fn = functools.partial(ops.grouped_matmul, precision=precision, implementation="xla")
    assert _ragged_dot_precisions(fn, lhs, rhs, sizes) == [want], precision


def test_group_offset_is_none_as_ragged_dot_implements():
  lhs, rhs, sizes = _operands(_F32, _F32)
  np.testing.assert_array_equal(ops.grouped_matmul(lhs, rhs, sizes, group_offset=None),
                                jax.lax.ragged_dot(lhs, rhs, sizes, group_offset=None))
  for implementation in (None, "pallas", "xla"):
    with pytest.raises(ValueError, match="`group_offset` must be None"):
      ops.grouped_matmul(lhs, rhs, sizes, group_offset=jnp.array([1]),
                         implementation=implementation)


@pytest.mark.parametrize("kwargs, match", [
    (dict(precision="fastest_possible"), "`precision` must be"),
    (dict(precision=3), "`precision` must be"),
    (dict(precision=("high",)), "`precision` must be"),
    (dict(preferred_element_type="not a dtype"), "`preferred_element_type` must be"),
])
@pytest.mark.parametrize("implementation", [None, "pallas", "xla"])
def test_bad_options_raise(kwargs, match, implementation):
  lhs, rhs, sizes = _operands(_F32, _F32)
  with pytest.raises(ValueError, match=match):
    ops.grouped_matmul(lhs, rhs, sizes, implementation=implementation, **kwargs)


def test_dtypes_ragged_dot_refuses_are_named():
  # ragged_dot refuses an integer result narrower than its integer operands.
  lhs, rhs, sizes = _operands(jnp.int32, jnp.int32)
  with pytest.raises(ValueError, match="`preferred_element_type` bfloat16: jax.lax.ragged_dot"):
    ops.grouped_matmul(lhs, rhs, sizes, preferred_element_type=jnp.bfloat16)
