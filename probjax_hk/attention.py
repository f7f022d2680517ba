"""Attention: the dispatching `dot_product_attention` and `MultiHeadAttention`.

Glossary of shapes: B batch, T query tokens, S key/value tokens, N query
heads, K key/value heads (N % K == 0: GQA/MQA), H head size, D model width.

`dot_product_attention` takes every argument of `jax.nn.dot_product_attention`
(JAX 0.11.2) with the same meaning: rank-4 `[B, T, N, H]` or rank-3 `[T, N, H]`
inputs (so it runs under `jax.vmap` over the batch), `bias` and `mask`
broadcastable to `[B, N, T, S]`, query and key lengths, windows, GQA and
`return_residual`; it adds `implementation='flex'`. Which kernel runs is
decided in one place, `choose_attention_implementation`; the choices and the
rule for `implementation=None` are listed under `dot_product_attention`'s
`implementation` argument.

Decoding attends to a cache with per-sequence lengths: one new token per
sequence through the model's `attention_fn` (non-causal, the cache's valid
slots as `key_value_seq_lengths`, which the decode kernel takes),
several new tokens or a window through `cached_attention`
(`MultiHeadAttention.prefill` fills the cache from a prompt,
`MultiHeadAttention.decode` extends it).
"""

import functools
from typing import Callable, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ops import registry
from ops.decode_attention import api as decode_api
from ops.flex_attention import api as flex_api
from ops.flex_attention import ring
from probjax_hk import arguments
from probjax_hk import layers

# None, a name of `IMPLEMENTATIONS` or a sequence of them tried in order.
AttentionImplementation = registry.Choice


def _normalize_window(local_window_size):
  if local_window_size is None or isinstance(local_window_size, tuple):
    return local_window_size
  return (local_window_size, local_window_size)


def _cudnn_limit(query, key, bias, window, is_causal) -> str | None:
  """None when cuDNN's fused attention takes these inputs (`window` as
  `_call` normalized it), else why not."""
  if not registry.on_nvidia_gpu():
    return f"cuDNN attention needs an NVIDIA GPU; the default backend is {jax.default_backend()!r}"
  split = ring.splits_sequence(query, key)
  if split is not None:
    return (f"cuDNN attention cannot split the sequence axis of `{split}` (axis 1, split "
            "over mesh axes); 'xla' and the flex kernels run ring attention")
  if query.dtype not in (jnp.bfloat16, jnp.float16):
    return f"cuDNN attention takes float16 or bfloat16 inputs, got query.dtype={query.dtype}"
  head_dim = query.shape[-1]
  if head_dim % 8 or head_dim > 128:
    return f"cuDNN attention needs a head size that is a multiple of 8 up to 128, got {head_dim=}"
  if window is not None and window[1] != 0 and not is_causal:
    return f"cuDNN attention cannot look right of the query, got local_window_size={window}"
  if bias is not None and bias.dtype != query.dtype:
    return f"cuDNN attention needs bias.dtype == query.dtype, got {bias.dtype} and {query.dtype}"
  return None


def _flex_limit(query, bias, mask, query_seq_lengths, scale=None,
                return_residual=False) -> str | None:
  """None when the Pallas flex kernel takes these inputs, else why not."""
  if return_residual:
    return "the flex kernel does not return the log-sum-exp (`return_residual=True`)"
  if isinstance(scale, jax.core.Tracer):
    return "the flex kernel needs a static `scale` (a Python or NumPy number)"
  if bias is not None or mask is not None:
    return "the flex kernel takes no dense `bias` or `mask` array (use is_causal, " \
           "local_window_size, key_value_seq_lengths, or ops.flex_attention's segment_ids)"
  if query_seq_lengths is not None:
    return "the flex kernel takes no `query_seq_lengths`"
  if query.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    return f"the flex kernel takes float32, bfloat16 or float16, got query.dtype={query.dtype}"
  return flex_api.kernel_limit(query)


def _decode_limit(query, key, bias, mask, is_causal, local_window_size,
                  query_seq_lengths, key_value_seq_lengths, scale,
                  return_residual) -> str | None:
  """None when `ops.decode_attention` computes this call exactly, else why not.

  Its query t sees the keys up to position lengths - T + t; for T = 1 and
  no causal mask or window that is every valid key, as here.
  """
  if query.shape[1] != 1:
    return f"the decode kernel takes one query per sequence here, got T={query.shape[1]}"
  if is_causal or local_window_size is not None:
    return "the decode kernel takes no causal mask or window here"
  if bias is not None or mask is not None or query_seq_lengths is not None:
    return "the decode kernel takes no `bias`, `mask` or `query_seq_lengths`"
  if return_residual:
    return "the decode kernel does not return the log-sum-exp (`return_residual=True`)"
  if isinstance(scale, jax.core.Tracer):
    return "the decode kernel needs a static `scale`"
  lengths = key_value_seq_lengths
  concrete = lengths is not None and not isinstance(lengths, jax.core.Tracer)
  if concrete and np.asarray(lengths).min() < 1:
    return "the decode kernel takes key_value_seq_lengths >= 1 (a concrete 0 was given)"
  if query.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16) or key.dtype != query.dtype:
    return "the decode kernel takes float32, bfloat16 or float16 with key.dtype == query.dtype"
  return decode_api.kernel_limit(query, key)


