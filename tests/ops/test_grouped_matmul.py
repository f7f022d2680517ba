"""ops.grouped_matmul: Pallas (interpret on CPU) and XLA against the reference."""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import tolerances
import ops
from ops.grouped_matmul import TritonConfig
from ops.grouped_matmul import grouped_matmul_reference
from ops.grouped_matmul import metadata
from ops.grouped_matmul import pallas
from ops.grouped_matmul import reference

# Absolute tolerances relative to the largest reference magnitude, by dtype.
TOLERANCE = tolerances.GROUPED_MATMUL

M, K, N, G = 70, 40, 36, 4
# Tiles of 16 rows: groups span several tiles, tiles straddle group
# boundaries, and M = 70 is not a tile multiple.
SMALL_BLOCKS = TritonConfig(block_m=16, block_k=16, block_n=16, tgmm_block_m=16,
                            tgmm_block_k=16, tgmm_block_n=16)

GROUPS = {
    "mixed_with_empty": [5, 0, 50, 15],
    "all_in_last": [0, 0, 0, 70],
    "all_in_first": [70, 0, 0, 0],
    "short_tail_rows_zero": [3, 4, 0, 10],
    "one_row_groups": [1, 1, 1, 1],
}


def _inputs(dtype, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  lhs = jax.random.normal(k1, (M, K), jnp.float32).astype(dtype)
  rhs = jax.random.normal(k2, (G, K, N), jnp.float32).astype(dtype)
  cotangent = jax.random.normal(k3, (M, N), jnp.float32)
  return lhs, rhs, cotangent


def _kernel(lhs, rhs, group_sizes):
  starts, ends = reference.group_bounds(group_sizes, lhs.shape[0])
  return pallas.grouped_matmul_pallas(lhs, rhs, starts, ends, block_sizes=SMALL_BLOCKS)


IMPLS = {
    "reference": grouped_matmul_reference,
    "pallas_small_blocks": _kernel,
    "pallas": functools.partial(ops.grouped_matmul, implementation="pallas"),
    "xla": functools.partial(ops.grouped_matmul, implementation="xla"),
}


@functools.cache
def _value_and_grads(impl):
  """Jitted (out, dlhs, drhs) for a fixed cotangent; group sizes are traced."""
  fn = IMPLS[impl]

  @jax.jit
  def run(lhs, rhs, group_sizes, cotangent):
    out, vjp = jax.vjp(lambda a, b: fn(a, b, group_sizes), lhs, rhs)
    dlhs, drhs = vjp(cotangent.astype(out.dtype))
    return out, dlhs, drhs
  return run


def _assert_close(actual, expected, dtype):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  scale = max(1.0, float(np.abs(expected).max()))
  np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE[dtype] * scale)


def _check(impl, dtype, group_sizes):
  lhs, rhs, cotangent = _inputs(dtype)
  sizes = jnp.asarray(group_sizes, jnp.int32)
  got = _value_and_grads(impl)(lhs, rhs, sizes, cotangent)
  want = _value_and_grads("reference")(lhs, rhs, sizes, cotangent)
  for g, w, what in zip(got, want, ("out", "dlhs", "drhs")):
    assert g.dtype == dtype, what
    _assert_close(g, w, dtype)
  return got


@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("impl", ["pallas_small_blocks", "xla"])
def test_float32_values_and_grads(impl, groups):
  out, dlhs, _ = _check(impl, jnp.float32, GROUPS[groups])
  total = sum(GROUPS[groups])
  if total < M:  # Rows after the last group: zero output, zero gradient.
    assert not np.asarray(out[total:]).any()
    assert not np.asarray(dlhs[total:]).any()


@pytest.mark.parametrize("impl", ["pallas_small_blocks", "pallas", "xla"])
def test_bfloat16_values_and_grads(impl):
  _check(impl, jnp.bfloat16, GROUPS["mixed_with_empty"])


def test_default_blocks_through_public_api_float32():
  _check("pallas", jnp.float32, GROUPS["short_tail_rows_zero"])


