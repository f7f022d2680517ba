"""Inputs and functions the benchmark programs share.

The benchmark programs define absl flags at import, so they cannot import one
another; what more than one program times or checks lives here: the scan
inputs, the SSD / gated-delta-rule inputs and ops, the grouped-matmul inputs,
the MoE layer's cases and the attention inputs and implementations.
"""

import contextlib
import dataclasses
import functools
import json
from typing import NamedTuple
from unittest import mock
import warnings

import haiku as hk
import jax
import jax.numpy as jnp

from ops.flex_attention import api as flex_api
from ops.flex_attention import configs as flex_configs
from ops.flex_attention import pallas as flex_pallas
from ops.gated_delta_rule import gated_delta_rule
from ops.grouped_mlp import pallas as grouped_mlp_pallas
from ops.ssd import ssd
from probjax_hk import moe

# ---------------------------------------------------------------------------
# Selective scan and linear scan ([B, T, D], f32; the linear scan complex64).


def selective_inputs(batch, time, width, state, dtype=jnp.float32, seed=0):
  """u, delta, A, B, C of `ops.selective_scan` with Mamba-like ranges."""
  k = jax.random.split(jax.random.key(seed), 5)
  u = jax.random.normal(k[0], (batch, time, width), dtype)
  delta = jax.nn.softplus(jax.random.normal(k[1], (batch, time, width)) - 2.0).astype(dtype)
  A = -jnp.broadcast_to(jnp.arange(1, state + 1, dtype=jnp.float32), (width, state))
  A = A * jnp.exp(0.1 * jax.random.normal(k[2], (width, state)))
  B = jax.random.normal(k[3], (batch, time, state), dtype)
  C = jax.random.normal(k[4], (batch, time, state), dtype)
  return u, delta, A, B, C


def linear_inputs(batch, time, width, seed=0):
  """a (|a| in [0.9, 0.999]), b of `ops.linear_scan`, complex64 [B, T, D]."""
  k = jax.random.split(jax.random.key(seed), 4)
  r = jax.random.uniform(k[0], (batch, time, width), minval=0.9, maxval=0.999)
  theta = jax.random.uniform(k[1], (batch, time, width), maxval=0.3)
  a = (r * jnp.exp(1j * theta)).astype(jnp.complex64)
  b = (jax.random.normal(k[2], (batch, time, width))
       + 1j * jax.random.normal(k[3], (batch, time, width))).astype(jnp.complex64)
  return a, b


def scan_loss(fn):
  """A scalar of a scan's (y, final_state), real part, for fwd+bwd timings."""
  def loss(*args):
    y, final = fn(*args)
    return jnp.sum(jnp.real(y)) + jnp.sum(jnp.real(final))
  return loss


# ---------------------------------------------------------------------------
# SSD and the gated delta rule: (B, T, N, K, V) shapes of issue 5.

SSD_SHAPES = ((8, 4096, 4, 64, 64), (8, 4096, 16, 128, 128), (8, 16384, 4, 64, 64))


def ssd_inputs(batch, time, heads, key, value, dtype, seed=0, groups=None):
  """q, k (unit norm) [B, T, G, K], v [B, T, N, V], log_decay, beta [B, T, N]:
  G = `groups` query/key groups shared by N // G heads (default N)."""
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (batch, time, groups or heads, key), jnp.float32)
  k = jax.random.normal(ks[1], (batch, time, groups or heads, key), jnp.float32)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(ks[2], (batch, time, heads, value), jnp.float32)
  g = -jax.nn.softplus(jax.random.normal(ks[3], (batch, time, heads)) - 2.0)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (batch, time, heads)))
  return tuple(x.astype(dtype) for x in (q, k, v)) + (g, beta)


def chunked_op(op, implementation, chunk):
  """(q, k, v, log_decay, beta) -> (y, final_state) of 'ssd' or 'gated_delta_rule'."""
  if op == "ssd":
    return lambda q, k, v, g, beta: ssd(q, k, v, g, chunk_size=chunk,
                                        implementation=implementation)
  return lambda q, k, v, g, beta: gated_delta_rule(q, k, v, g, beta, chunk_size=chunk,
                                                   implementation=implementation)


def chunked_loss(fn):
  """A scalar of (y, final_state) for fwd+bwd timings."""
  def loss(*args):
    y, final = fn(*args)
    return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)
  return loss


