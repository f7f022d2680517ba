"""`ops.flex_attention`: masked multi-head attention with a Pallas flash kernel.

Glossary of shapes: B batch, T query tokens, S key/value tokens, N query heads,
K key/value heads (N a multiple of K: GQA/MQA without repeating K/V), H head
size. The mask conventions are those of `jax.nn.dot_product_attention`; see
reference.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ops import _backend
from ops import _mosaic_gpu
from ops import _sharding
from ops import registry
from ops.flex_attention import configs
from ops.flex_attention import mosaic
from ops.flex_attention import mosaic_backward
from ops.flex_attention import pallas
from ops.flex_attention import reference
from ops.flex_attention import ring

_OP = "flex_attention"
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256  # The kernel's largest head size (padded to a power of two).


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _validate(q, k, v, is_causal, scale, segment_ids, local_window_size,
              key_value_seq_lengths):
  """Raises ValueError naming the argument; returns the normalized options."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"`{name}` must have rank 4 ([B, T, N, H] / [B, S, K, H]), "
                       f"got shape {getattr(x, 'shape', None)}")
    if x.dtype not in _DTYPES:
      raise ValueError(f"`{name}` must be float32, bfloat16 or float16, got {x.dtype}")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"`q`, `k` and `v` must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if k.shape != v.shape:
    raise ValueError(f"`k` and `v` must have the same shape, got {k.shape} and {v.shape}")
  batch, seq_q, num_heads, head_dim = q.shape
  _, seq_kv, num_kv, head_dim_k = k.shape
  if k.shape[0] != batch:
    raise ValueError(f"`k` batch {k.shape[0]} differs from `q` batch {batch}")
  if head_dim_k != head_dim:
    raise ValueError(f"`k` head size {head_dim_k} differs from `q` head size {head_dim}")
  if num_kv == 0 or num_heads % num_kv:
    raise ValueError(f"`q` heads ({num_heads}) must be a multiple of `k` heads ({num_kv})")
  if min(seq_q, seq_kv, head_dim) == 0:
    raise ValueError(f"`q` and `k` need non-empty axes, got {q.shape} and {k.shape}")
  if not isinstance(is_causal, bool):
    raise ValueError(f"`is_causal` must be a bool, got {is_causal!r}")
  if scale is not None and not isinstance(scale, (int, float)):
    raise ValueError(f"`scale` must be a Python number or None, got {type(scale).__name__}")
  window = None
  if local_window_size is not None:
    try:
      window = reference.normalize_window(local_window_size)
    except (TypeError, ValueError):
      raise ValueError("`local_window_size` must be an int or a (left, right) pair, "
                       f"got {local_window_size!r}") from None
    for side in window:
      if side is not None and (not isinstance(side, int) or isinstance(side, bool)
                               or side < 0):
        raise ValueError("`local_window_size` entries must be ints >= 0 or None, "
                         f"got {local_window_size!r}")
  q_ids, kv_ids = reference.split_segment_ids(segment_ids)
  if q_ids is not None:
    if not isinstance(segment_ids, (tuple, list)) and seq_q != seq_kv:
      raise ValueError("`segment_ids` as one [B, T] array needs T == S; pass a pair "
                       f"(q_ids [B, T], kv_ids [B, S]), got T={seq_q}, S={seq_kv}")
    for name, ids, n in (("q", q_ids, seq_q), ("kv", kv_ids, seq_kv)):
      if getattr(ids, "shape", None) != (batch, n):
        raise ValueError(f"`segment_ids` ({name}) must have shape {(batch, n)}, "
                         f"got {getattr(ids, 'shape', None)}")
      if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"`segment_ids` must be integers, got {ids.dtype}")
  lengths = key_value_seq_lengths
  if lengths is not None:
    if getattr(lengths, "shape", None) != (batch,):
      raise ValueError(f"`key_value_seq_lengths` must have shape ({batch},), "
                       f"got {getattr(lengths, 'shape', None)}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
      raise ValueError(f"`key_value_seq_lengths` must be integers, got {lengths.dtype}")
    if _is_concrete(lengths):
      values = np.asarray(lengths)
      lo, hi = int(values.min()), int(values.max())
      if lo < 0 or hi > seq_kv:
        raise ValueError(f"`key_value_seq_lengths` must lie in [0, S={seq_kv}], "
                         f"got values in [{lo}, {hi}]")
  return window, q_ids, kv_ids


def kernel_limit(q) -> str | None:
  """None when the Pallas kernel takes inputs like `q`, else the reason."""
  head_dim = q.shape[-1]
  if head_dim > MAX_HEAD_DIM:
    return f"`q` head size must be <= {MAX_HEAD_DIM} for the kernel, got {head_dim}"
  return None


def flex_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, is_causal: bool = False,
    scale: float | None = None, segment_ids=None,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    mask_mod: reference.MaskMod | None = None,
    score_mod: reference.ScoreMod | None = None,
    implementation: registry.Choice = None) -> jax.Array:
  """Softmax attention with causal/window/segment/length masks and mods.

  With the sequence axis split over Explicit mesh axes it runs as ring
  attention (`ops/flex_attention/ring.py`: key/value shards passed between
  the devices, partial outputs merged by log-sum-exp, causal work balanced).
  Its blocks run on the implementation chosen, the kernels taking each
  block's causal mask and window as a local window; a `mask_mod` or
  `score_mod` (which see global positions) needs 'xla'.

  Args:
    q: [B, T, N, H] queries.
    k, v: [B, S, K, H] keys and values; N must be a multiple of K.
    is_causal: query t sees keys s <= t.
    scale: logit scale, default H ** -0.5.
    segment_ids: [B, T] ints (T == S), or a pair ([B, T], [B, S]): a query sees
      keys of its own segment only (packed sequences).
    local_window_size: `w` or `(left, right)`: t sees s in [t - left, t + right]
      (a None side is unbounded).
    key_value_seq_lengths: [B] ints in [0, S]: keys s >= length are padding.
    mask_mod: `mask_mod(b, n, t, s) -> bool` on broadcastable int32 index
      arrays (b batch, n query head, t query, s key): False masks out. It is
      evaluated densely once per call to list, per tile, the open and the
      partly masked tiles (so empty tiles are skipped), and on tile indices
      inside the kernel. It may not close over arrays (use segment_ids for
      data-dependent documents).
    score_mod: `score_mod(score, b, n, t, s) -> score`, elementwise in the
      scaled f32 logit `score`, applied inside the kernel before the softmax;
      gradients flow through it (its pullback runs in the backward kernels).
      Same closure rule as mask_mod.
    implementation: 'pallas' (the kernels: Mosaic GPU and Triton launches as
      tuned per call in configs.py; interpret mode off GPU), 'triton' (every
      launch on Triton), 'mosaic' (forward and backward on Mosaic GPU: 16-bit
      inputs on a Hopper GPU, no segment ids or mods), 'xla' (the dense
      reference), a sequence of these tried in order (`ops.registry`), or
      None: XLA, since this op has no dispatch table of its own
      (`probjax_hk.dot_product_attention` chooses the kernels by measurement).

  Returns:
    [B, T, N, H] in q's dtype. A query that sees no key returns zeros.

  Examples:
    A prefix-LM mask (the first 64 keys are seen by every query, the rest
    causally) with an ALiBi bias, both evaluated inside the kernel:

    >>> q = k = v = jnp.ones((2, 256, 4, 32), jnp.bfloat16)  # [B, T, N, H]
    >>> def prefix_lm(b, n, t, s):  # int32 index arrays -> bool
    ...   return (s <= t) | (s < 64)
    >>> def alibi(score, b, n, t, s):  # f32 scaled logits -> logits
    ...   return score - 2.0 ** -(n + 1.0) * jnp.abs(t - s)
    >>> ops.flex_attention(q, k, v, mask_mod=prefix_lm, score_mod=alibi).shape
    (2, 256, 4, 32)

    Two documents packed in each row, a token seeing the 64 before it in its
    own document:

    >>> documents = jnp.repeat(jnp.arange(2), 128)[None].repeat(2, axis=0)  # [B, T]
    >>> y = ops.flex_attention(q, k, v, is_causal=True, segment_ids=documents,
    ...                        local_window_size=(64, 0))
  """
  window, q_ids, kv_ids = _validate(q, k, v, is_causal, scale, segment_ids,
                                    local_window_size, key_value_seq_lengths)
  for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
    if fn is not None and not callable(fn):
      raise ValueError(f"`{name}` must be callable or None, got {type(fn).__name__}")
  call = dict(q=q, k=k, v=v, is_causal=is_causal,
              scale=q.shape[-1] ** -0.5 if scale is None else scale, segment_ids=segment_ids,
              window=window, q_ids=q_ids, kv_ids=kv_ids,
              key_value_seq_lengths=key_value_seq_lengths, mask_mod=mask_mod,
              score_mod=score_mod)
  # Arguments split differently are an error before any choice.
  ring.plan(q, k, v, q_ids, kv_ids, key_value_seq_lengths)
  return IMPLEMENTATIONS.choose(implementation, call).run(**call)