def test_empty_group_has_zero_weight_gradient():
  _, _, drhs = _check("pallas_small_blocks", jnp.float32, GROUPS["mixed_with_empty"])
  assert not np.asarray(drhs[1]).any()
  assert np.asarray(drhs[2]).any()


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(st.lists(st.integers(0, 30), min_size=G, max_size=G))
def test_kernel_matches_ragged_dot_on_drawn_group_sizes(sizes):
  # Sizes summing past M are cut at row M (the traced-input behaviour); the
  # reference and ragged_dot (which only sees valid sizes) agree on that.
  starts, ends = reference.group_bounds(jnp.asarray(sizes, jnp.int32), M)
  lhs, rhs, cotangent = _inputs(jnp.float32, seed=1)
  got = _value_and_grads("pallas_small_blocks")(lhs, rhs, jnp.asarray(sizes), cotangent)
  valid = ends - starts
  want = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, valid), lhs, rhs)
  want = (want[0], *want[1](cotangent))
  for g, w in zip(got, want):
    _assert_close(g, w, jnp.float32)


def test_default_implementation_on_cpu_is_ragged_dot():
  lhs, rhs, _ = _inputs(jnp.float32)
  jaxpr = str(jax.make_jaxpr(ops.grouped_matmul)(lhs, rhs, jnp.asarray([10, 20, 30, 10])))
  assert "ragged_dot" in jaxpr and "pallas_call" not in jaxpr
  jaxpr = str(jax.make_jaxpr(functools.partial(ops.grouped_matmul, implementation="pallas"))(
      lhs, rhs, jnp.asarray([10, 20, 30, 10])))
  assert "pallas_call" in jaxpr


@pytest.mark.parametrize("lhs_shape, rhs_shape, sizes, dtype, match", [
    ((M,), (G, K, N), [1] * G, jnp.float32, "`lhs` must be"),
    ((M, K), (K, N), [1] * G, jnp.float32, "`rhs` must be"),
    ((M, K + 1), (G, K, N), [1] * G, jnp.float32, "share K"),
    ((M, K), (G, K, N), [1] * (G + 1), jnp.float32, "`group_sizes` must be"),
    ((M, K), (G, K, N), [40, 40, 0, 0], jnp.float32, "more than"),
    ((M, K), (G, K, N), [-1, 2, 0, 0], jnp.float32, "non-negative"),
])
def test_bad_arguments_raise(lhs_shape, rhs_shape, sizes, dtype, match):
  with pytest.raises(ValueError, match=match):
    ops.grouped_matmul(jnp.zeros(lhs_shape, dtype), jnp.zeros(rhs_shape, dtype),
                       jnp.asarray(sizes, jnp.int32), implementation="xla")


def test_bad_implementation_raises():
  lhs, rhs, _ = _inputs(jnp.float32)
  with pytest.raises(ValueError, match="implementation"):
    ops.grouped_matmul(lhs, rhs, jnp.asarray([1] * G), implementation="cuda")


def test_group_metadata_visits_each_row_once():
  sizes = jnp.asarray([5, 0, 50, 15])
  starts, ends = reference.group_bounds(sizes, M)
  group, tile, row_start, row_end = metadata.group_metadata(starts, ends, 80, 16)
  assert group.shape == (80 // 16 + G,)
  covered = np.zeros(80, int)
  for g, t, s, e in zip(*map(np.asarray, (group, tile, row_start, row_end))):
    rows = np.arange(t * 16, t * 16 + 16)
    covered[rows[(rows >= s) & (rows < e)]] += 1
  np.testing.assert_array_equal(covered, 1)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_vmap_over_batches_of_groupings(implementation):
  lhs = jax.random.normal(jax.random.PRNGKey(0), (3, 40, 16))
  rhs = jax.random.normal(jax.random.PRNGKey(1), (3, G, 16, 16))
  sizes = jnp.asarray([[10, 0, 20, 10], [40, 0, 0, 0], [1, 2, 3, 4]])

  def loss(fn):
    return lambda a, b: jnp.sum(jnp.sin(jax.vmap(fn)(a, b, sizes)))
  fn = functools.partial(ops.grouped_matmul, implementation=implementation)
  got = jax.jit(jax.value_and_grad(loss(fn), argnums=(0, 1)))(lhs, rhs)
  want = jax.value_and_grad(loss(grouped_matmul_reference), argnums=(0, 1))(lhs, rhs)
  jax.tree.map(lambda g, w: _assert_close(g, w, jnp.float32), got, want)