# ---------------------------------------------------------------------------
# Grouped matmul and MoE: 8 experts, top-2, d_model 512, d_hidden 1024.

NUM_EXPERTS, TOP_K, D_MODEL, D_HIDDEN = 8, 2, 512, 1024


def balanced_sizes(rows: int, groups: int, key) -> jax.Array:
  """Random group sizes around rows / groups, summing to rows."""
  weights = jax.random.uniform(key, (groups,), minval=0.5, maxval=1.5)
  sizes = jnp.floor(weights / weights.sum() * rows).astype(jnp.int32)
  return sizes.at[-1].add(rows - sizes.sum())


def gmm_inputs(rows: int):
  """lhs [rows, D_MODEL], rhs [NUM_EXPERTS, D_MODEL, D_HIDDEN] (bf16), group sizes."""
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  lhs = jax.random.normal(k1, (rows, D_MODEL), jnp.bfloat16)
  rhs = (jax.random.normal(k2, (NUM_EXPERTS, D_MODEL, D_HIDDEN)) / 20).astype(jnp.bfloat16)
  return lhs, rhs, balanced_sizes(rows, NUM_EXPERTS, k3)


MOE_MODES = ("forward", "fwd+bwd")


def moe_layer(impl: str, layer):
  """MoELayer with `dropless_impl=impl` on `layer` (a `shape_grid.MoePoint`:
  experts, top_k, d_model, d_hidden), GELU, transformed with its state."""
  return hk.transform_with_state(lambda x: moe.MoELayer(
      layer.experts, layer.top_k, layer.d_hidden, activation="gelu", dropless_impl=impl)(x))


def moe_inputs(tokens: int, layer) -> tuple:
  """(params, state, x, cotangent) of a MoE layer case at `tokens`.

  x [tokens, d_model] bf16 and the cotangent (like x) are random; params (f32)
  and state come from a jitted init on x's first 8 rows: they do not depend on
  the token count, an init on all of x would run the dense path (and its
  memory peak) at every size, and an eager one compiles each of its ops apart.
  """
  x = jax.random.normal(jax.random.key(0), (tokens, layer.d_model), jnp.bfloat16)
  params, state = jax.jit(moe_layer("dense", layer).init)(jax.random.key(1), x[:8])
  cotangent = jax.random.normal(jax.random.key(5), x.shape, x.dtype)
  return params, state, x, cotangent


def moe_case(impl: str, mode: str, params, state, x, cotangent, layer) -> tuple:
  """(fn, args) of one MoE layer case for `harness.run_case`.

  'forward': (params, x) -> y [T, d_model]. 'fwd+bwd': (params, x, cotangent)
  -> the cotangents of (params, x), one `jax.vjp`.
  """
  if mode not in MOE_MODES:
    raise ValueError(f"mode must be one of {MOE_MODES}, got {mode!r}")
  model = moe_layer(impl, layer)
  if mode == "forward":
    return (lambda p, x: model.apply(p, state, None, x)[0]), (params, x)

  def fn(p, x, cot):
    return jax.vjp(lambda p, x: model.apply(p, state, None, x)[0], p, x)[1](cot)
  return fn, (params, x, cotangent)


class GroupedMlpKernels(NamedTuple):
  """Which of `ops.grouped_mlp`'s kernels run on Mosaic GPU (the others on Triton)."""
  fused: bool         # the fused kernels (a matmul with its activation, and its gradient)
  plain: bool         # the plain grouped matmuls (y = a @ w_out, the input gradient)
  weight_grads: bool  # the weight gradients


# The MoE layer's 'gmm' path with the grouped MLP's kernels chosen by hand.
GROUPED_MLP_VARIANTS = {
    "gmm_triton": GroupedMlpKernels(fused=False, plain=False, weight_grads=False),
    "gmm_triton_tgmm": GroupedMlpKernels(fused=False, plain=True, weight_grads=False),
    "gmm_mosaic": GroupedMlpKernels(fused=True, plain=True, weight_grads=True),
}