def _xla(q, k, v, *, is_causal, scale, segment_ids, window, q_ids, kv_ids,
         key_value_seq_lengths, mask_mod, score_mod, **call):
  split = ring.plan(q, k, v, q_ids, kv_ids, key_value_seq_lengths)
  if split is not None:
    return ring.flex_attention_ring(
        split, q=q, k=k, v=v, is_causal=is_causal, scale=scale, window=window, q_ids=q_ids,
        kv_ids=kv_ids, key_value_seq_lengths=key_value_seq_lengths, mask_mod=mask_mod,
        score_mod=score_mod)
  return reference.flex_attention_reference(
      q, k, v, is_causal=is_causal, scale=scale, segment_ids=segment_ids,
      local_window_size=window, key_value_seq_lengths=key_value_seq_lengths,
      mask_mod=mask_mod, score_mod=score_mod)


def _kernels(tiles=lambda config: config):
  """The kernel path with `tiles(tuned config) -> config` choosing the launches."""
  def run(q, k, v, *, is_causal, scale, window, q_ids, kv_ids, key_value_seq_lengths,
          mask_mod, score_mod, **_):
    interpret = _backend.pallas_interpret()
    config = tiles(configs.get_config(_padded_head_dim(q), q.dtype, interpret=interpret))
    split = ring.plan(q, k, v, q_ids, kv_ids, key_value_seq_lengths)
    if split is not None:  # `ring.kernel_limit` admitted it
      return ring.flex_attention_ring(
          split, q=q, k=k, v=v, is_causal=is_causal, scale=scale, window=window, q_ids=q_ids,
          kv_ids=kv_ids, key_value_seq_lengths=key_value_seq_lengths, mask_mod=mask_mod,
          score_mod=score_mod, kernels=ring.Kernels(config, interpret))

    def kernel_path(q, k, v, q_ids, kv_ids, lengths):
      return pallas.flex_attention_pallas(
          q, k, v, scale=scale, is_causal=is_causal, window=window,
          q_segment_ids=q_ids, kv_segment_ids=kv_ids, key_value_seq_lengths=lengths,
          interpret=interpret, config=config, mask_mod=mask_mod, score_mod=score_mod)

    # Query and key/value heads split together, so GQA groups stay whole.
    plan = _sharding.plan(_OP, (
        ("q", q, ("batch", "seq", "heads", None)),
        ("k", k, ("batch", "seq", "heads", None)),
        ("v", v, ("batch", "seq", "heads", None)),
        ("segment_ids", q_ids, ("batch", "seq")),
        ("segment_ids", kv_ids, ("batch", "seq")),
        ("key_value_seq_lengths", key_value_seq_lengths, ("batch",))),
        split=("batch", "heads"))
    if plan.splits and (mask_mod is not None or score_mod is not None):
      raise ValueError(
          f"{_OP}: `mask_mod` and `score_mod` see global batch and head indices, "
          f"which a kernel run per shard does not have; this call splits "
          f"{dict(plan.axes)} over the mesh. Call it outside the mesh, inside your "
          "own `jax.shard_map`, or with implementation='xla'")
    return plan.run(kernel_path, ("batch", "seq", "heads", None))
  return run


