"""Grouped matmul and dropless MoE on one GPU: correctness, kernel tiles, timings.

    python -m experiments.benchmark_kernel_moe    # docs/benchmarks/moe.json
    JAX_PLATFORMS=cpu python -m experiments.benchmark_kernel_moe --tokens 256 \
        --gmm_rows 1024 --iters 2 --output /tmp/kernel_moe_cpu.json
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m experiments.benchmark_kernel_moe \
        --sections capacity --capacity_budget_s 270 --capacity_iters 3 \
        --output /tmp/moe_capacity.json
    JAX_PLATFORMS=cpu python -m experiments.benchmark_kernel_moe --sections capacity \
        --capacity_start 64 --capacity_max 256 --output /tmp/kernel_moe_capacity_cpu.json
    python -m experiments.benchmark_kernel_moe --grid --grid_subset quick \
        --grid_check --output /tmp/moe_grid.json
    JAX_PLATFORMS=cpu python -m experiments.benchmark_kernel_moe --smoke --grid \
        --sections op,moe --output /tmp/moe_grid_cpu.json

"fwd+bwd" is one `jax.vjp` with a fixed random cotangent (with a sum-of-outputs
loss XLA rewrites a dense matmul's gradient into a reduction). Sections (one
JSON row each, `section` says which):
- check: on the device, `ops.grouped_matmul` (Pallas) and `tokamax.ragged_dot`
  against the fp32 reference on values and both gradients (f32 and bf16,
  empty groups, M not a tile multiple), and MoELayer 'gmm' against 'dense'
  (bf16).
- tiles: tile configurations of the Triton forward (`gmm`, also with the
  transposed rhs of the input gradient) and weight-gradient (`tgmm`) kernels
  at M = `gmm_rows` (`triton_tiles`), and on a Hopper GPU those of the Mosaic
  GPU kernels (`mosaic_tiles`, `tgmm_tiles`), each with its error against
  `jax.lax.ragged_dot` in float32 (`rel_err`, relative to the largest output).
- op: grouped matmul [M, 512] x [8, 512, 1024] forward and fwd+bwd: the Pallas
  path (on an H200 the Mosaic GPU kernel), the Triton kernel ('pallas_triton'),
  `jax.lax.ragged_dot`, `tokamax.ragged_dot` on its Mosaic GPU kernel
  ('tokamax_ragged_dot'; tokamax is optional: where it is not installed the
  row says 'unsup' with the import error), every expert on every row (a dense
  per-expert einsum, 8x the arithmetic) and one dense `jnp.matmul` of the same
  work (the TFLOP/s yardstick).
- mlp: the experts' MLP alone (`ops.grouped_mlp`, GELU, bf16 rows, float32
  weights as in MoELayer) at `--mlp_rows`, forward and fwd+bwd: the fused
  Pallas op (its defaults: fused kernels on Triton, plain grouped matmuls on
  Mosaic GPU on Hopper), every kernel on Mosaic GPU ('fused_pallas_mosaic'),
  two Triton grouped matmuls with `jax.nn.gelu` between
  them (unfused), and `ragged_dot`.
- parts: the router and the two sorts of the sorted paths, alone.
- moe: MoELayer(8 experts, top-2, d_model 512, d_hidden 1024, GELU), bf16,
  forward and fwd+bwd, one row per `dropless_impl`, and 'gmm' with the
  grouped MLP's kernels chosen by hand ('gmm_triton': all on Triton,
  'gmm_triton_tgmm': the weight gradients on Triton, 'gmm_mosaic': all on
  Mosaic GPU; `workloads.GROUPED_MLP_VARIANTS`); ratios
  vs 'dense' and 'ragged_dot' from the same run.
- capacity (not in the default list: it runs until every path is out of
  memory): the moe layer's fwd+bwd (`--capacity_modes` may add forward) at
  `--capacity_start` tokens, then doubling up to `--capacity_max`, one column
  per `dropless_impl` in `--capacity_impls`; a path stops doubling at its first
  row that is not ok (OOM, error, timeout), and no case starts after
  `--capacity_budget_s`. Every case runs in a fresh process
  (`--capacity_case`, which prints one JSON row), so `peak_mb`, the device
  allocator's peak, belongs to that case alone; `limit_mb` is the allocator's
  limit (XLA_PYTHON_CLIENT_MEM_FRACTION of the device, 0.75 unless set), and
  `planned_peak_mb` XLA's buffer plan of one call. A case whose process dies
  still gives a row (status OOM when its output says so, else error). The
  `capacity_max` rows give each path's largest count that ran (and its peak)
  and the first that did not. This section runs first, before this process
  touches the device (its cases need all of it), and the JSON is rewritten
  after every case; the other sections' `--time_budget_s` starts after it.

`--grid` runs the op and moe sections (and check, once) at the MoE points of
`shape_grid` instead: (experts, top-k) x d_model x d_hidden, 16,384 tokens
(the op's M = 16,384 x top-k); the op without the every-expert einsum, the
layer for `--grid_moe_impls`. Each (point, mode) gets a summary row: Pallas
over tokamax's time, and 'auto' over the fastest layer path. `--grid_check`
checks every implementation at every point before timing it there, on the
point's inputs as timed, one `section="check"`, `grid="moe"` row (and printed
line) each: the op's grouped matmuls (all but the dense-matmul yardstick)
against `grouped_matmul_reference` in float32 (`case="op"`: `rel_err_out`,
`_dlhs`, `_drhs`) and the layer's paths against 'dense' in float32
(`case="moe"`: `rel_err_out`, `_dparams`, `_dx`), each the largest error over
the largest reference value; status ok, unsup (tokamax missing, say) or
error with the message. `--smoke`: CPU sizes (and the grid's 'smoke'
subset), two timed calls.
"""

import contextlib
import functools
import json
import os
import subprocess
import time
from typing import Callable