@contextlib.contextmanager
def grouped_mlp_kernels(variant: str):
  """Within this block (while a function is traced), `ops.grouped_mlp`'s Pallas
  path runs the kernels of `GROUPED_MLP_VARIANTS[variant]` instead of its
  defaults: the comparison rows of the MoE layer."""
  fused, plain, weight_grads = GROUPED_MLP_VARIANTS[variant]
  module = grouped_mlp_pallas
  defaults = module.mosaic_default, module.mosaic_plain_default, module.mosaic_tgmm_default
  module.mosaic_default = lambda dtype: fused
  module.mosaic_plain_default = lambda dtype: plain
  module.mosaic_tgmm_default = lambda dtype: weight_grads
  try:
    yield
  finally:
    module.mosaic_default, module.mosaic_plain_default, module.mosaic_tgmm_default = defaults


# ---------------------------------------------------------------------------
# Attention: q, k, v [B, T, N, H], bf16 (float16 for JAX's Mosaic GPU attention).
#
# Each implementation a benchmark times is a small frozen dataclass: its
# fields say what runs, `name` labels its JSON rows, and `fn(head_dim,
# causal)` gives `(q, k, v) -> out`.


def parse_config(cls, fields: dict | str):
  """A config dataclass from a dict of its fields or a JSON object of them,
  e.g. `parse_config(TritonConfig, '{"block_q": 64, ...}')`; a field the class
  lacks is a ValueError that lists the ones it has."""
  if isinstance(fields, str):
    fields = json.loads(fields)
  if not isinstance(fields, dict):
    raise ValueError(f"{cls.__name__}: expected a JSON object of its fields, got {fields!r}")
  names = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(fields) - set(names))
  if unknown:
    raise ValueError(f"{cls.__name__} has no field {unknown}; its fields: {names}")
  return cls(**fields)


def _fields(config) -> str:
  """The fields of a tile config that differ from its tuned values (the
  class built with none given), as `k=v, ...`."""
  tuned = type(config)()
  return ", ".join(f"{f.name}={getattr(config, f.name)!r}"
                   for f in dataclasses.fields(config)
                   if getattr(config, f.name) != getattr(tuned, f.name))


def _flex_on(config_changes: dict, causal: bool):
  """flex's kernel path on the table's config for the input with those
  fields replaced (`with_changes`)."""
  def fn(q, k, v):
    hp = max(16, 1 << (q.shape[-1] - 1).bit_length())
    config = with_changes(flex_configs.get_config(hp, q.dtype, interpret=False),
                          **config_changes)
    return flex_pallas.flex_attention_pallas(
        q, k, v, scale=q.shape[-1] ** -0.5, is_causal=causal, window=None,
        q_segment_ids=None, kv_segment_ids=None, key_value_seq_lengths=None,
        interpret=False, config=config)
  return fn


@contextlib.contextmanager
def flex_config_changes(**changes):
  """Within this block (while a call is traced), `ops.flex_attention`'s kernel
  path runs the table's config for each call with these fields replaced
  (`with_changes`): `mosaic_fwd=None, mosaic_bwd=None` keeps it on Triton."""
  table = flex_configs.get_config
  patched = lambda *a, **kw: with_changes(table(*a, **kw), **changes)
  with mock.patch.object(flex_configs, "get_config", patched):
    yield


