"""Parameters of a model's structure drawn on the host: traced, not compiled.

A model's own `init` compiles once per program (Haiku's truncated-normal
initializers slowly, once per shape) and leaves some parameters at zero
(adaLN-Zero, biases), which would make comparisons trivial. Tests that need
any finite, non-degenerate parameters draw them here instead.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


def random_params(transformed, *args, seed: int = 1):
  """Parameters in the shapes and dtypes `transformed.init(key, *args)` gives.

  Weights have variance 1 / fan-in, norm scales 1 +- 0.1, every other vector
  +- 0.1 (so no bias or offset is trivially zero).
  """
  shapes = jax.eval_shape(transformed.init, jax.random.key(0), *args)
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    std = 1.0 / math.sqrt(math.prod(leaf.shape[:-1])) if leaf.ndim >= 2 else 0.1
    u = rng.uniform(-1.0, 1.0, leaf.shape) * std * math.sqrt(3.0)
    if jax.tree_util.keystr(path).endswith("'scale']"):
      u = u + 1.0
    return jnp.asarray(np.asarray(u, leaf.dtype))  # cast on the host: no compile

  return jax.tree_util.tree_map_with_path(draw, shapes)