def choose_attention_implementation(
    query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None = None,
    mask: jax.Array | None = None, *, is_causal: bool = False,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: AttentionImplementation = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None, scale=None,
    return_residual: bool = False) -> str:
  """The implementation `dot_product_attention` runs for these arguments.

  The one dispatch rule (table in BUILD_NOTES.md, "## flex_attention"):
  explicit choices are honoured or raise; `None` on a CPU (or any non-NVIDIA
  backend) is 'xla'; on an NVIDIA GPU it is 'decode' (`ops.decode_attention`'s
  split-K kernel) for a single non-causal query per sequence with no bias,
  mask, window or query lengths when the kernel takes it and this device
  kind's table (`ops/dispatch_tables/decode_attention.json`) has it checked
  and fastest; else the fastest of 'flex', 'cudnn' and 'xla' that take the
  inputs, as measured at the grid point that judges the call
  (`ops/dispatch_tables/attention.json`; variant from `grid_variant`; flex
  only where checked on this device kind), and where nothing decides cuDNN
  if it takes the inputs, else XLA.

  Args:
    query: [B, T, N, H] or [T, N, H].
    key, value: [B, S, K, H] or [S, K, H].
    bias: optional, broadcastable to [B, N, T, S].
    mask: optional boolean, broadcastable to [B, N, T, S].
    is_causal, scale, local_window_size, return_residual: as for
      `dot_product_attention`.
    query_seq_lengths, key_value_seq_lengths: likewise.
    implementation: None, a name of `IMPLEMENTATIONS` ('xla', 'cudnn', 'flex',
      'triton', 'mosaic', 'decode'; 'pallas' for 'flex') or a sequence of them.

  Returns:
    The name of the implementation that runs. Raises a
    ValueError when an explicit `implementation` cannot take the inputs (with
    the reason); never raises for `None`.
  """
  query, key, value = _with_batch_axis(query=query, key=key, value=value)
  arguments.check_bools(is_causal=is_causal, return_residual=return_residual)
  arguments.check_finite_numbers_or_none(scale=scale)
  call = _call(query, key, value, bias, mask, is_causal=is_causal,
               local_window_size=local_window_size,
               query_seq_lengths=query_seq_lengths,
               key_value_seq_lengths=key_value_seq_lengths, scale=scale,
               return_residual=return_residual)
  return _choose(implementation, call).name


def _call(query, key, value, bias, mask, *, is_causal, local_window_size, query_seq_lengths,
          key_value_seq_lengths, scale, return_residual) -> dict:
  """The validated arguments as every implementation's `run` and `supports` take them."""
  return dict(query=query, key=key, value=value, bias=bias, mask=mask, is_causal=is_causal,
              local_window_size=_normalize_window(local_window_size),
              query_seq_lengths=query_seq_lengths,
              key_value_seq_lengths=key_value_seq_lengths, scale=scale,
              return_residual=return_residual)


def _choose(implementation, call) -> registry.Implementation:
  """`IMPLEMENTATIONS`' choice, judged at the shape grid's point for the call."""
  query, key = call["query"], call["key"]
  dtype = "float32" if query.dtype == jnp.float32 else "bfloat16"  # f16 runs as bf16 does
  return IMPLEMENTATIONS.choose(
      implementation, call, dtype=dtype,
      variant=grid_variant(query, key, call["is_causal"], call["local_window_size"]),
      head_dim=query.shape[-1], length=key.shape[1])


def grid_variant(query, key, is_causal, local_window_size) -> str:
  """The shape grid's attention variant a call belongs to: 'sliding_window',
  'cross' (T != S), 'gqa' (K < N), 'causal' or 'full'."""
  if local_window_size is not None:
    return "sliding_window"
  if query.shape[1] != key.shape[1]:
    return "cross"
  if key.shape[2] < query.shape[2]:
    return "gqa"
  return "causal" if is_causal else "full"


def _with_batch_axis(**arrays) -> list:
  """Each array [B, T, N, H], or [T, N, H] given a leading B = 1 (jax.nn's
  rank-3 form: one sequence, as `jax.vmap` over the batch hands it)."""
  batched = []
  for name, x in arrays.items():
    if np.ndim(x) not in (3, 4):
      raise ValueError(f"`{name}` must be [B, T, N, H] or [T, N, H] (keys and values "
                       f"[B, S, K, H] or [S, K, H]), got shape {np.shape(x)}")
    batched.append(x if np.ndim(x) == 4 else x[None])
  return batched


