"""`gated_delta_rule`: Gated DeltaNet's recurrence.

Yang, Kautz & Hatamizadeh 2024, https://arxiv.org/abs/2412.06464.

Glossary of shapes: B batch, T time, N heads, G query/key groups (N % G == 0),
K key size, V value size.
"""

import numbers

import jax

from ops import _backend
from ops import _shapes
from ops.gated_delta_rule import pallas as pallas_impl
from ops.gated_delta_rule.xla import gated_delta_rule_xla
from ops.ssd.api import chunked_kernel_limit
from ops.ssd.api import run_chunked_per_shard
from ops.ssd.api import validate

def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, log_decay: jax.Array,
                     beta: jax.Array, *, scale: float | None = None,
                     initial_state: jax.Array | None = None,
                     chunk_size: int | None = None,
                     implementation: _backend.Implementation = None
                     ) -> tuple[jax.Array, jax.Array]:
  """The gated delta rule, state `M = S^T` in the [K, V] layout of `ops.ssd`::

      S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
      y_t = scale * S_t q_t

  Args:
    q: [B, T, N, K] queries, or [B, T, G, K] shared by N // G heads.
    k: keys, the shape of `q` (L2-normalize them: the rule assumes `|k| = 1`).
    v: [B, T, N, V] values; sets the output dtype.
    log_decay: [B, T, N] log of the decay gate alpha (<= 0).
    beta: [B, T, N] write strength in [0, 1].
    scale: output scale, default K ** -0.5.
    initial_state: [B, N, K, V] state before the first token, or None (zeros).
    chunk_size: tokens per chunk (default 32 on the kernel, measured faster
      than 64 on an H200; 64 on the XLA form; the kernel takes a power of
      two >= 16).
    implementation: None (on NVIDIA GPUs the faster of the Pallas kernels and
      XLA where measured, `ops/dispatch_tables/gated_delta_rule.json`; XLA
      elsewhere),
      'pallas' (the kernels; interpret mode off GPU) or 'xla' (the chunked
      WY form of xla.py).

  Returns:
    y: [B, T, N, V] in `v`'s dtype (accumulated in float32).
    final_state: [B, N, K, V] float32.
  """
  validate("gated_delta_rule", q, k, v, log_decay, initial_state,
           extra=(("beta", beta),))
  _shapes.check_chunk_size("gated_delta_rule", chunk_size)
  if scale is not None and (isinstance(scale, bool) or not (
      isinstance(scale, numbers.Real) or getattr(scale, "shape", None) == ())):
    raise TypeError(f"gated_delta_rule: `scale` must be a number (or a scalar "
                    f"array) or None, got {scale!r}")

  def kernel_limit():
    return chunked_kernel_limit(q, k, v, chunk_size, pallas_impl.MAX_HEAD_SIZE,
                                "a chunk's [K, V] state and gradients live in registers")

  # The measured table decides (ops/dispatch_tables/gated_delta_rule.json).
  backend = _backend.choose("gated_delta_rule", implementation, kernel_limit,
                            key_dim=q.shape[-1], length=q.shape[1])
  if backend == "xla":
    return gated_delta_rule_xla(q, k, v, log_decay, beta, scale=scale,
                                initial_state=initial_state, chunk_size=chunk_size)
  return run_chunked_per_shard(
      "gated_delta_rule", lambda q, k, v, g, h0, beta: pallas_impl.gated_delta_rule_pallas(
          q, k, v, g, beta, scale=scale, initial_state=h0, chunk_size=chunk_size),
      q, k, v, log_decay, initial_state, extra=(("beta", beta),))