from absl import app
from absl import flags
from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from experiments import checks
from experiments import harness
from experiments import shape_grid
from experiments import workloads
import ops
from ops.grouped_matmul import configs as gmm_configs
from ops.grouped_matmul import mosaic as gmm_mosaic
from ops.grouped_matmul import mosaic_tgmm as gmm_mosaic_tgmm
from ops.grouped_matmul import pallas as gmm_pallas
from ops.grouped_matmul import reference as gmm_reference
from ops.grouped_matmul import triton as gmm_triton
from ops.grouped_mlp import pallas as mlp_pallas
from ops.moe_dispatch import route
from ops.moe_dispatch import sort_by_expert

_OUTPUT = flags.DEFINE_string("output", "docs/benchmarks/moe.json",
                              "JSON output (the curated suite file; another for trial runs).")
_TOKENS = flags.DEFINE_list("tokens", ["8192", "65536"], "MoE token counts.")
_GMM_ROWS = flags.DEFINE_integer("gmm_rows", 131072, "M of the grouped-matmul op cases.")
_MLP_ROWS = flags.DEFINE_list("mlp_rows", ["16384", "131072"],
                              "M of the grouped-MLP cases (16384 = 8192 tokens x top-2).")
SECTIONS = ("check", "tiles", "op", "mlp", "parts", "moe", "capacity")
_SECTIONS = flags.DEFINE_list("sections", ["check", "tiles", "op", "mlp", "parts", "moe"],
                              "What to run, any of: " + ", ".join(SECTIONS) + ".")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls per case.")
_SAMPLE_MS = flags.DEFINE_float(
    "sample_ms", harness.SAMPLE_MS, "Back-to-back calls per timed sample, in ms "
    "(harness.run_case); 2 ms samples biased sub-millisecond calls (BUILD_NOTES.md).")
_BUDGET = flags.DEFINE_float("time_budget_s", 250.0, "Skip cases started after this "
                             "(with --grid: no limit unless given).")
_CAPACITY_START = flags.DEFINE_integer("capacity_start", 262144,
                                       "capacity: the first token count.")
_CAPACITY_MAX = flags.DEFINE_integer("capacity_max", 1 << 24,
                                     "capacity: no token count above this.")
_CAPACITY_BUDGET = flags.DEFINE_float("capacity_budget_s", 300.0,
                                      "capacity: start no case after this many seconds.")
_CAPACITY_IMPLS = flags.DEFINE_list("capacity_impls", ["dense", "ragged_dot", "sort", "gmm"],
                                    "capacity: the dropless_impl columns.")
_CAPACITY_MODES = flags.DEFINE_list("capacity_modes", ["fwd+bwd"],
                                    "capacity: fwd+bwd and/or forward.")
_CAPACITY_ITERS = flags.DEFINE_integer("capacity_iters", 5, "capacity: timed calls per case.")
_CAPACITY_CASE_TIMEOUT = flags.DEFINE_float(
    "capacity_case_timeout_s", 300.0,
    "capacity: time limit of one case's process; near the end of the budget a case "
    "gets what is left of it, but at least 60 s (or this, if less).")
_SMOKE = flags.DEFINE_bool(
    "smoke", False, "CPU sizes: 256 tokens, M 1024 (and the grid's 'smoke' subset), "
    "two timed calls, the check's grouped MLP in SwiGLU only.")
_GRID = shape_grid.define_flags()
_GRID_MOE_IMPLS = flags.DEFINE_list(
    "grid_moe_impls", ["dense", "ragged_dot", "sort", "gmm", "auto"],
    "With --grid: the MoELayer dropless_impls timed at every point.")
_CAPACITY_CASE = flags.DEFINE_string(
    "capacity_case", None,
    "Internal: run the capacity case 'impl:mode:tokens' here, print its row as one JSON line.")

IMPLS = ("dense", "ragged_dot", "sort", "gmm", "auto")
MODES = workloads.MOE_MODES
# The layer of the headline sections: 8 experts, top-2, d_model 512, d_hidden 1024.
HEADLINE = shape_grid.MoePoint(workloads.NUM_EXPERTS, workloads.TOP_K, workloads.D_MODEL,
                               workloads.D_HIDDEN)
# The sections --grid runs (check once, op and moe at every point).
GRID_SECTIONS = ("check", "op", "moe")


def triton_tiles() -> dict:
  """The Triton kernels' timed tiles (a function: a configuration's unset
  fields are read for the device, known once JAX has started)."""
  t = gmm_configs.TritonConfig
  return {
      "default": t(),
      "stages4": t(num_stages=4, tgmm_num_stages=4),
      "m256_n128__tgmm_k256_n128": t(block_m=256, block_n=128, tgmm_block_k=256,
                                     tgmm_block_n=128),
      "k32__tgmm_m32": t(block_k=32, num_stages=4, tgmm_block_m=32, tgmm_num_stages=4),
      "m128_k64_n128__tgmm_n128": t(block_n=128, num_stages=4, tgmm_block_n=128),
      "tgmm_m128": t(tgmm_block_m=128),
      "tgmm_m128_stages4": t(tgmm_block_m=128, tgmm_num_stages=4),
      "tgmm_k256_n128": t(tgmm_block_k=256, tgmm_block_n=128),
      "tgmm_stages4": t(tgmm_num_stages=4),
  }


def mosaic_tiles() -> dict:
  """The Mosaic GPU grouped matmul's timed tiles: `mosaic.choose_config`'s
  candidates as it fits them in shared memory (the first two, and the 64-row
  tiles of its few-waves rule) and their neighbours."""
  m = gmm_configs.MosaicConfig
  return {
      "128x128_split_m_4": m(block_m=128, block_n=128, split="m", max_concurrent_steps=4),
      "128x256_split_n_3": m(block_m=128, block_n=256, split="n", max_concurrent_steps=3,
                             store_slots=1),
      "64x256_split_n_4": m(block_m=64, block_n=256, split="n", max_concurrent_steps=4),
      "128x256_split_n_2": m(block_m=128, block_n=256, split="n", max_concurrent_steps=2),
      "64x128_split_n_4": m(block_m=64, block_n=128, split="n", max_concurrent_steps=4),
  }


