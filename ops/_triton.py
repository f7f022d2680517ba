"""Pieces the Pallas Triton kernels of several ops share.

The tile product every kernel accumulates in float32, the power-of-two sizes
their tiles take, and the chunked ops' (`ssd`, `gated_delta_rule`) causal
decay matrix. The Mosaic GPU kernels' pieces live in `_mosaic_gpu.py`.
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def dot(a, b, *, trans_a=False, trans_b=False):
  """fp32-accumulating tile product; full fp32 (no TF32) for fp32 tiles."""
  allow_tf32 = False if a.dtype == jnp.float32 else None
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=allow_tf32)


def next_pow2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, (n - 1).bit_length())


def is_pow2(n: int) -> bool:
  return n >= 1 and not n & (n - 1)


def causal_decay(b, chunk: int):
  """[L, L] float32 `exp(b_i - b_j)` for i >= j, else 0, from a chunk's [L]
  cumulative log-decay `b` (L = `chunk`); no overflow above the diagonal."""
  row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
  causal = row >= col
  diff = jnp.where(causal, b[:, None] - b[None, :], 0.0)
  return jnp.where(causal, jnp.exp(diff), 0.0)