def attention_inputs(b, t, s, n, kh, h, dtype, seed=1):
  """q [B, T, N, H], k and v [B, S, K, H] in `dtype`, and a float32 output
  cotangent [B, T, N, H]: standard normal."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), dtype)
  k = jax.random.normal(keys[1], (b, s, kh, h), dtype)
  v = jax.random.normal(keys[2], (b, s, kh, h), dtype)
  return q, k, v, jax.random.normal(keys[3], (b, t, n, h), jnp.float32)


def with_changes(config: flex_configs.FlexConfig, **changes) -> flex_configs.FlexConfig:
  """`config` with those fields replaced; a `mosaic_fwd` given here runs every
  call's forward (right-bounded ones too, whatever the table's
  `mosaic_fwd_bounded`), so that a timed tile set is the one that runs."""
  if "mosaic_fwd" in changes:
    config = config.forward_on(changes.pop("mosaic_fwd"))
  return dataclasses.replace(config, **changes)


class _Attention:
  """What every attention variant has: its input dtype and its function."""
  input_dtype = jnp.bfloat16

  @property
  def name(self) -> str:
    raise NotImplementedError

  def fn(self, head_dim: int, causal: bool):
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Flex(_Attention):
  """`ops.flex_attention` on its kernels with the table's config; `mod`: a
  score_mod ('alibi', a per-head linear bias) or a mask_mod ('documents',
  512-token documents), timed against plain flex on the same shapes."""
  mod: str | None = None

  def __post_init__(self):
    if self.mod not in (None, "alibi", "documents"):
      raise ValueError(f"`mod` must be None, 'alibi' or 'documents', got {self.mod!r}")

  @property
  def name(self) -> str:
    return "flex" if self.mod is None else f"flex_{self.mod}"

  def fn(self, head_dim, causal):
    del head_dim
    options = {}
    if self.mod == "alibi":
      def alibi(score, b, n, t, s):
        del b
        return score + jnp.exp2(-(n + 1).astype(jnp.float32)) * (s - t).astype(jnp.float32)
      options["score_mod"] = alibi
    elif self.mod == "documents":
      options["mask_mod"] = lambda b, n, t, s: (t // 512) == (s // 512)
    return functools.partial(flex_api.flex_attention, is_causal=causal,
                             implementation="pallas", **options)


@dataclasses.dataclass(frozen=True)
class FlexTritonForward(_Attention):
  """flex with every forward on the Triton kernel: the table's Triton tiles
  or `tiles`, the table's softmax or `fwd_softmax` (`FlexConfig`)."""
  tiles: flex_configs.TritonConfig | None = None
  fwd_softmax: str | None = None

  @property
  def name(self) -> str:
    name = "flex_triton"
    if self.tiles is not None:
      t = self.tiles
      name += f"_{t.block_q}x{t.block_k}x{t.num_warps}x{t.num_stages}"
    return name if self.fwd_softmax is None else f"{name}_{self.fwd_softmax}"

  def fn(self, head_dim, causal):
    changes = dict(mosaic_fwd=None)
    if self.tiles is not None:
      changes["fwd"] = self.tiles
    if self.fwd_softmax is not None:
      changes["fwd_softmax"] = self.fwd_softmax
    return _flex_on(changes, causal)


@dataclasses.dataclass(frozen=True)
class FlexForwardSoftmax(_Attention):
  """flex with the table's kernels and this `FlexConfig.fwd_softmax`."""
  fwd_softmax: str

  @property
  def name(self) -> str:
    return f"flex_{self.fwd_softmax}"

  def fn(self, head_dim, causal):
    return _flex_on(dict(fwd_softmax=self.fwd_softmax), causal)


@dataclasses.dataclass(frozen=True)
class FlexRefresh(_Attention):
  """flex with the table's kernels and this `FlexConfig.refresh`."""
  refresh: str

  @property
  def name(self) -> str:
    return f"flex_refresh_{self.refresh}"

  def fn(self, head_dim, causal):
    return _flex_on(dict(refresh=self.refresh), causal)


@dataclasses.dataclass(frozen=True)
class FlexMosaicForward(_Attention):
  """flex with every forward on the Mosaic GPU kernel's `tiles` (right-bounded
  calls and short ones too), with the table's softmax or `fwd_softmax`."""
  tiles: flex_configs.MosaicConfig
  fwd_softmax: str | None = None

  @property
  def name(self) -> str:
    name = f"flex_mosaic_fwd({_fields(self.tiles)})"
    return name if self.fwd_softmax is None else f"{name}_{self.fwd_softmax}"

  def fn(self, head_dim, causal):
    changes = dict(mosaic_fwd=self.tiles)
    if self.fwd_softmax is not None:
      changes["fwd_softmax"] = self.fwd_softmax
    return _flex_on(changes, causal)


@dataclasses.dataclass(frozen=True)
class FlexMosaicBackward(_Attention):
  """flex with its backward on the one-launch Mosaic GPU kernel's `tiles`."""
  tiles: flex_configs.MosaicBackwardConfig

  @property
  def name(self) -> str:
    return f"flex_mosaic_bwd({_fields(self.tiles)})"

  def fn(self, head_dim, causal):
    return _flex_on(dict(mosaic_bwd=self.tiles), causal)


@dataclasses.dataclass(frozen=True)
class JaxAttention(_Attention):
  """`jax.nn.dot_product_attention` with this implementation: 'cudnn' or 'xla'."""
  implementation: str

  @property
  def name(self) -> str:
    return self.implementation

  def fn(self, head_dim, causal):
    del head_dim
    return functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                             implementation=self.implementation)


