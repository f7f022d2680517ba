"""ops._rows.pick_row: the kernels' masked-sum row read equals indexing."""

import jax
import jax.numpy as jnp
import numpy as np

from ops._rows import pick_row


def test_pick_row_equals_indexing():
  x = jax.random.normal(jax.random.key(0), (5, 3, 4))
  for row in range(5):
    np.testing.assert_array_equal(pick_row(x, row), x[row])
    np.testing.assert_array_equal(pick_row(x, jnp.int32(row), keepdims=True), x[row:row + 1])
