"""ops._rows: the kernels' masked-sum row read equals indexing; tile steps."""

import jax
import jax.numpy as jnp
import numpy as np

from ops._rows import pick_row
from ops._rows import tile_steps


def test_pick_row_equals_indexing():
  x = jax.random.normal(jax.random.key(0), (5, 3, 4))
  for row in range(5):
    np.testing.assert_array_equal(pick_row(x, row), x[row])
    np.testing.assert_array_equal(pick_row(x, jnp.int32(row), keepdims=True), x[row:row + 1])


def test_tile_steps_in_processing_order():
  assert tile_steps(0, 8, 4, False) == [0, 1, 2, 3]
  assert tile_steps(1, 8, 4, False) == [4, 5, 6, 7]
  assert tile_steps(0, 8, 4, True) == [7, 6, 5, 4]   # the chunk's last tile first
  assert tile_steps(1, 8, 4, True) == [3, 2, 1, 0]
