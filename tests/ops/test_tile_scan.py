"""ops._tile_scan: the in-kernel associative scan primitive, off-GPU (its
lowering through lax.associative_scan; the Triton lowering is exercised by
the scan kernels' tests on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops._tile_scan import tile_associative_scan


def _compose(first, second):
  return first[0] * second[0], second[0] * first[1] + second[1]


def _sequential(a, b, axis, reverse):
  a, b = np.moveaxis(np.asarray(a), axis, 0), np.moveaxis(np.asarray(b), axis, 0)
  order = range(len(a) - 1, -1, -1) if reverse else range(len(a))
  acc_a, acc_b = np.ones_like(a[0]), np.zeros_like(b[0])
  out_a, out_b = np.empty_like(a), np.empty_like(b)
  for t in order:
    acc_a, acc_b = acc_a * a[t], a[t] * acc_b + b[t]
    out_a[t], out_b[t] = acc_a, acc_b
  return np.moveaxis(out_a, 0, axis), np.moveaxis(out_b, 0, axis)


@pytest.mark.parametrize("axis,reverse", [(0, False), (0, True), (1, False), (-1, True)])
def test_matches_a_sequential_recurrence(axis, reverse):
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.uniform(ka, (8, 4, 3), minval=0.5, maxval=1.0)
  b = jax.random.normal(kb, (8, 4, 3))
  got = jax.jit(lambda a, b: tile_associative_scan(_compose, (a, b), axis=axis,
                                                   reverse=reverse))(a, b)
  want = _sequential(a, b, axis % 3, reverse)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_vmap_moves_the_axis():
  a = jnp.full((2, 5, 3), 0.5)
  b = jnp.ones((2, 5, 3))
  fn = lambda a, b: tile_associative_scan(_compose, (a, b), axis=0)
  got = jax.vmap(fn)(a, b)
  want = [np.stack(w) for w in zip(*(_sequential(a[i], b[i], 0, False) for i in range(2)))]
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6)


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="elems"):
    tile_associative_scan(_compose, (jnp.ones((2, 3)), jnp.ones((3, 2))))
  with pytest.raises(ValueError, match="axis"):
    tile_associative_scan(_compose, (jnp.ones((2, 3)), jnp.ones((2, 3))), axis=2)