def tgmm_tiles() -> dict:
  """The Mosaic GPU weight gradient's timed tiles: its default
  (`MosaicTgmmConfig()`, float32 out as for the MoE layer's weights) and
  neighbours."""
  t = gmm_configs.MosaicTgmmConfig
  return {
      "64x128x256_4": t(),
      "64x128x256_3": t(max_concurrent_steps=3),
      "128x128x256_2": t(block_m=128, max_concurrent_steps=2),
      "64x128x128_4": t(block_n=128),
      "128x128x128_3": t(block_m=128, block_n=128, max_concurrent_steps=3),
  }


_START = time.perf_counter()
_budget_start = _START  # main() moves it past the capacity sweep


def _over_budget() -> bool:
  if _GRID.grid.value and not flags.FLAGS["time_budget_s"].present:
    return False
  return time.perf_counter() - _budget_start > _BUDGET.value


def tokamax_ragged_dot(lhs, rhs, group_sizes):
  """`tokamax.ragged_dot` on its Mosaic GPU kernel (implementation 'mosaic'),
  `jax.lax.ragged_dot`'s contract.

  tokamax is imported here, as the function is traced: where it is missing,
  the device is no NVIDIA GPU or the kernel declines the inputs
  (NotImplementedError), this raises `harness.Unsupported` with the reason (a
  row's 'unsup').
  """
  try:
    import tokamax  # pylint: disable=g-import-not-at-top
  except ImportError as exc:
    raise harness.Unsupported(f"tokamax is not installed: {type(exc).__name__}: {exc}") from exc
  device = jax.devices()[0]
  if "NVIDIA" not in device.device_kind:
    raise harness.Unsupported(f"tokamax.ragged_dot's Mosaic GPU kernel needs an NVIDIA GPU, "
                              f"got {device.device_kind!r}")
  try:
    return tokamax.ragged_dot(lhs, rhs, group_sizes, implementation="mosaic")
  except NotImplementedError as exc:
    raise harness.Unsupported(f"tokamax.ragged_dot(implementation='mosaic'): {exc}") from exc