def _check_shapes(query, key, value, key_name="key", value_name="value"):
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError(f"`query`, `{key_name}` and `{value_name}` must be [B, T, N, H], "
                     f"[B, S, K, H], [B, S, K, H]; got shapes {query.shape}, {key.shape}, "
                     f"{value.shape}")
  if key.shape != value.shape:
    raise ValueError(f"`{key_name}` and `{value_name}` must have the same shape, got "
                     f"{key.shape} and {value.shape}")
  if query.shape[0] != key.shape[0] or query.shape[-1] != key.shape[-1]:
    raise ValueError(f"`query` {query.shape} and `{key_name}` {key.shape} must agree on "
                     "batch and head size")
  if query.shape[2] % key.shape[2]:
    raise ValueError(f"the query heads ({query.shape[2]}) must be a multiple of the "
                     f"key/value heads ({key.shape[2]})")


def check_window(local_window_size) -> None:
  """`local_window_size` must be None, an int >= 0 or a pair of them (a
  ValueError naming it otherwise)."""
  window = _normalize_window(local_window_size)
  is_size = lambda w: isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= 0
  if window is not None and (len(window) != 2 or not all(is_size(w) for w in window)):
    raise ValueError("`local_window_size` must be None, an int >= 0 or a pair (left, right) "
                     f"of ints >= 0, got {local_window_size=}")



# The dot algorithm jax.nn's XLA path asks for with 16-bit inputs.
_DOT_ALGORITHMS = {jnp.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
                   jnp.dtype(jnp.float16): jax.lax.DotAlgorithmPreset.F16_F16_F32}


@functools.cache
def _xla_compiles_dot_algorithm(dtype: np.dtype) -> bool:
  """Whether XLA on the default backend compiles `_DOT_ALGORITHMS[dtype]`.

  jax.nn's XLA path falls back to the default precision when an eager dot
  raises, but under `jax.jit` the error comes at lowering (float16 on a CPU,
  JAX 0.11.2), so it is checked once on a 2 x 2 dot.
  """
  algorithm = _DOT_ALGORITHMS.get(dtype)
  if algorithm is None:
    return True
  x = jax.ShapeDtypeStruct((2, 2), dtype)
  dot = lambda a, b: jnp.einsum("ij,jk->ik", a, b, precision=algorithm,
                                preferred_element_type=jnp.float32)
  try:
    jax.jit(dot).lower(x, x).compile()
  except (ValueError, jax.errors.JaxRuntimeError):
    return False
  return True


def _unit_splits_dropped(x):
  """`x` with the Explicit mesh axes of size 1 taken out of its type (a free
  reshard): jax.nn's XLA path (JAX 0.11) mis-types a batch of 1 split over a
  size-1 axis and fails its own einsum."""
  sharding = getattr(jax.typeof(x), "sharding", None) if x is not None else None
  if sharding is None or sharding.mesh.empty or not any(sharding.spec):
    return x
  sizes = dict(sharding.mesh.shape)
  keep = lambda e: tuple(a for a in (e if isinstance(e, tuple) else (e,)) if sizes[a] > 1) or None
  spec = P(*(keep(e) if isinstance(e, (str, tuple)) else e for e in sharding.spec))
  return x if spec == sharding.spec else jax.sharding.reshard(x, spec)


def _jax_nn_attention(query, key, value, bias, mask, *, implementation, **options):
  """`jax.nn.dot_product_attention` on rank-4 inputs; 'xla' runs in float32
  (cast back to the inputs' dtype) where XLA cannot compile its 16-bit dot."""
  spec = jax.typeof(query).sharding.spec
  dropped = _unit_splits_dropped(query) is not query
  query, key, value, bias, mask = map(_unit_splits_dropped, (query, key, value, bias, mask))
  dtype = query.dtype
  # Mixed dtypes are left to jax.nn, which refuses them.
  upcast = (implementation == "xla" and query.dtype == key.dtype == value.dtype
            and not _xla_compiles_dot_algorithm(jnp.dtype(dtype)))
  if upcast:
    query, key, value = (x.astype(jnp.float32) for x in (query, key, value))
  out = jax.nn.dot_product_attention(query, key, value, bias, mask,
                                     implementation=implementation, **options)
  if upcast:
    out = jax.tree.map(lambda x: x.astype(dtype), out)
  if dropped:  # typed as the caller's query again
    if isinstance(out, tuple):
      return (jax.sharding.reshard(out[0], spec), *out[1:])
    return jax.sharding.reshard(out, spec)
  return out


