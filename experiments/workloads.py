"""Inputs and functions the benchmark and profiling programs share.

The benchmark programs define absl flags at import, so they cannot import one
another; what more than one program times lives here: the scan inputs, the
SSD / gated-delta-rule inputs and ops, the grouped-matmul inputs and the
attention implementations.
"""

import contextlib
import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp

from ops.flex_attention import api as flex_api
from ops.flex_attention import configs as flex_configs
from ops.flex_attention import mosaic as flex_mosaic
from ops.flex_attention import mosaic_backward as flex_mosaic_backward
from ops.flex_attention import pallas as flex_pallas
from ops.gated_delta_rule import gated_delta_rule
from ops.grouped_mlp import pallas as grouped_mlp_pallas
from ops.ssd import ssd

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


def ssd_inputs(batch, time, heads, key, value, dtype, seed=0):
  """q, k (unit norm), v, log_decay, beta."""
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (batch, time, heads, key), jnp.float32)
  k = jax.random.normal(ks[1], (batch, time, heads, key), jnp.float32)
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


# ---------------------------------------------------------------------------
# Attention: q, k, v [B, T, N, H], bf16.

# JAX mha sweep: (block_q, block_k, bwd blocks q_dkv, kv_dkv, q_dq, kv_dq,
# num_warps, num_stages); None = its defaults.
# The MoE layer's 'gmm' path with the grouped MLP's kernels chosen by hand:
# name -> (fused kernels, plain grouped matmuls, weight gradients) on Mosaic GPU.
GROUPED_MLP_VARIANTS = {
    "gmm_triton": (False, False, False),
    "gmm_triton_tgmm": (False, True, False),  # the defaults before mosaic_tgmm.py
    "gmm_mosaic": (True, True, True),
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


@contextlib.contextmanager
def mosaic_gmm_tiles(config):
  """Within this block (while a function is traced), the Mosaic GPU grouped
  matmuls without an epilogue take `config`'s tiles (`mosaic.choose_config`,
  its 64-row alternative off): the MoE layer with other tiles, for a
  comparison row."""
  from ops.grouped_matmul import mosaic
  defaults = mosaic._PREFERRED, mosaic._FEW_WAVES_MAX_RATIO
  mosaic._PREFERRED, mosaic._FEW_WAVES_MAX_RATIO = (config,) + defaults[0], 0.0
  try:
    yield
  finally:
    mosaic._PREFERRED, mosaic._FEW_WAVES_MAX_RATIO = defaults


MHA_CONFIGS = {
    "mha_default": None,
    "mha_128x64": (128, 64, 64, 128, 128, 64, 4, 3),
    "mha_64x128": (64, 128, 128, 64, 64, 128, 4, 2),
}


# flex with its forward on given Mosaic GPU tiles: flex_mosaic_<tiles>, see
# `mosaic_fwd_tiles`.
_MOSAIC_FWD_TILES = re.compile(
    r"(\d+)x(\d+)x(\d+)(_free)?(_persist(_all)?)?(_sums)?(_fm)?(_pq)?$")
# flex with its forward on the Triton kernel, on given tiles or the table's:
# flex_triton[_<bq>x<bk>x<warps>x<stages>][_<fwd_softmax>] (the tuning sweep's
# `--small` set left 8 warps out at head sizes below 64; the suffix sets
# `configs.FlexConfig.fwd_softmax`, e.g. `_online`).
_FLEX_TRITON = re.compile(
    r"flex_triton(?:_(\d+)x(\d+)x(\d+)x(\d+))?(?:_(%s))?$" % "|".join(flex_configs.FWD_SOFTMAX))
# flex with the table's kernels and another forward softmax: flex_<fwd_softmax>.
_FLEX_SOFTMAX = re.compile(r"flex_(%s)$" % "|".join(flex_configs.FWD_SOFTMAX))
# flex with the table's kernels and another `FlexConfig.refresh`: flex_refresh_<mode>.
_FLEX_REFRESH = re.compile(r"flex_refresh_(%s)$" % "|".join(flex_configs.REFRESH))
# flex with its backward on the one-launch Mosaic GPU kernel's tiles:
# flex_mosaic_bwd_<tiles>, see `mosaic_bwd_tiles`.
_FLEX_MOSAIC_BWD = re.compile(r"flex_mosaic_bwd_(.+)$")
# flex with its forward on given Mosaic GPU tiles and, where a suffix names
# one, that forward softmax: flex_mosaic_<tiles>[_<fwd_softmax>].
_FLEX_MOSAIC_FWD = re.compile(
    r"flex_mosaic_(.+?)(?:_(%s))?$" % "|".join(flex_configs.FWD_SOFTMAX))
# JAX's Mosaic GPU attention (`attention_mgpu`, float16 inputs): mgpu_<block_kv>.
_MGPU = re.compile(r"mgpu_(\d+)$")


def mosaic_fwd_tiles(spec: str) -> flex_mosaic.MosaicForwardConfig:
  """'<block_q>x<block_k>x<steps>[_free][_persist[_all]][_sums][_fm][_pq]'
  -> the Mosaic forward's tiles (`_free`: without ping-pong turns;
  `_persist`: one block per SM walking the work items; `_persist_all`:
  right-bounded calls too; `_sums`: the row sums on the tensor cores;
  `_fm`: partly masked tiles after the first open one on the kept maxima;
  `_pq`: with `_persist`, the next item's query tile loaded under the walk)."""
  match = _MOSAIC_FWD_TILES.match(spec)
  if match is None:
    raise ValueError("Mosaic forward tiles must be "
                     "<bq>x<bk>x<steps>[_free][_persist[_all]][_sums][_fm][_pq], "
                     f"got {spec!r}")
  bq, bk, steps = map(int, match.groups()[:3])
  return flex_mosaic.MosaicForwardConfig(
      block_q=bq, block_k=bk, max_concurrent_steps=steps,
      ping_pong=match.group(4) is None, persistent=match.group(5) is not None,
      persistent_right_bounded=match.group(6) is not None,
      tensor_core_sums=match.group(7) is not None,
      frozen_masked_tiles=match.group(8) is not None,
      prefetch_query=match.group(9) is not None)


def mosaic_bwd_tiles(spec: str) -> flex_mosaic_backward.MosaicBackwardConfig:
  """'<block_q>x<block_k>x<steps>[x<dQ column chunks>[x<compute registers>]][_ds2][_pipe]'
  -> the backward's tiles (`_ds2`: two dS^T slots; `_pipe`: the pipelined step)."""
  match = re.fullmatch(r"(\d+x\d+x\d+(?:x\d+){0,2})(_ds2)?(_pipe)?", spec)
  if match is None:
    raise ValueError("Mosaic backward tiles must be "
                     f"<bq>x<bk>x<steps>[x<chunks>[x<registers>]][_ds2][_pipe], got {spec!r}")
  return flex_mosaic_backward.MosaicBackwardConfig(
      *map(int, match.group(1).split("x")), ds_slots=2 if match.group(2) else 1,
      pipelined=match.group(3) is not None)


def with_changes(config: flex_configs.FlexConfig, **changes) -> flex_configs.FlexConfig:
  """`config` with those fields replaced; a `mosaic_fwd` given here runs every
  call's forward (right-bounded ones too, whatever the table's
  `mosaic_fwd_bounded`), so that a timed tile set is the one that runs."""
  if "mosaic_fwd" in changes:
    config = config.forward_on(changes.pop("mosaic_fwd"))
  return dataclasses.replace(config, **changes)


def _flex_with(causal, **changes):
  """flex with the table's config for the input, those fields replaced
  (e.g. `mosaic_fwd=None`: the forward on the Triton kernel)."""
  def fn(q, k, v):
    hp = max(16, 1 << (q.shape[-1] - 1).bit_length())
    config = with_changes(flex_configs.get_config(hp, q.dtype, interpret=False), **changes)
    return flex_pallas.flex_attention_pallas(
        q, k, v, scale=q.shape[-1] ** -0.5, is_causal=causal, window=None,
        q_segment_ids=None, kv_segment_ids=None, kv_seq_lengths=None,
        interpret=False, config=config)
  return fn


def _mgpu_attention(h, causal, block_kv):
  """JAX's Mosaic GPU reference attention (float16 only in jax 0.11.2: its
  shared-memory buffers are float16; it leaves the logit scale to the caller)."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  config = attention_mgpu.TuningConfig(
      block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=causal,
      block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
  scale = h ** -0.5
  return lambda q, k, v: attention_mgpu.attention(q * jnp.asarray(scale, q.dtype),
                                                  k, v, config)


def input_dtype(impl):
  """The dtype a timed implementation is fed: bfloat16, or float16 for JAX's
  Mosaic GPU attention, which takes nothing else."""
  return jnp.float16 if _MGPU.match(impl) else jnp.bfloat16


def attention_fn(impl, h, causal):
  """(q, k, v) -> out for one implementation: flex (and its score_mod /
  mask_mod variants, its Triton forward `flex_triton` (on given tiles:
  `flex_triton_<bq>x<bk>x<warps>x<stages>`; a `_<fwd_softmax>` suffix: that
  softmax; `flex_<fwd_softmax>`: the table's kernels with it; `flex_refresh_<mode>`:
  with that `FlexConfig.refresh`), its Mosaic forward on other tiles
  `flex_mosaic_*` (a `_<fwd_softmax>` suffix: that softmax), its backward on
  the Mosaic GPU kernel `flex_mosaic_bwd_*`), cudnn, xla, a `MHA_CONFIGS` entry of JAX's
  mha, or JAX's Mosaic GPU attention `mgpu_*`."""
  if impl == "flex":
    return functools.partial(flex_api.flex_attention, is_causal=causal,
                             implementation="pallas")
  if match := _FLEX_TRITON.match(impl):
    changes = dict(mosaic_fwd=None)
    if match.group(1):
      changes["fwd"] = flex_configs.KernelConfig(*map(int, match.groups()[:4]))
    if match.group(5):
      changes["fwd_softmax"] = match.group(5)
    return _flex_with(causal, **changes)
  if match := _FLEX_SOFTMAX.match(impl):
    return _flex_with(causal, fwd_softmax=match.group(1))
  if match := _FLEX_REFRESH.match(impl):
    return _flex_with(causal, refresh=match.group(1))
  if match := _FLEX_MOSAIC_BWD.match(impl):
    return _flex_with(causal, mosaic_bwd=mosaic_bwd_tiles(match.group(1)))
  if match := _FLEX_MOSAIC_FWD.match(impl):
    changes = dict(mosaic_fwd=mosaic_fwd_tiles(match.group(1)))
    if match.group(2):
      changes["fwd_softmax"] = match.group(2)
    return _flex_with(causal, **changes)
  if match := _MGPU.match(impl):
    return _mgpu_attention(h, causal, int(match.group(1)))
  if impl == "flex_alibi":
    def alibi(score, b, n, t, s):
      del b
      return score + jnp.exp2(-(n + 1).astype(jnp.float32)) * (s - t).astype(jnp.float32)
    return functools.partial(flex_api.flex_attention, is_causal=causal,
                             score_mod=alibi, implementation="pallas")
  if impl == "flex_documents":
    documents = lambda b, n, t, s: (t // 512) == (s // 512)
    return functools.partial(flex_api.flex_attention, is_causal=causal,
                             mask_mod=documents, implementation="pallas")
  if impl in ("cudnn", "xla"):
    return functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                             implementation=impl)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import attention as mha_lib
  cfg = MHA_CONFIGS[impl]
  if cfg is None:
    return lambda q, k, v: mha_lib.mha(q, k, v, None, sm_scale=h ** -0.5, causal=causal)
  bq, bk, a, b, c, d, warps, stages = cfg
  sizes = mha_lib.BlockSizes(block_q=bq, block_k=bk, block_q_dkv=a, block_kv_dkv=b,
                             block_q_dq=c, block_kv_dq=d)
  return lambda q, k, v: mha_lib.mha(q, k, v, None, sm_scale=h ** -0.5, causal=causal,
                                     block_sizes=sizes, num_warps=warps,
                                     num_stages=stages)


def attention_case(impl, shape, causal, mode, chain=1):
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
    q, k, v = (jax.random.normal(key, (b, t, n, h), input_dtype(impl)) for key in keys)
    attend = attention_fn(impl, h, causal)
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