def check_rows(small: bool = False) -> list[dict]:
  """The check section (`small`: CPU sizes)."""
  rows = []
  m, k, n = 4133, 512, 1024  # not a multiple of any tile
  sizes = [700, 0, 2048, 13, 0, 1000, 300, 72]
  if small:
    m, k, n = 301, 64, 128
    sizes = [70, 0, 150, 13, 0, 40, 20, 8]
  sizes = jnp.asarray(sizes, jnp.int32)
  for dtype in (jnp.float32, jnp.bfloat16):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dtype)
    rhs = (jax.random.normal(k2, (8, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    cot = jax.random.normal(k3, (m, n), jnp.float32).astype(dtype)
    errors = checks.vjp_errors(
        lambda a, b: ops.grouped_matmul(a, b, sizes, implementation="pallas"),
        lambda a, b: gmm_reference.grouped_matmul_reference(a, b, sizes),
        (lhs, rhs), cot, ("out", "dlhs", "drhs"))
    rows.append(dict(section="check", case="grouped_matmul_vs_reference",
                     dtype=jnp.dtype(dtype).name, shape=[m, k, n], **errors))
    rows.append(harness.check_row(
        dict(section="check", case="tokamax_ragged_dot_vs_reference",
             dtype=jnp.dtype(dtype).name, shape=[m, k, n]),
        lambda: checks.vjp_errors(
            lambda a, b: tokamax_ragged_dot(a, b, sizes),
            lambda a, b: gmm_reference.grouped_matmul_reference(a, b, sizes),
            (lhs, rhs), cot, ("out", "dlhs", "drhs"))))
  # small: SwiGLU alone (the GELU kernels run in the layer's 'gmm' check below).
  for activation in ("swiglu",) if small else ("gelu", "swiglu"):
    f_in = (2 if activation == "swiglu" else 1) * n
    k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(k1, (m, k), jnp.bfloat16)
    w_in = jax.random.normal(k2, (8, k, f_in), jnp.float32) / np.sqrt(k)
    w_out = jax.random.normal(k3, (8, n, k), jnp.float32) / np.sqrt(n)
    cot = jax.random.normal(k4, (m, k), jnp.bfloat16)
    errors = checks.vjp_errors(
        lambda *w, activation=activation: ops.grouped_mlp(
            *w, sizes, activation=activation, implementation="pallas"),
        lambda *w, activation=activation: ops.grouped_mlp_reference(
            *w, sizes, activation=activation),
        (x, w_in, w_out), cot, ("out", "dx", "dw_in", "dw_out"))
    rows.append(dict(section="check", case=f"grouped_mlp_{activation}_vs_reference",
                     dtype="bfloat16 x, float32 weights", shape=[m, k, n], **errors))
  x = jax.random.normal(jax.random.key(3), (256 if small else 2048, workloads.D_MODEL),
                        jnp.bfloat16)
  # Both paths' parameters are the same: one init, jitted (as `workloads.moe_inputs`).
  params, state = jax.jit(workloads.moe_layer("dense", HEADLINE).init)(jax.random.key(1), x[:8])
  outs = {}
  for impl in ("dense", "gmm"):
    model = workloads.moe_layer(impl, HEADLINE)
    loss = lambda p, x: jnp.sum(model.apply(p, state, None, x)[0].astype(jnp.float32))
    outs[impl] = jax.jit(jax.value_and_grad(loss))(params, x)
  rows.append(dict(section="check", case="moe_gmm_vs_dense", dtype="bfloat16",
                   rel_err_loss=checks.rel_err(outs["gmm"][0], outs["dense"][0]),
                   rel_err_grads=checks.rel_err(outs["gmm"][1], outs["dense"][1])))
  return rows


def _tile_kernels(rows: int) -> list:
  """(tiles name, kernel, fn, args) of every timed tile configuration."""
  lhs, rhs, sizes = workloads.gmm_inputs(rows)
  starts, ends = gmm_reference.group_bounds(sizes, rows)
  dout = jax.random.normal(jax.random.key(6), (rows, workloads.D_HIDDEN), jnp.bfloat16)
  out = []
  for name, bs in triton_tiles().items():
    out += [
        (name, "gmm", functools.partial(gmm_triton.gmm, block_sizes=bs),
         (lhs, rhs, starts, ends)),
        (name, "gmm_transposed", functools.partial(gmm_triton.gmm, transpose_rhs=True,
                                                   block_sizes=bs), (dout, rhs, starts, ends)),
        (name, "tgmm", functools.partial(gmm_triton.tgmm, block_sizes=bs),
         (lhs, dout, starts, ends))]
  if not gmm_mosaic.preferred(jnp.bfloat16):
    logging.info("tiles: the Mosaic GPU kernels' tiles are timed on a Hopper GPU only")
    return out
  mosaic_gmm = lambda a, b, s, e, **kw: gmm_mosaic.gmm(a, b, e, **kw)[0]
  for name, config in mosaic_tiles().items():
    out += [
        (name, "mosaic_gmm", functools.partial(mosaic_gmm, config=config),
         (lhs, rhs, starts, ends)),
        (name, "mosaic_gmm_transposed", functools.partial(
            mosaic_gmm, transpose_rhs=True, config=config), (dout, rhs, starts, ends))]
  for name, config in tgmm_tiles().items():
    out.append((name, "mosaic_tgmm", functools.partial(
        gmm_mosaic_tgmm.tgmm, out_dtype=jnp.float32, config=config), (lhs, dout, starts, ends)))
  return out


def _tiles_reference(kernel: str, lhs, other, starts, ends) -> jax.Array:
  """What a tiles-section kernel computes, in float32."""
  lhs, other = lhs.astype(jnp.float32), other.astype(jnp.float32)
  if kernel.endswith("tgmm"):  # per group lhs[rows]^T @ dout[rows]
    row = jnp.arange(lhs.shape[0])[:, None]
    return jnp.stack([lhs.T @ (other * ((row >= s) & (row < e)))
                      for s, e in zip(starts, ends)])
  if kernel.endswith("transposed"):
    other = jnp.swapaxes(other, 1, 2)
  return jax.lax.ragged_dot(lhs, other, ends - starts)


def tile_rows(rows: int) -> list[dict]:
  out = []
  flops = 2 * rows * workloads.D_MODEL * workloads.D_HIDDEN
  for name, kernel, fn, args in _tile_kernels(rows):
    if _over_budget():
      break
    row = harness.run_case(dict(section="tiles", tiles=name, kernel=kernel, rows=rows),
                           lambda fn=fn, args=args: (fn, args), **_timing())
    if row["status"] == "ok":
      row["tflops"] = flops / row["median_ms"] / 1e9
      row["rel_err"] = checks.rel_err(jax.jit(fn)(*args), _tiles_reference(kernel, *args))
    out.append(row)
    logging.info("%s", {k: row.get(k) for k in ("tiles", "kernel", "median_ms", "tflops",
                                                 "rel_err")})
  return out


def _forward_and_vjp_rows(section: str, impls: dict, diff_args: tuple, rest: tuple,
                          cotangent, flops: float, **config) -> list[dict]:
  """Rows of `fn(*diff_args, *rest)` for each impl: forward, then fwd+bwd (one
  `jax.vjp` in `diff_args` with `cotangent`), with TFLOP/s from `flops` (the
  forward's; fwd+bwd counts three times that)."""
  num_diff = len(diff_args)
  out = []
  for mode in MODES:
    for name, fn in impls.items():
      if _over_budget():
        break
      if mode == "forward":
        case = lambda fn=fn: (fn, (*diff_args, *rest))
      else:
        def case(fn=fn):
          def grad(*args):
            diff, others, cot = args[:num_diff], args[num_diff:-1], args[-1]
            return jax.vjp(lambda *d: fn(*d, *others), *diff)[1](cot)
          return grad, (*diff_args, *rest, cotangent)
      row = harness.run_case(dict(section=section, impl=name, mode=mode, **config), case,
                             **_timing())
      if row["status"] == "ok":
        row["tflops"] = flops * (1 if mode == "forward" else 3) / row["median_ms"] / 1e9
      out.append(row)
      logging.info("%s", {k: row.get(k) for k in ("section", "impl", "mode", "median_ms")})
  return out


def gmm_inputs(rows: int, layer: shape_grid.MoePoint = HEADLINE):
  """lhs [rows, d_model], rhs [experts, d_model, d_hidden] (bf16) and random
  group sizes around rows / experts (`workloads.gmm_inputs` at the headline
  layer)."""
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  lhs = jax.random.normal(k1, (rows, layer.d_model), jnp.bfloat16)
  rhs = (jax.random.normal(k2, (layer.experts, layer.d_model, layer.d_hidden))
         / 20).astype(jnp.bfloat16)
  return lhs, rhs, workloads.balanced_sizes(rows, layer.experts, k3)


def _layer_fields(layer: shape_grid.MoePoint) -> dict:
  """A grid row's point fields."""
  return dict(point=layer.name, experts=layer.experts, top_k=layer.top_k,
              d_model=layer.d_model, d_hidden=layer.d_hidden)


# The op section's yardstick: one dense matmul of the same work, not a grouped
# matmul (its values differ, so the checks leave it out).
OP_YARDSTICK = "dense_matmul_same_flops"


def op_impls(grid: bool = False) -> dict[str, Callable]:
  """The op section's implementations, each (lhs [M, K], rhs [G, K, N],
  group_sizes [G]) -> [M, N] in lhs's dtype: ours, the peers and
  `OP_YARDSTICK`; with `grid`, without the every-expert einsum (G / top-k
  times the work)."""
  def every_expert(a, b, s):
    group_of_row = jnp.repeat(jnp.arange(b.shape[0]), s, total_repeat_length=a.shape[0])
    y = jnp.einsum("mk,gkn->gmn", a, b, preferred_element_type=jnp.float32)
    select = jax.nn.one_hot(group_of_row, b.shape[0], dtype=jnp.float32)
    return jnp.einsum("mg,gmn->mn", select, y).astype(a.dtype)

  def triton(a, b, s):
    starts, ends = gmm_reference.group_bounds(s, a.shape[0])
    return gmm_pallas.grouped_matmul_pallas(a, b, starts, ends, mosaic=False,
                                            mosaic_tgmm=False)

  impls = {
      "pallas": lambda a, b, s: ops.grouped_matmul(a, b, s, implementation="pallas"),
      "pallas_triton": triton,
      "ragged_dot": lambda a, b, s: ops.grouped_matmul(a, b, s, implementation="xla"),
      "tokamax_ragged_dot": tokamax_ragged_dot,
      "every_expert_einsum": every_expert,
      OP_YARDSTICK: lambda a, b, s: jnp.matmul(a, b[0]),
  }
  if grid:
    del impls["every_expert_einsum"]
  return impls


def _op_cotangent(rows: int, layer: shape_grid.MoePoint) -> jax.Array:
  """[rows, d_hidden] bf16, random: with ones, XLA rewrites a dense matmul's gradient."""
  return jax.random.normal(jax.random.key(5), (rows, layer.d_hidden), jnp.bfloat16)


def op_rows(rows: int, layer: shape_grid.MoePoint | None = None) -> list[dict]:
  """The grouped matmul at M = `rows` on the headline layer's weights, or on
  the grid point `layer`'s (then without the every-expert einsum, E / top-k
  times the work)."""
  grid = layer is not None
  layer = layer or HEADLINE
  lhs, rhs, sizes = gmm_inputs(rows, layer)
  flops = 2 * rows * layer.d_model * layer.d_hidden
  out = _forward_and_vjp_rows("op", op_impls(grid), (lhs, rhs), (sizes,),
                              _op_cotangent(rows, layer), flops,
                              rows=rows, **(_layer_fields(layer) if grid else {}))
  for peer, field in (("dense_matmul_same_flops", "fraction_of_dense_matmul_tflops"),
                      ("tokamax_ragged_dot", "ratio_vs_tokamax_ragged_dot")):
    base = {r["mode"]: r for r in out if r["impl"] == peer}
    for r in out:
      if r.get("status") == "ok" and base.get(r["mode"], {}).get("status") == "ok":
        ratio = r["median_ms"] / base[r["mode"]]["median_ms"]
        r[field] = 1 / ratio if field.startswith("fraction") else ratio
  return out


def _grid_check_fields(layer: shape_grid.MoePoint, case: str, reference: str) -> dict:
  """The fields of a grid check row of `case` ('op' or 'moe') at `layer`."""
  return dict(section="check", grid="moe", case=case, **_layer_fields(layer),
              tokens=layer.tokens, rows=layer.rows, dtype="bfloat16", reference=reference)


def op_check_rows(layer: shape_grid.MoePoint,
                  impls: dict[str, Callable] | None = None) -> list[dict]:
  """The grouped matmul at the grid point `layer` (M = tokens x top-k, its
  inputs as the op section times them) against `grouped_matmul_reference`
  in float32: `rel_err_out`, `rel_err_dlhs`, `rel_err_drhs`, one row per
  implementation of `impls` (name -> (lhs, rhs, group_sizes) -> out; by
  default the grid's `op_impls` but `OP_YARDSTICK`)."""
  if impls is None:
    impls = {k: v for k, v in op_impls(grid=True).items() if k != OP_YARDSTICK}
  lhs, rhs, sizes = gmm_inputs(layer.rows, layer)
  return checks.check_against(
      _grid_check_fields(layer, "op", "grouped_matmul_reference, float32"),
      {name: (lambda a, b, fn=fn: fn(a, b, sizes)) for name, fn in impls.items()},
      lambda a, b: gmm_reference.grouped_matmul_reference(a, b, sizes),
      (lhs, rhs), _op_cotangent(layer.rows, layer), ("out", "dlhs", "drhs"))


def moe_check_rows(layer: shape_grid.MoePoint, impls: tuple[str, ...]) -> list[dict]:
  """MoELayer at the grid point `layer` (its inputs as the moe section times
  them: bf16 tokens, f32 parameters), one row per `dropless_impl` in
  `impls`, against the 'dense' path in float32: `rel_err_out`,
  `rel_err_dparams` (the largest over the parameters) and `rel_err_dx`."""
  params, state, x, cotangent = workloads.moe_inputs(layer.tokens, layer)
  forward = lambda impl: workloads.moe_case(impl, "forward", params, state, x, cotangent,
                                             layer)[0]
  return checks.check_against(_grid_check_fields(layer, "moe", "dense, float32"),
                        {impl: forward(impl) for impl in impls}, forward("dense"),
                        (params, x), cotangent, ("out", "dparams", "dx"))


def mlp_rows(rows: int) -> list[dict]:
  """The experts' MLP at M = `rows`: fused op, unfused Pallas, ragged_dot."""
  x, _, sizes = workloads.gmm_inputs(rows)
  k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
  e, d, f = workloads.NUM_EXPERTS, workloads.D_MODEL, workloads.D_HIDDEN
  w_in = jax.random.normal(k1, (e, d, f), jnp.float32) / np.sqrt(d)
  w_out = jax.random.normal(k2, (e, f, d), jnp.float32) / np.sqrt(f)
  cotangent = jax.random.normal(k3, (rows, d), jnp.bfloat16)
  flops = 2 * 2 * rows * d * f

  def unfused(x, w_in, w_out, s):
    starts, ends = gmm_reference.group_bounds(s, x.shape[0])
    gmm = lambda a, b, s: gmm_pallas.grouped_matmul_pallas(a, b, starts, ends, mosaic=False,
                                                           mosaic_tgmm=False)
    h = gmm(x, w_in.astype(x.dtype), s)
    return gmm(jax.nn.gelu(h), w_out.astype(x.dtype), s)

  def fused_mosaic(x, w_in, w_out, s):
    starts, ends = gmm_reference.group_bounds(s, x.shape[0])
    return mlp_pallas.grouped_mlp_pallas(x, w_in, w_out, starts, ends,
                                         activation="gelu", mosaic=True)

  impls = {
      "fused_pallas": functools.partial(ops.grouped_mlp, implementation="pallas"),
      "fused_pallas_mosaic": fused_mosaic,
      "unfused_pallas": unfused,
      "ragged_dot": functools.partial(ops.grouped_mlp, implementation="xla"),
  }
  out = _forward_and_vjp_rows("mlp", impls, (x, w_in, w_out), (sizes,), cotangent, flops,
                              rows=rows)
  for r in out:
    base = [b for b in out if b["impl"] == "unfused_pallas" and b["mode"] == r["mode"]]
    if r.get("status") == "ok" and base and base[0].get("status") == "ok":
      r["ratio_vs_unfused"] = r["median_ms"] / base[0]["median_ms"]
  return out


def _timing() -> dict:
  """`harness.run_case`'s timing arguments, from the flags (two timed calls
  of one call each under --smoke)."""
  if _SMOKE.value:
    return dict(warmup=1, iters=2, sample_ms=0)
  return dict(iters=_ITERS.value, sample_ms=_SAMPLE_MS.value)


def part_rows(tokens: int) -> list[dict]:
  """Pieces of the sorted paths at `tokens`: router, the two sorts."""
  x = jax.random.normal(jax.random.key(0), (tokens, workloads.D_MODEL), jnp.bfloat16)
  w_router = jax.random.normal(jax.random.key(1), (workloads.D_MODEL, workloads.NUM_EXPERTS)) / 20
  ids = route(x, w_router, workloads.TOP_K).expert_ids.reshape(-1)
  cases = {
      "router_top2": (lambda x, w: route(x, w, workloads.TOP_K), (x, w_router)),
      "sort_argsort": (lambda i: sort_by_expert(i, workloads.NUM_EXPERTS, method="argsort"),
                       (ids,)),
      "sort_counting": (lambda i: sort_by_expert(i, workloads.NUM_EXPERTS, method="counting"),
                        (ids,)),
  }
  out = []
  for name, (fn, args) in cases.items():
    out.append(harness.run_case(dict(section="parts", part=name, tokens=tokens),
                                lambda fn=fn, args=args: (fn, args), **_timing()))
  return out


def moe_rows(tokens: int, layer: shape_grid.MoePoint | None = None,
             impls: tuple[str, ...] = IMPLS + tuple(workloads.GROUPED_MLP_VARIANTS)
             ) -> list[dict]:
  """MoELayer per `dropless_impl` (and grouped-MLP kernel variant) at
  `tokens`, on the headline layer or the grid point `layer`."""
  fields = {} if layer is None else _layer_fields(layer)
  layer = layer or HEADLINE
  inputs = workloads.moe_inputs(tokens, layer)
  out = []
  for mode in MODES:
    for impl in impls:
      if _over_budget():
        break
      variant = impl in workloads.GROUPED_MLP_VARIANTS
      layer_impl = "gmm" if variant else impl
      with (workloads.grouped_mlp_kernels(impl) if variant
            else contextlib.nullcontext()):
        row = harness.run_case(
            dict(section="moe", impl=impl, mode=mode, tokens=tokens, **fields),
            lambda layer_impl=layer_impl, mode=mode: workloads.moe_case(layer_impl, mode,
                                                                      *inputs, layer),
            **_timing())
      out.append(row)
      logging.info("%s", {k: row.get(k) for k in ("impl", "mode", "tokens", "median_ms")})
  for r in out:
    for peer in ("dense", "ragged_dot"):
      base = [b for b in out if b["impl"] == peer and b["mode"] == r["mode"]]
      if r.get("status") == "ok" and base and base[0].get("status") == "ok":
        r[f"ratio_vs_{peer}"] = r["median_ms"] / base[0]["median_ms"]
  return out


# --- capacity: one process per case -------------------------------------------


def capacity_case(impl: str, mode: str, tokens: int) -> dict:
  """Runs one capacity case in this process: its row, with the device's peak."""
  row = harness.run_case(dict(section="capacity", impl=impl, mode=mode, tokens=tokens),
                         lambda: workloads.moe_case(
                             impl, mode, *workloads.moe_inputs(tokens, HEADLINE), HEADLINE),
                         warmup=1, iters=_CAPACITY_ITERS.value)
  row["peak_mb"] = harness.peak_memory_mb()
  device = jax.devices()[0]
  limit = (device.memory_stats() or {}).get("bytes_limit")
  row["limit_mb"] = None if limit is None else limit / 1e6
  row["device_kind"] = device.device_kind
  return row


def token_counts(start: int, stop: int) -> list[int]:
  """start, 2 start, 4 start, ... up to stop."""
  if start < 1:
    raise ValueError(f"the first token count must be positive, got {start}")
  counts = []
  while start <= stop:
    counts.append(start)
    start *= 2
  return counts


def run_capacity_case(impl: str, mode: str, tokens: int, timeout_s: float) -> dict:
  """`capacity_case` in a fresh process. A process that dies, prints no row or
  runs past `timeout_s` still gives a row: status OOM where its output says
  so, else error, with the message."""
  config = dict(section="capacity", impl=impl, mode=mode, tokens=tokens)
  start = time.perf_counter()
  try:
    result = harness.run_in_fresh_process(
        "experiments.benchmark_kernel_moe",
        [f"--capacity_case={impl}:{mode}:{tokens}", f"--capacity_iters={_CAPACITY_ITERS.value}"],
        timeout_s=timeout_s)
  except subprocess.TimeoutExpired as e:
    result = {"status": "error", "message": f"case process timed out after {e.timeout:g} s"}
  row = {**config, **result}
  if row.get("status") not in harness.STATUSES:
    row["status"] = "error"
  if row["status"] == "error" and harness.looks_like_oom(str(row.get("message", ""))):
    row["status"] = "OOM"
  row["process_s"] = time.perf_counter() - start
  return row


def capacity_rows(write: Callable[[list[dict]], None]) -> list[dict]:
  """The capacity sweep and its summary; calls `write(rows)` after every case.

  Token counts go up together: each count runs every path still going before
  the next count starts, so a sweep cut by the budget has every path's largest
  count so far. This process never touches the device.
  """
  counts = token_counts(_CAPACITY_START.value, _CAPACITY_MAX.value)
  paths = [(mode, impl) for mode in _CAPACITY_MODES.value for impl in _CAPACITY_IMPLS.value]
  rows, stopped = [], set()
  start = time.perf_counter()
  for tokens in counts:
    for mode, impl in paths:
      if (mode, impl) in stopped:
        continue
      elapsed = time.perf_counter() - start
      if elapsed > _CAPACITY_BUDGET.value:
        logging.info("capacity: --capacity_budget_s=%s passed", _CAPACITY_BUDGET.value)
        return rows + capacity_summary(rows, counts)
      timeout = min(_CAPACITY_CASE_TIMEOUT.value, max(_CAPACITY_BUDGET.value - elapsed, 60))
      row = run_capacity_case(impl, mode, tokens, timeout)
      rows.append(row)
      write(rows)
      logging.info("%s", {k: row.get(k) for k in ("impl", "mode", "tokens", "status",
                                                   "median_ms", "peak_mb", "process_s")})
      if row["status"] != "ok":
        stopped.add((mode, impl))
  return rows + capacity_summary(rows, counts)


def capacity_summary(rows: list[dict], counts: list[int]) -> list[dict]:
  """One `capacity_max` row per (mode, impl) of the `capacity` rows: the
  largest count that ran ok (with its peak), the first that did not, and why
  the sweep stopped (that row's status, 'capacity_max' or 'budget')."""
  out = []
  cases = [r for r in rows if r["section"] == "capacity"]
  for mode, impl in dict.fromkeys((r["mode"], r["impl"]) for r in cases):
    mine = sorted((r for r in cases if r["mode"] == mode and r["impl"] == impl),
                  key=lambda r: r["tokens"])
    ok = [r for r in mine if r["status"] == "ok"]
    failed = next((r for r in mine if r["status"] != "ok"), None)
    best = ok[-1] if ok else {}
    if failed:
      stopped_by = failed["status"]
    elif best.get("tokens") == counts[-1]:
      stopped_by = "capacity_max"
    else:
      stopped_by = "budget"
    row = dict(section="capacity_max", impl=impl, mode=mode,
               max_ok_tokens=best.get("tokens"), peak_mb=best.get("peak_mb"),
               planned_peak_mb=best.get("planned_peak_mb"), median_ms=best.get("median_ms"),
               first_failed_tokens=failed and failed["tokens"],
               first_failed_status=failed and failed["status"],
               first_failed_message=failed and str(failed.get("message", ""))[:500],
               stopped_by=stopped_by)
    if best.get("peak_mb"):
      row["peak_kb_per_token"] = best["peak_mb"] * 1e3 / best["tokens"]
    out.append(row)
  return out


def capacity_grid(rows: list[dict]) -> list[dict]:
  """The `capacity` rows as (mode, tokens) x impl cells, for printing."""
  cases = [r for r in rows if r["section"] == "capacity"]
  grid = {}
  for r in cases:
    cell = r["status"]
    if cell == "ok":
      peak = r.get("peak_mb")
      memory = (f"{peak:.0f} MB" if peak is not None else
                f"plan {r['planned_peak_mb']:.0f} MB" if r.get("planned_peak_mb") else "")
      cell = f"{r['median_ms']:.4g} ms, {memory}".rstrip(", ")
    grid.setdefault((r["mode"], r["tokens"]), {})[r["impl"]] = cell
  return [dict(mode=mode, tokens=tokens, **cells)
          for (mode, tokens), cells in sorted(grid.items())]


# The printed table of each section (the capacity section prints three).
_TABLE_COLUMNS = {
    "check": ["case", "dtype", "rel_err_out", "rel_err_dlhs", "rel_err_drhs", "rel_err_dx",
              "rel_err_dw_in", "rel_err_dw_out", "rel_err_loss", "rel_err_grads"],
    "tiles": ["tiles", "kernel", "status", "median_ms", "tflops", "rel_err"],
    "op": ["impl", "mode", "status", "median_ms", "tflops",
           "fraction_of_dense_matmul_tflops", "ratio_vs_tokamax_ragged_dot"],
    "mlp": ["rows", "mode", "impl", "status", "median_ms", "tflops", "ratio_vs_unfused"],
    "parts": ["part", "tokens", "status", "median_ms"],
    "moe": ["tokens", "mode", "impl", "status", "median_ms", "ratio_vs_dense",
            "ratio_vs_ragged_dot"],
}


def _write_partial(rows: list[dict]) -> None:
  """The rows so far, without `harness.environment()` (it touches the device)."""
  os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
  with open(_OUTPUT.value, "w") as f:
    json.dump({"environment": "partial run: see the rows' device_kind", "rows": rows}, f,
              indent=1)


def grid_summary(rows: list[dict], points) -> list[dict]:
  """One row per (point, mode): the grouped matmul's times (Pallas over
  tokamax's: `pallas_vs_tokamax`) and the layer's ('auto' over its fastest
  path: `auto_vs_best`)."""
  out = []
  for layer in points:
    for mode in MODES:
      s = dict(section="grid_summary", **_layer_fields(layer), tokens=layer.tokens, mode=mode)
      for section, prefix in (("op", "op_"), ("moe", "moe_")):
        for r in rows:
          if (r.get("section") == section and r.get("point") == layer.name
              and r["mode"] == mode and r.get("status") == "ok"):
            s[f"{prefix}{r['impl']}_ms"] = r["median_ms"]
      if "op_pallas_ms" in s and "op_tokamax_ragged_dot_ms" in s:
        s["pallas_vs_tokamax"] = s["op_pallas_ms"] / s["op_tokamax_ragged_dot_ms"]
      paths = {k[len("moe_"):-len("_ms")]: v for k, v in s.items()
               if k.startswith("moe_") and k != "moe_auto_ms"}
      if paths:
        s["best_layer_impl"] = min(paths, key=paths.get)
        if "moe_auto_ms" in s:
          s["auto_vs_best"] = s["moe_auto_ms"] / paths[s["best_layer_impl"]]
      out.append(s)
  return out


def grid_main(sections: list[str]) -> None:
  """--grid: check once, then the op and moe sections at every MoE grid point
  (with --grid_check, each checked there before it is timed)."""
  if flags.FLAGS["sections"].present and set(sections) - set(GRID_SECTIONS):
    raise app.UsageError(f"--grid runs the sections {list(GRID_SECTIONS)}, got --sections="
                         f"{','.join(sections)}")
  unknown = set(_GRID_MOE_IMPLS.value) - set(IMPLS)
  if unknown:
    raise app.UsageError(f"--grid_moe_impls: unknown {sorted(unknown)}; known: {list(IMPLS)}")
  output = _OUTPUT.value if flags.FLAGS["output"].present else "/tmp/moe_grid.json"
  points = _GRID.points("moe", "smoke" if _SMOKE.value else None)
  logging.info("%d MoE grid points, writing %s", len(points), output)
  rows = check_rows(small=_SMOKE.value) if "check" in sections else []
  for layer in points:
    check = _GRID.check.value and not _over_budget()
    if "op" in sections:
      if check:
        rows += op_check_rows(layer)
      rows += op_rows(layer.rows, layer)
    if "moe" in sections:
      if check:
        rows += moe_check_rows(layer, tuple(_GRID_MOE_IMPLS.value))
      rows += moe_rows(layer.tokens, layer, tuple(_GRID_MOE_IMPLS.value))
    harness.write_rows(rows, output)  # a run cut short keeps its points
  rows += grid_summary(rows, points)
  harness.write_rows(rows, output)
  if "check" in sections:
    print(harness.format_table([r for r in rows if r["section"] == "check" and "grid" not in r],
                               _TABLE_COLUMNS["check"] + ["status", "message"]))
  if _GRID.check.value:
    print(harness.format_table(
        [r for r in rows if r["section"] == "check" and "grid" in r],
        ["point", "case", "impl", "status", "rel_err_out", "rel_err_dlhs", "rel_err_drhs",
         "rel_err_dparams", "rel_err_dx"]))
  print(harness.format_table(
      [r for r in rows if r["section"] == "grid_summary"],
      ["point", "mode", "op_pallas_ms", "op_tokamax_ragged_dot_ms", "op_ragged_dot_ms",
       "pallas_vs_tokamax", "moe_auto_ms", "best_layer_impl", "auto_vs_best"]))
  print(f"{len(points)} points, {time.perf_counter() - _START:.0f} s; rows in {output}")


def main(argv):
  del argv
  global _budget_start
  if _CAPACITY_CASE.value:
    impl, mode, tokens = _CAPACITY_CASE.value.split(":")
    print(json.dumps(capacity_case(impl, mode, int(tokens))), flush=True)
    return
  sections = _SECTIONS.value
  unknown = set(sections) - set(SECTIONS)
  if unknown:
    raise ValueError(f"--sections: unknown {sorted(unknown)}; choose from {list(SECTIONS)}")
  if _GRID.grid.value:
    grid_main(sections)
    return
  smoke = _SMOKE.value
  tokens_list = [256] if smoke else [int(t) for t in _TOKENS.value]
  gmm_rows = 1024 if smoke else _GMM_ROWS.value
  rows = []
  if "capacity" in sections:
    rows += capacity_rows(_write_partial)
    _budget_start = time.perf_counter()
  if "check" in sections:
    rows += check_rows(small=smoke)
  if "tiles" in sections:
    rows += tile_rows(gmm_rows)
  if "op" in sections:
    rows += op_rows(gmm_rows)
  if "mlp" in sections:
    for mlp_rows_count in ([1024] if smoke else _MLP_ROWS.value):
      rows += mlp_rows(int(mlp_rows_count))
  if "parts" in sections:
    rows += part_rows(tokens_list[-1])
  if "moe" in sections:
    for tokens in tokens_list:
      rows += moe_rows(tokens)
  harness.write_rows(rows, _OUTPUT.value)
  for section, columns in _TABLE_COLUMNS.items():
    if section in sections:
      print(harness.format_table([r for r in rows if r["section"] == section], columns))
  if "capacity" in sections:
    print(harness.format_table([r for r in rows if r["section"] == "capacity"],
                               ["mode", "impl", "tokens", "status", "median_ms", "peak_mb",
                                "planned_peak_mb", "limit_mb", "process_s"]))
    print(harness.format_table(capacity_grid(rows),
                               ["mode", "tokens", *_CAPACITY_IMPLS.value]))
    print(harness.format_table([r for r in rows if r["section"] == "capacity_max"],
                               ["mode", "impl", "max_ok_tokens", "peak_mb", "planned_peak_mb",
                                "peak_kb_per_token", "first_failed_tokens",
                                "first_failed_status", "stopped_by"]))
  print(f"total {time.perf_counter() - _START:.1f} s")


if __name__ == "__main__":
  app.run(main)