def dot_product_attention(
    query: jax.Array, key: jax.Array, value: jax.Array,
    bias: jax.Array | None = None, mask: jax.Array | None = None, *,
    scale: float | None = None, is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: AttentionImplementation = None,
    return_residual: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Scaled dot-product attention, `jax.nn.dot_product_attention`'s contract.

  Rank-3 inputs are one sequence (B = 1 below, and the outputs drop it), as
  `jax.vmap` over the batch hands them.

  Args:
    query: [B, T, N, H] or [T, N, H].
    key, value: [B, S, K, H] or [S, K, H], N a multiple of K (GQA/MQA without
      repeating K/V).
    bias: optional, broadcastable to [B, N, T, S] (rank <= 4), added to the
      scaled logits.
    mask: optional boolean, broadcastable to [B, N, T, S] (rank <= 4); False
      masks out.
    scale: logit scale, default `H ** -0.5`.
    is_causal: query t attends to keys s <= t.
    query_seq_lengths: optional [B] ints; query rows t >= length return zeros.
    key_value_seq_lengths: optional [B] ints: keys s >= length are padding.
    local_window_size: `w` or `(left, right)`: t attends to s in [t-left, t+right].
    implementation: which kernel runs (`choose_attention_implementation`
      applies the rule):

      - `'xla'`: `jax.nn.dot_product_attention(implementation='xla')`, everywhere;
        float16 inputs compute in float32 where XLA cannot compile the float16 dot
        jax.nn asks for (a CPU under `jax.jit`), and return float16.
      - `'cudnn'`: cuDNN's fused attention; needs an NVIDIA GPU and f16/bf16 inputs
        with H a multiple of 8 up to 128, and a window that does not look right.
      - `'flex'`: this library's Pallas flash kernel (`ops.flex_attention`); takes
        f32/bf16/f16, H <= 256, causal, any window, GQA and key lengths, but no
        dense `bias`/`mask` array, no `query_seq_lengths` and no `return_residual`.
        Compiled on NVIDIA GPUs, Pallas interpret mode elsewhere (slow; for tests).
        A query row that sees no key returns zeros (jax.nn's XLA path returns the
        mean of v there).
      - `'triton'`, `'mosaic'`: the flex kernel with every launch on one lowering
        (`ops.flex_attention`'s names; 'mosaic' takes 16-bit inputs on a Hopper
        GPU). `'pallas'` is an alias of 'flex'.
      - `'decode'`: the split-K decode kernel (`ops.decode_attention`) for one query
        per sequence (T = 1, not causal, no bias, mask, window or residual: a
        decoding step against a cache).
      - a sequence of these names: the first that takes the inputs
        (`ops.registry`), e.g. `('flex', 'xla')`.
      - `None`: the fastest implementation that takes the inputs on this platform,
        never an error for a valid input, and this library's kernels only where
        measured: on an NVIDIA GPU whose device kind has, in the committed dispatch
        tables (`ops/dispatch_tables/`), a passing check of the kernel and a measurement
        showing it faster. Then 'decode' for a decoding step where
        `ops/dispatch_tables/decode_attention.json` has it beating cuDNN and XLA;
        else, of 'flex', 'cudnn' and 'xla', those that take the inputs, the one
        measured fastest (fwd+bwd) at the point of the shape grid that judges the
        call (`ops/dispatch_tables/attention.json`: dtype, variant, head size, key
        length). Where nothing decides, cuDNN if it takes the inputs, else XLA;
        always XLA on a CPU.
    return_residual: also return the log-sum-exp of each query's masked
      logits (FlashAttention-2's residual), as jax.nn does: [B, T, N] in the
      key's dtype, no gradient through it.

  Returns:
    [B, T, N, H] (the query's shape) in the query's dtype; with
    `return_residual`, the pair (output, residual [B, T, N] or [T, N]).

  Raises:
    ValueError: naming the argument, for shapes that do not fit together,
      a `bias` or `mask` that does not broadcast to [B, N, T, S], a `mask`
      that is not boolean, lengths that are not [B] integers, a bad window,
      or an explicit `implementation` that cannot take the inputs.
  """
  unbatched = np.ndim(query) == 3
  query, key, value = _with_batch_axis(query=query, key=key, value=value)
  _check_shapes(query, key, value)
  arguments.check_bools(is_causal=is_causal, return_residual=return_residual)
  arguments.check_finite_numbers_or_none(scale=scale)
  batch, seq_q, num_heads = query.shape[:3]
  bias, mask = (None if x is None else jnp.asarray(x) for x in (bias, mask))
  for name, x in (("bias", bias), ("mask", mask)):
    _check_logits_operand(name, x, (batch, num_heads, seq_q, key.shape[1]))  # [B, N, T, S]
  if mask is not None and mask.dtype != jnp.bool_:
    raise ValueError(f"`mask` must be boolean (True attends), got {mask.dtype}")
  if query_seq_lengths is not None:
    query_seq_lengths = layers.check_lengths(query_seq_lengths, batch, "query_seq_lengths")
  if key_value_seq_lengths is not None:
    key_value_seq_lengths = layers.check_lengths(key_value_seq_lengths, batch,
                                                 "key_value_seq_lengths")
  check_window(local_window_size)
  call = _call(query, key, value, bias, mask, is_causal=is_causal,
               local_window_size=local_window_size, query_seq_lengths=query_seq_lengths,
               key_value_seq_lengths=key_value_seq_lengths, scale=scale,
               return_residual=return_residual)
  out = _choose(implementation, call).run(**call)
  return jax.tree.map(lambda x: x[0], out) if unbatched else out


def _run_jax_nn(implementation):
  def run(query, key, value, bias, mask, **options):
    if ring.splits_sequence(query, key):  # `_xla_supports` admitted it: no bias or mask.
      return _run_flex("xla")(query, key, value, bias, mask, **options)
    return _jax_nn_attention(query, key, value, bias, mask, implementation=implementation,
                             **options)
  return run


def _xla_supports(call):
  """'xla' takes every call but one whose sequence is split over Explicit
  mesh axes, which runs as ring attention (`ops.flex_attention`)."""
  split = ring.splits_sequence(call["query"], call["key"])
  if split is None:
    return None
  limit = _flex_limit(call["query"], call["bias"], call["mask"], call["query_seq_lengths"],
                      call["scale"], call["return_residual"])
  return limit and (f"with the sequence axis of `{split}` split over mesh axes, "
                    f"'xla' runs ring attention (ops.flex_attention), and {limit}")


def _run_flex(implementation):
  def run(query, key, value, bias, mask, *, is_causal, scale, local_window_size,
          key_value_seq_lengths, **_):
    del bias, mask  # None: `_flex_limit`.
    return flex_api.flex_attention(
        query, key, value, is_causal=bool(is_causal),
        scale=None if scale is None else float(scale), local_window_size=local_window_size,
        key_value_seq_lengths=key_value_seq_lengths, implementation=implementation)
  return run


def _run_decode(query, key, value, bias, mask, *, scale, key_value_seq_lengths, **_):
  del bias, mask  # None: `_decode_limit`.
  batch, seq_kv = key.shape[:2]
  lengths = (jnp.full((batch,), seq_kv, jnp.int32) if key_value_seq_lengths is None
             else jnp.clip(key_value_seq_lengths, 0, seq_kv))
  return decode_api.decode_attention(query, key, value, lengths,
                                     scale=None if scale is None else float(scale),
                                     implementation="pallas")


def _flex_supports(lowering):
  def supports(call):
    limit = _flex_limit(call["query"], call["bias"], call["mask"], call["query_seq_lengths"],
                        call["scale"], call["return_residual"])
    return limit or flex_api.IMPLEMENTATIONS[lowering].supports(dict(
        q=call["query"], k=call["key"], v=call["value"], is_causal=call["is_causal"],
        window=call["local_window_size"], q_ids=None, kv_ids=None,
        key_value_seq_lengths=call["key_value_seq_lengths"], mask_mod=None, score_mod=None))
  return supports


def _cudnn_supports(call):
  return _cudnn_limit(call["query"], call["key"], call["bias"], call["local_window_size"],
                      call["is_causal"])


def _decode_supports(call):
  return _decode_limit(call["query"], call["key"], call["bias"], call["mask"], call["is_causal"],
                       call["local_window_size"], call["query_seq_lengths"],
                       call["key_value_seq_lengths"], call["scale"], call["return_residual"])


# The rule (`dot_product_attention`'s docstring): the measured fastest on
# NVIDIA GPUs (ops/dispatch_tables/attention.json; decode_attention.json for
# 'decode', which times the decode kernel as 'pallas'), else cuDNN where it
# takes the call, else XLA.
IMPLEMENTATIONS = registry.Registry("dot_product_attention", table="attention",
                                    established=("cudnn", "xla"))
IMPLEMENTATIONS.register("xla", _run_jax_nn("xla"), supports=_xla_supports)
IMPLEMENTATIONS.register("cudnn", _run_jax_nn("cudnn"), supports=_cudnn_supports)
IMPLEMENTATIONS.register("flex", _run_flex("pallas"), supports=_flex_supports("pallas"),
                         kernel=True)
IMPLEMENTATIONS.register("triton", _run_flex("triton"), supports=_flex_supports("triton"),
                         kernel=True)
IMPLEMENTATIONS.register("mosaic", _run_flex("mosaic"), supports=_flex_supports("mosaic"),
                         kernel=True)
IMPLEMENTATIONS.register("decode", _run_decode, supports=_decode_supports, kernel=True,
                         table="decode_attention", measured_as="pallas")
IMPLEMENTATIONS.alias("pallas", ("flex",))


class KVCache(NamedTuple):
  """One attention layer's key/value cache for decoding.

  Slot s of sequence b holds the key and value of its token at position s;
  how many slots are valid is kept by the model (`lengths`), not here.

  Attributes:
    key: [B, S, K, H] keys (after the rotary embedding and QK norm).
    value: [B, S, K, H] values.
  """
  key: jax.Array
  value: jax.Array


def cached_attention(query: jax.Array, key_cache: jax.Array, value_cache: jax.Array,
                     lengths: jax.Array, *, scale: float | None = None,
                     local_window_size: int | tuple[int, int] | None = None,
                     implementation: registry.Choice = None) -> jax.Array:
  """Attention of T new tokens per sequence to a key/value cache.

  The decoding counterpart of causal `dot_product_attention`: query t of
  sequence b sits at position p = lengths[b] - T + t (the new tokens are the
  last T valid slots of the cache) and attends to slots s <= p, and
  s >= p - left with a window. Slots s >= lengths[b] are never attended to.
  `ops.decode_attention` computes it: its split-K kernel on NVIDIA GPUs, XLA
  elsewhere.

  Args:
    query: [B, T, N, H] queries of the new tokens.
    key_cache: [B, S, K, H], the new tokens' keys included; N a multiple of
      K (GQA without repeating K/V).
    value_cache: [B, S, K, H].
    lengths: [B] ints in [T, S], the valid slots per sequence.
    scale: logit scale, default `H ** -0.5`.
    local_window_size: `left` or `(left, right)`: position p sees slots
      s >= p - left (`right` changes nothing: slots right of p are masked).
    implementation: as for `ops.decode_attention`: None (the kernel on NVIDIA
      GPUs when it takes the inputs), 'pallas' or 'xla'.

  Returns:
    [B, T, N, H] in the query's dtype (softmax in float32).

  Raises:
    ValueError: for shapes that do not fit together, T > S, `lengths` that is
      not [B] integers, or a bad window.
  """
  _check_shapes(query, key_cache, value_cache, "key_cache", "value_cache")
  check_window(local_window_size)
  arguments.check_finite_numbers_or_none(scale=scale)
  batch, time = query.shape[:2]
  slots = key_cache.shape[1]
  if time > slots:
    raise ValueError(f"`query` has T={time} new tokens, more than the S={slots} slots "
                     "of `key_cache`")
  return decode_api.decode_attention(
      query, key_cache, value_cache, layers.check_lengths(lengths, batch),
      scale=None if scale is None else float(scale),
      local_window_size=_normalize_window(local_window_size), implementation=implementation)


AttentionFn = Callable[..., jax.Array]


def _check_logits_operand(name, x, logits_shape):
  """`x` (a bias or a mask) must broadcast to the logits' [B, N, T, S]."""
  if x is None:
    return
  shape = getattr(x, "shape", None)
  try:
    fits = shape is not None and len(shape) <= 4 and (
        np.broadcast_shapes(shape, logits_shape) == logits_shape)
  except ValueError:
    fits = False
  if not fits:
    raise ValueError(f"`{name}` must be broadcastable to [B, N, T, S] = {logits_shape}, "
                     f"got shape {shape}")


def _check_head_split(parameter: str, heads: int, y: jax.Array) -> None:
  """A projection's output [B, T, heads * H] split over Explicit mesh axes
  (tensor parallelism: the weight's columns split) must split whole heads,
  so that attention runs per head shard; a ValueError naming `parameter`
  otherwise."""
  axes, devices = layers.last_axis_split(y)
  if heads % devices:
    kind = "query heads N" if parameter.endswith("query/w") else "key/value heads K"
    raise ValueError(
        f"parameter '{parameter}' splits its columns over mesh axes {axes} ({devices}"
        f" devices), but its {kind}={heads} do not divide among them: tensor parallelism"
        f" splits whole heads; use a multiple of {devices} heads, or fewer devices on"
        f" {axes}")


class MultiHeadAttention(hk.Module):
  """Multi-head (or grouped-query) attention with projections.

  Optional rotary position embedding on queries and keys, and optional QK norm
  (RMSNorm over each head before the dot product, for stable training).
  Causal self-attention also decodes: `prefill` runs a prompt and returns a
  `KVCache`, `decode` extends it by a few tokens per sequence.
  """

  def __init__(self, num_heads: int, *, num_kv_heads: int | None = None,
               head_dim: int | None = None, use_rope: bool = False,
               rope_base: float = 10_000.0, qk_norm: bool = False,
               attention_fn: AttentionFn = dot_product_attention,
               with_bias: bool = False, name: str | None = None):
    """Constructs the module.

    Args:
      num_heads: N, the query heads.
      num_kv_heads: K, the key/value heads (GQA; 1 is MQA); must divide N.
        Default N.
      head_dim: H; default `D // num_heads` for inputs of width D.
      use_rope: rotary position embedding on queries (positions 0..T-1) and
        keys (0..S-1); in `decode`, the new tokens' positions after the cache.
      rope_base: the rotary embedding's base wavelength.
      qk_norm: RMSNorm over each head of the queries and keys before the dot
        product.
      attention_fn: `fn(q [B, T, N, H], k [B, S, K, H], v [B, S, K, H], *,
        is_causal, key_value_seq_lengths) -> [B, T, N, H]`, also given `bias`,
        `mask` and `local_window_size` when the call has them; default
        `dot_product_attention`. (`decode` calls it for one new token per
        sequence, else `cached_attention`.)
      with_bias: biases in the four projections.
      name: module name.

    Raises:
      TypeError: a size that is not an integer, a flag that is not a bool,
        a `rope_base` that is not a number or an `attention_fn` that is not
        callable.
      ValueError: a size below 1, `num_kv_heads` that does not divide
        `num_heads`, or a `rope_base` that is not positive.
    """
    arguments.check_name(name)
    super().__init__(name=name)
    arguments.check_positive_ints(num_heads=num_heads)
    arguments.check_positive_ints_or_none(num_kv_heads=num_kv_heads, head_dim=head_dim)
    arguments.check_bools(use_rope=use_rope, qk_norm=qk_norm, with_bias=with_bias)
    arguments.check_positive_numbers(rope_base=rope_base)
    arguments.check_callables(attention_fn=attention_fn)
    num_kv_heads = num_kv_heads or num_heads
    if num_heads % num_kv_heads:
      raise ValueError(f"`num_kv_heads` must divide `num_heads`, got {num_heads=} {num_kv_heads=}")
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim
    self.use_rope = use_rope
    self.rope_base = rope_base
    self.qk_norm = qk_norm
    self.attention_fn = attention_fn
    self.with_bias = with_bias

  def __call__(self, x: jax.Array, context: jax.Array | None = None, *,
               bias: jax.Array | None = None, mask: jax.Array | None = None,
               is_causal: bool = False,
               key_value_seq_lengths: jax.Array | None = None,
               local_window_size: int | tuple[int, int] | None = None) -> jax.Array:
    """Self-attention over `x`, or cross-attention from `x` to `context`.

    Args:
      x: [B, T, D] queries' source.
      context: optional [B, S, D_c] keys' and values' source (default `x`).
      bias: optional, broadcastable to [B, N, T, S], added to the logits
        (`jax.nn.dot_product_attention`'s `bias`).
      mask: optional boolean, broadcastable to [B, N, T, S]; False masks out
        (`jax.nn.dot_product_attention`'s `mask`).
      is_causal: causal mask (self-attention).
      key_value_seq_lengths: optional [B] valid key/value lengths.
      local_window_size: optional `w` or `(left, right)`: query t attends to
        keys in [t - left, t + right] (passed to `attention_fn` when given).

    Returns:
      [B, T, D].

    Raises:
      ValueError: for `context`, `bias` or `mask` of the wrong shape, or a
        `mask` that is not boolean.
    """
    layers.check_tokens(x)
    if context is not None and (context.ndim != 3 or context.shape[0] != x.shape[0]
                                or 0 in context.shape):
      raise ValueError(f"`context` must be [B, S, D_c] with B={x.shape[0]} and S, D_c >= 1, "
                       f"got shape {context.shape}")
    logits_shape = (x.shape[0], self.num_heads, x.shape[1],
                    (x if context is None else context).shape[1])  # [B, N, T, S]
    _check_logits_operand("bias", bias, logits_shape)
    _check_logits_operand("mask", mask, logits_shape)
    if mask is not None and mask.dtype != jnp.bool_:
      raise ValueError(f"`mask` must be boolean (True attends), got {mask.dtype}")
    check_window(local_window_size)
    context = x if context is None else context
    q, k, v = self._project(x, context, jnp.arange(x.shape[1]), jnp.arange(context.shape[1]))
    # bias, mask and the window only when given: an attention_fn need not take them.
    options = {n: a for n, a in (("bias", bias), ("mask", mask),
                                 ("local_window_size", local_window_size)) if a is not None}
    out = self.attention_fn(q, k, v, is_causal=is_causal,
                            key_value_seq_lengths=key_value_seq_lengths, **options)
    return self._output(out, x.shape[-1])

  def initial_cache(self, batch_size: int, max_length: int, model_dim: int,
                    dtype=jnp.float32) -> KVCache:
    """An empty cache for `decode`.

    Args:
      batch_size: B, the number of sequences.
      max_length: S, the most tokens the cache holds (prompt and generated).
      model_dim: D, the width of the inputs (sets H when `head_dim` is None).
      dtype: the dtype the model computes in (its inputs' dtype).

    Returns:
      A `KVCache` of zeros, key and value [B, S, K, H] in `dtype`.
    """
    arguments.check_positive_ints(batch_size=batch_size, max_length=max_length,
                                  model_dim=model_dim)
    shape = (batch_size, max_length, self.num_kv_heads, self._head_dim(model_dim))
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  @hk.name_like("__call__")
  def prefill(self, x: jax.Array, max_length: int, *,
              local_window_size: int | tuple[int, int] | None = None
              ) -> tuple[jax.Array, KVCache]:
    """Causal self-attention over a prompt, and the cache decoding continues from.

    The output is `__call__(x, is_causal=True, local_window_size=...)` (the
    same `attention_fn`); the prompt's keys and values fill the cache's
    first T slots.

    Args:
      x: [B, T, D], the first T tokens of each sequence.
      max_length: S >= T, the cache size.
      local_window_size: as for `__call__`.

    Returns:
      (y [B, T, D], a `KVCache` of [B, S, K, H] in x's dtype).

    Raises:
      ValueError: for x that is not [B, T, D], `max_length` < T, or a bad window.
    """
    layers.check_tokens(x)
    arguments.check_positive_ints(max_length=max_length)
    if max_length < x.shape[1]:
      raise ValueError(f"`max_length` must be >= the prompt's T={x.shape[1]}, got {max_length=}")
    positions = jnp.arange(x.shape[1])
    q, k, v = self._project(x, x, positions, positions)
    options = {} if local_window_size is None else {"local_window_size": local_window_size}
    out = self.attention_fn(q, k, v, is_causal=True, key_value_seq_lengths=None, **options)
    pad = ((0, 0), (0, max_length - x.shape[1]), (0, 0), (0, 0))
    return self._output(out, x.shape[-1]), KVCache(jnp.pad(k, pad), jnp.pad(v, pad))

  @hk.name_like("__call__")
  def decode(self, x: jax.Array, cache: KVCache, lengths: jax.Array, *,
             local_window_size: int | tuple[int, int] | None = None
             ) -> tuple[jax.Array, KVCache]:
    """Causal self-attention of T new tokens per sequence after a cache.

    Token t of sequence b sits at position lengths[b] + t: its key and value
    go to that slot and it attends to the slots up to its own: a single token
    (T = 1, no window) through `attention_fn` with the valid slots as
    `key_value_seq_lengths`, several tokens or a window through
    `cached_attention`. Tokens past the cache's last slot are not stored (the
    caller keeps lengths + T <= S).

    Args:
      x: [B, T, D], the new tokens.
      cache: a `KVCache` of [B, S, K, H] in x's dtype (`initial_cache`,
        `prefill` or a previous `decode`).
      lengths: [B] ints, the tokens already in the cache per sequence.
      local_window_size: as for `__call__`.

    Returns:
      (y [B, T, D], the cache with the new tokens' keys and values).

    Raises:
      ValueError: for a cache whose shape or dtype does not fit x, or
        `lengths` that is not [B] integers.
    """
    layers.check_tokens(x)
    batch, time, model_dim = x.shape
    head_dim = self._head_dim(model_dim)
    key, value = cache
    for name, a in (("cache.key", key), ("cache.value", value)):
      if (a.ndim != 4 or a.shape[0] != batch or a.shape[2:] != (self.num_kv_heads, head_dim)
          or a.dtype != x.dtype):
        raise ValueError(f"`{name}` must be [B, S, K, H] = [{batch}, S, {self.num_kv_heads}, "
                         f"{head_dim}] in x's dtype {x.dtype}, got {a.shape} {a.dtype}")
    layers.check_lengths(lengths, batch)
    positions = lengths[:, None] + jnp.arange(time)                   # [B, T]
    q, k, v = self._project(x, x, positions, positions)
    rows = jnp.arange(batch)[:, None]
    key = key.at[rows, positions].set(k, mode="drop")
    value = value.at[rows, positions].set(v, mode="drop")
    if time == 1 and local_window_size is None:
      # One token sees every valid slot: plain attention with key lengths,
      # which the model's attention_fn computes (dispatching to the decode
      # kernel on NVIDIA GPUs by default).
      out = self.attention_fn(q, key, value, is_causal=False,
                              key_value_seq_lengths=lengths + time)
    else:
      out = cached_attention(q, key, value, lengths + time, local_window_size=local_window_size)
    return self._output(out, model_dim), KVCache(key, value)

  def _head_dim(self, model_dim: int) -> int:
    if self.head_dim is None and model_dim % self.num_heads:
      raise ValueError(f"`num_heads` must divide the model width `x.shape[-1]` when "
                       f"`head_dim` is None, got num_heads={self.num_heads} {model_dim=}")
    return self.head_dim or model_dim // self.num_heads

  @hk.transparent
  def _project(self, x, context, query_positions, key_positions):
    """x [B, T, D], context [B, S, D_c] -> q [B, T, N, H], k and v [B, S, K, H]."""
    head_dim = self._head_dim(x.shape[-1])
    batch, seq_len = x.shape[:2]
    kv_len = context.shape[1]
    query, key, value = (
        layers.Linear(heads * head_dim, with_bias=self.with_bias, name=name)
        for heads, name in ((self.num_heads, "query"), (self.num_kv_heads, "key"),
                            (self.num_kv_heads, "value")))
    # One product per input and width: tensor parallelism then reduces one
    # gradient of each (the narrower key and value of grouped heads apart).
    if context is x and self.num_heads == self.num_kv_heads:
      q, k, v = layers.shared_input(x, [query, key, value])
    else:
      (q,), (k, v) = layers.shared_input(x, [query]), layers.shared_input(context, [key, value])
    for name, heads, y in (("query", self.num_heads, q), ("key", self.num_kv_heads, k),
                           ("value", self.num_kv_heads, v)):
      _check_head_split(f"{self.module_name}/{name}/w", heads, y)
    q = q.reshape(batch, seq_len, self.num_heads, head_dim)  # [B, T, N, H]
    k = k.reshape(batch, kv_len, self.num_kv_heads, head_dim)  # [B, S, K, H]
    v = v.reshape(batch, kv_len, self.num_kv_heads, head_dim)
    if self.qk_norm:
      q = layers.RMSNorm(name="query_norm")(q)
      k = layers.RMSNorm(name="key_norm")(k)
    if self.use_rope:
      q = layers.rotary_embedding(q, query_positions, base=self.rope_base)
      k = layers.rotary_embedding(k, key_positions, base=self.rope_base)
    return q, k, v

  @hk.transparent
  def _output(self, out, model_dim):
    """[B, T, N, H] -> [B, T, D]."""
    out = out.reshape(*out.shape[:2], -1)
    return layers.Linear(model_dim, with_bias=self.with_bias, name="output")(out)
