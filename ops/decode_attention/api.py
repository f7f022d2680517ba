"""`ops.decode_attention`: a few new queries per sequence against a KV cache.

The attention step of autoregressive decoding: T new tokens per sequence
(1 for plain sampling, a few for speculative decoding or a chunk of a prompt)
attend to a long cache of S slots with per-sequence valid lengths. The Pallas
kernel is split-K ("flash decoding", pallas.py); the semantics are those of
reference.py.

Glossary of shapes: B batch, T new tokens, S cache slots, N query heads, K
key/value heads (N a multiple of K: GQA/MQA without repeating K/V), H head
size.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ops import _backend
from ops import _shapes
from ops import _sharding
from ops import registry
from ops.decode_attention import configs
from ops.decode_attention import pallas
from ops.decode_attention import reference

_OP = "decode_attention"
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256  # The kernel's largest head size (padded to a power of two).
# The most rows (G query heads x T new tokens, padded to a power of two) one
# program holds, times the padded head size: its f32 accumulator lives in
# registers.
MAX_ROW_ELEMENTS = 128 * 128


def _validate(q, k_cache, v_cache, lengths, scale, local_window_size):
  """Raises ValueError naming the argument and the limit."""
  _shapes.check_arrays(_OP, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                             ("lengths", lengths)))
  for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
    if x.ndim != 4:
      raise ValueError(f"{_OP}: `{name}` must have rank 4 ([B, T, N, H] / [B, S, K, H]), "
                       f"got shape {x.shape}")
    if x.dtype not in _DTYPES:
      raise ValueError(f"{_OP}: `{name}` must be float32, bfloat16 or float16, got {x.dtype}")
  if not q.dtype == k_cache.dtype == v_cache.dtype:
    raise ValueError(f"{_OP}: `q`, `k_cache` and `v_cache` must share a dtype, got "
                     f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
  if k_cache.shape != v_cache.shape:
    raise ValueError(f"{_OP}: `k_cache` and `v_cache` must have the same shape, got "
                     f"{k_cache.shape} and {v_cache.shape}")
  batch, seq_q, num_heads, head_dim = q.shape
  _, seq_kv, num_kv, head_dim_k = k_cache.shape
  if min(q.shape + k_cache.shape) == 0:
    raise ValueError(f"{_OP}: `q` and `k_cache` need non-empty axes, got {q.shape} "
                     f"and {k_cache.shape}")
  if k_cache.shape[0] != batch:
    raise ValueError(f"{_OP}: `k_cache` batch {k_cache.shape[0]} differs from `q` batch {batch}")
  if head_dim_k != head_dim:
    raise ValueError(f"{_OP}: `k_cache` head size {head_dim_k} differs from `q` head "
                     f"size {head_dim}")
  if num_heads % num_kv:
    raise ValueError(f"{_OP}: `q` heads ({num_heads}) must be a multiple of `k_cache` "
                     f"heads ({num_kv})")
  if seq_q > seq_kv:
    raise ValueError(f"{_OP}: `q` has T={seq_q} new tokens, more than the S={seq_kv} "
                     "slots of `k_cache`; T must be <= S (the new tokens are in the cache)")
  if lengths.shape != (batch,):
    raise ValueError(f"{_OP}: `lengths` must have shape ({batch},), got {lengths.shape}")
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"{_OP}: `lengths` must be integers, got {lengths.dtype}")
  if not isinstance(lengths, jax.core.Tracer):
    values = np.asarray(lengths)
    lo, hi = int(values.min()), int(values.max())
    if lo < seq_q or hi > seq_kv:
      raise ValueError(f"{_OP}: `lengths` must lie in [T={seq_q}, S={seq_kv}] (each "
                       f"sequence holds its T new tokens), got values in [{lo}, {hi}]")
  if scale is not None and (isinstance(scale, bool) or not isinstance(
      scale, (int, float, np.integer, np.floating))):
    raise ValueError(f"{_OP}: `scale` must be a Python number or None, got "
                     f"{type(scale).__name__}")
  window = local_window_size
  if window is not None:
    pair = window if isinstance(window, (tuple, list)) else (window, None)
    if len(pair) != 2 or not all(
        side is None or (isinstance(side, int) and not isinstance(side, bool) and side >= 0)
        for side in pair):
      raise ValueError(f"{_OP}: `local_window_size` must be an int >= 0 or a (left, right) "
                       f"pair of ints >= 0 or None, got {local_window_size!r}")


def kernel_limit(q, k_cache) -> str | None:
  """None when the Pallas kernel takes inputs like these, else the reason."""
  _, seq_q, num_heads, head_dim = q.shape
  groups = num_heads // k_cache.shape[2]
  if head_dim > MAX_HEAD_DIM:
    return f"`q` head size must be <= {MAX_HEAD_DIM} for the kernel, got {head_dim}"
  rows, hp = pallas.padded(groups * seq_q), pallas.padded(head_dim)
  if rows * hp > MAX_ROW_ELEMENTS:
    return (f"the kernel holds G * T = {groups} * {seq_q} query rows (padded to {rows}) "
            f"of head size {hp} per program, at most {MAX_ROW_ELEMENTS} values; use "
            "fewer new tokens per call")
  return None


def decode_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, *,
    scale: float | None = None,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    implementation: registry.Choice = None) -> jax.Array:
  """Attention of T new tokens per sequence to a KV cache with valid lengths.

  Query t of sequence b sits at position p = lengths[b] - T + t (the new
  tokens are the last T valid cache entries) and attends to the cache keys
  s <= p (and s >= p - left with a window); entries s >= lengths[b] are never
  read. `decode_attention_reference` computes the same densely.

  The Pallas kernel is forward-only (decoding needs no gradient): the op is
  still differentiable, its gradients those of the XLA reference, recomputed
  in the backward (no backward kernel).

  Args:
    q: [B, T, N, H] queries of the new tokens, T <= S (typically 1 to 16).
    k_cache, v_cache: [B, S, K, H] keys and values, the new tokens' included;
      N must be a multiple of K (GQA without repeating K/V).
    lengths: [B] ints in [T, S]: valid cache entries per sequence (checked
      when concrete).
    scale: logit scale, default H ** -0.5 (a static Python number).
    local_window_size: `left` or `(left, right)` as `jax.nn.dot_product_attention`
      takes it: query p sees keys s >= p - left (None: unbounded); keys right
      of the query are masked anyway (causal), so `right` changes nothing.
    implementation: None (on NVIDIA GPUs the Triton kernel where it takes the
      inputs and is measured faster, `ops/dispatch_tables/decode_attention.json`;
      XLA elsewhere), 'triton' (the kernel; interpret mode off GPU; 'pallas'
      is its alias), 'xla' (`reference.decode_attention_xla`), or a sequence
      of these tried in order (`ops.registry`).

  Returns:
    [B, T, N, H] in q's dtype (float32 accumulation).

  Raises:
    TypeError: when an array argument is not an array.
    ValueError: on a bad shape, dtype, length or option (naming the argument
      and the limit), or with implementation='triton' (or 'pallas') for inputs
      the kernel cannot take (head size above 256; more than 128 x 128 query rows times
      head size per key/value head).
  """
  _validate(q, k_cache, v_cache, lengths, scale, local_window_size)
  call = dict(q=q, k_cache=k_cache, v_cache=v_cache, lengths=lengths,
              scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
              local_window_size=local_window_size)
  return IMPLEMENTATIONS.choose(implementation, call).run(**call)


def _xla(**call):
  return reference.decode_attention_xla(**call)


def _triton(q, k_cache, v_cache, lengths, scale, local_window_size):
  def kernel_path(q, k_cache, v_cache, lengths):
    return pallas.decode_attention_pallas(
        q, k_cache, v_cache, lengths, scale=scale, local_window_size=local_window_size,
        interpret=_backend.pallas_interpret())

  # Query and key/value heads split together, so GQA groups stay whole.
  return _sharding.run(_OP, kernel_path, (
      ("q", q, ("batch", "seq", "heads", None)),
      ("k_cache", k_cache, ("batch", "seq", "heads", None)),
      ("v_cache", v_cache, ("batch", "seq", "heads", None)),
      ("lengths", lengths, ("batch",))),
      ("batch", "seq", "heads", None), split=("batch", "heads"))


def _triton_supports(call) -> str | None:
  return kernel_limit(call["q"], call["k_cache"])


# The measured table decides the default (ops/dispatch_tables/decode_attention.json,
# where the kernel is timed as 'pallas').
IMPLEMENTATIONS = registry.xla_and_triton(
    _OP, xla=_xla, triton=_triton, supports=_triton_supports,
    config=configs.TritonConfig)