def _padded_head_dim(q) -> int:
  return max(16, 1 << (q.shape[-1] - 1).bit_length())


def _kernel_supports(call) -> str | None:
  return kernel_limit(call["q"]) or ring.kernel_limit(call)


def _all_triton(config: configs.FlexConfig) -> configs.FlexConfig:
  return dataclasses.replace(config.forward_on(None), mosaic_bwd=None)


def _all_mosaic(config: configs.FlexConfig) -> configs.FlexConfig:
  # The tuned bounded tiles stay; only the limits that hand calls to Triton go.
  return dataclasses.replace(config, mosaic_fwd_min_scores=0)


def _mosaic_supports(call) -> str | None:
  q, k = call["q"], call["k"]
  if (limit := _kernel_supports(call)) is not None:
    return limit
  if not _mosaic_gpu.takes(q.dtype):
    return f"the Mosaic GPU kernels take float16 or bfloat16 on a Hopper GPU, got {q.dtype} on " \
           f"{jax.devices()[0].device_kind}"
  config = configs.get_config(_padded_head_dim(q), q.dtype, interpret=False)
  if config.mosaic_fwd is None or config.mosaic_bwd is None:
    return f"no Mosaic GPU tiles are tuned for head size {q.shape[-1]} ({q.dtype})"
  unsupported = dict(segments=call["q_ids"] is not None,
                     mods=call["mask_mod"] is not None or call["score_mod"] is not None)
  sizes = (q.dtype, _padded_head_dim(q), *ring.block_lengths(call))
  if not (mosaic.takes(*sizes, config.mosaic_fwd, **unsupported)
          and mosaic_backward.takes(*sizes, config.mosaic_bwd, **unsupported)):
    return ("the Mosaic GPU kernels take no `segment_ids`, `mask_mod` or `score_mod`, and "
            f"at least {max(config.mosaic_fwd.rows_per_block, config.mosaic_bwd.block_q)} "
            f"queries and {max(config.mosaic_fwd.block_k, config.mosaic_bwd.keys_per_block)} "
            "keys{}, got T={}, S={}".format(
                " per ring block" if ring.splits_sequence(q, k) else "", *ring.block_lengths(call)))
  return None


IMPLEMENTATIONS = registry.Registry(_OP, table=None)
IMPLEMENTATIONS.register("xla", _xla)
IMPLEMENTATIONS.register("pallas", _kernels(), supports=_kernel_supports, kernel=True,
                         config=configs.FlexConfig)
IMPLEMENTATIONS.register("triton", _kernels(_all_triton), supports=_kernel_supports,
                         kernel=True, config=configs.FlexConfig)
IMPLEMENTATIONS.register("mosaic", _kernels(_all_mosaic), supports=_mosaic_supports,
                         kernel=True, config=configs.FlexConfig)
