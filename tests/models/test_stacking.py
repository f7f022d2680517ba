"""remat_policy and scan_layers: the shared stacking helper."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pk
from probjax_hk import stacking


class _DrawBlock(hk.Module):
  """Writes one random draw per layer into row `i` of the carry."""

  def __call__(self, draws, i):
    draw = jax.random.uniform(hk.next_rng_key(), draws.shape[1:])
    return draws.at[i].set(draw), i + 1


@pytest.mark.parametrize("scan_layers", [False, True])
def test_each_layer_gets_its_own_rng(scan_layers):
  num_layers = 4

  def f():
    draws, _ = stacking.apply_stack(lambda name: _DrawBlock(name=name), num_layers,
                                    (jnp.zeros((num_layers, 8)), jnp.array(0)),
                                    scan_layers=scan_layers)
    return draws

  draws = hk.transform(f).apply({}, jax.random.key(0))
  for a in range(num_layers):
    for b in range(a + 1, num_layers):
      assert not np.allclose(draws[a], draws[b]), (a, b)


def test_unknown_policy_lists_the_valid_names():
  with pytest.raises(ValueError, match="remat_policy.*dots_saveable"):
    stacking.validate_remat_policy("dots_savable")
  assert "full" in pk.remat_policy_names()
  assert "nothing_saveable" in pk.remat_policy_names()


def test_stack_and_unstack_are_inverse():
  params = {
      "m/embed": {"w": np.ones((3, 2))},
      "m/block_0/lin": {"w": np.full((2, 2), 0.0)},
      "m/block_1/lin": {"w": np.full((2, 2), 1.0)},
      "m/block_2/lin": {"w": np.full((2, 2), 2.0)},
  }
  stacked = pk.stack_layer_params(params)
  assert set(stacked) == {"m/embed", "m/blocks/block/lin"}
  np.testing.assert_array_equal(stacked["m/blocks/block/lin"]["w"][:, 0, 0], [0, 1, 2])
  round_trip = pk.unstack_layer_params(stacked)
  assert set(round_trip) == set(params)
  for name in params:
    np.testing.assert_array_equal(round_trip[name]["w"], params[name]["w"])


def test_stacking_a_gap_in_layers_raises():
  with pytest.raises(ValueError, match="0..n-1"):
    pk.stack_layer_params({"m/block_0/l": {"w": np.ones(1)}, "m/block_2/l": {"w": np.ones(1)}})