@dataclasses.dataclass(frozen=True)
class PallasMha(_Attention):
  """JAX's Pallas (Triton) flash attention `mha`: its default block sizes,
  or these forward tiles, backward tiles (dK/dV and dQ), warps and stages."""
  block_q: int | None = None  # None: every size its default
  block_k: int | None = None
  block_q_dkv: int | None = None
  block_kv_dkv: int | None = None
  block_q_dq: int | None = None
  block_kv_dq: int | None = None
  num_warps: int | None = None
  num_stages: int = 2

  @property
  def name(self) -> str:
    return "mha_default" if self.block_q is None else f"mha_{self.block_q}x{self.block_k}"

  def fn(self, head_dim, causal):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      from jax.experimental.pallas.ops.gpu import attention as mha_lib
    scale = head_dim ** -0.5
    if self.block_q is None:
      return lambda q, k, v: mha_lib.mha(q, k, v, None, sm_scale=scale, causal=causal)
    sizes = mha_lib.BlockSizes(block_q=self.block_q, block_k=self.block_k,
                               block_q_dkv=self.block_q_dkv, block_kv_dkv=self.block_kv_dkv,
                               block_q_dq=self.block_q_dq, block_kv_dq=self.block_kv_dq)
    return lambda q, k, v: mha_lib.mha(q, k, v, None, sm_scale=scale, causal=causal,
                                       block_sizes=sizes, num_warps=self.num_warps,
                                       num_stages=self.num_stages)


@dataclasses.dataclass(frozen=True)
class MosaicGpuAttention(_Attention):
  """JAX's Mosaic GPU reference attention (`attention_mgpu`) with `block_kv`-row
  key tiles; float16 only in jax 0.11.2 (its shared-memory buffers are
  float16), and it leaves the logit scale to the caller."""
  block_kv: int = 128
  input_dtype = jnp.float16

  @property
  def name(self) -> str:
    return f"mgpu_{self.block_kv}"

  def fn(self, head_dim, causal):
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=self.block_kv, max_concurrent_steps=2, causal=causal,
        block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    scale = head_dim ** -0.5
    return lambda q, k, v: attention_mgpu.attention(q * jnp.asarray(scale, q.dtype),
                                                    k, v, config)


# JAX's mha at its defaults and at the two tile sets that sweeps found best.
MHA_SWEEP = (
    PallasMha(),
    PallasMha(128, 64, 64, 128, 128, 64, num_warps=4, num_stages=3),
    PallasMha(64, 128, 128, 64, 64, 128, num_warps=4, num_stages=2),
)

# The variants a benchmark can name in its `--impls`; tile sweeps of flex's
# kernels are typed configs given to the benchmarks as JSON (their flags).
ATTENTION = {a.name: a for a in (
    Flex(), Flex("alibi"), Flex("documents"), JaxAttention("cudnn"), JaxAttention("xla"),
    *MHA_SWEEP, FlexTritonForward(),
    *(FlexTritonForward(fwd_softmax=s) for s in flex_configs.FWD_SOFTMAX),
    *(FlexForwardSoftmax(s) for s in flex_configs.FWD_SOFTMAX),
    *(FlexRefresh(r) for r in flex_configs.REFRESH),
    MosaicGpuAttention(64), MosaicGpuAttention(128),
)}


def attention_case(impl: _Attention, shape, causal, mode, chain=1):
  """A harness build thunk: (B, N, T, H) -> (jitted fwd or grad, (q, k, v)).

  With `chain` > 1 the executable makes that many calls one after another,
  each on the same q, k, v passed through an optimization barrier with the
  previous call's result (so none is merged with or moved past another, and
  every call sees the same random inputs): a call of tens of microseconds is
  then timed on the device rather than as the host's dispatch of one
  executable. The time per call is the harness's time over `chain`.
  """
  b, n, t, h = shape
  def build():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (b, t, n, h), impl.input_dtype) for key in keys)
    attend = impl.fn(h, causal)
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))
    fn = attend if mode == "fwd" else jax.grad(loss, argnums=(0, 1, 2))
    return jax.jit(chained(fn, chain)), (q, k, v)
  return build


def chained(fn, chain: int):
  """`fn` called `chain` times in a row on the same arguments; returns the
  last call's result (and, for `chain` > 1, the earlier ones, which keep the
  barriers whole: XLA drops a barrier's unused operands)."""
  def run(*args):
    out, earlier = fn(*args), []
    for _ in range(chain - 1):
      *args, previous = jax.lax.optimization_barrier((*args, out))
      earlier.append(previous)
      out = fn(*args)
    return (out, earlier) if earlier else out
  return run
