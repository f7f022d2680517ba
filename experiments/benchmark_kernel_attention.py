"""Attention kernels on one GPU: flex (ours) vs cuDNN, XLA, JAX's Pallas mha and tokamax.

Times the forward and the forward+backward (gradient of a scalar sum with
respect to q, k and v) of every implementation on the headline shapes
(`DEFAULT_SHAPES`, the ones the performance pages show), in one process, and
writes JSON rows (harness format) with TFLOP/s and ratios
against cuDNN and against JAX's Pallas `mha` at its best block sizes (a small
sweep in the same run). With --check it first compares flex with the f32
reference on the GPU (forward and gradients, masks, GQA, odd lengths). Shapes
of at most `CHAINED_MAX_SCORES` scores (T 1024 at B 8, N 8) run ten calls per
executable (`workloads.chained`, `--chain` to set), so that calls of tens of
microseconds are timed on the device rather than as the host's dispatch.

Every implementation is a typed config (`workloads.ATTENTION` and this
program's `Tokamax`, named by `--impls`); flex's kernels on other tiles are
configs too, given as JSON objects of their fields:

  python3 -m experiments.benchmark_kernel_attention --check    # docs/benchmarks/attention.json
  python3 -m experiments.benchmark_kernel_attention --shapes b8_n8_t4096_h32 \\
      --impls flex,cudnn --output /tmp/attention_tiles.json \\
      --mosaic_fwd '{"block_k": 256, "ping_pong": false, "persistent": true}'
  python3 -m experiments.benchmark_kernel_attention --grid --grid_subset quick \\
      --output /tmp/attention_grid.json
  JAX_PLATFORMS=cpu python3 -m experiments.benchmark_kernel_attention --smoke \\
      --impls flex,xla,tokamax_mosaic,tokamax_triton --output /tmp/attention_cpu.json

tokamax (openxla/tokamax, `tokamax.dot_product_attention` with
implementation 'mosaic' or 'triton') is an optional peer: it is imported when
its rows are built, and where it is not installed (or declines the inputs)
its rows say 'unsup' with the reason.

`--grid` times the attention points of `shape_grid` (head size x length x
{full, causal, sliding window, GQA 8:1, cross-attention}, bf16 and a few f32)
instead of the headline shapes, for `--grid_impls`: 'flex' (our kernel),
'cudnn', 'xla', 'default' (`probjax_hk.dot_product_attention`'s own choice)
and tokamax's two; each (point, mode) gets a summary row with the
implementation the default picks there, its time over the fastest of ours
(flex, cuDNN, XLA) and over the fastest peer (tokamax, cuDNN).
`--grid_check` compares every implementation at every point with the f32
reference (forward and gradients) before timing it there.
"""

import dataclasses
import functools
import json
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import checks
from experiments import harness
from experiments import shape_grid
from experiments import workloads
from ops.flex_attention import api as flex_api
from ops.flex_attention import configs as flex_configs
from probjax_hk import attention as pk_attention

# tokamax's implementations this program times: row name -> its `implementation`.
TOKAMAX_IMPLEMENTATIONS = {"tokamax_mosaic": "mosaic", "tokamax_triton": "triton"}
# What --grid_impls may name (`grid_attention`).
GRID_IMPLS = ("flex", "default", "cudnn", "xla", *TOKAMAX_IMPLEMENTATIONS)

_OUTPUT = flags.DEFINE_string("output", "docs/benchmarks/attention.json",
                              "JSON path (the curated suite file; another for trial runs). "
                              "With --grid: /tmp/attention_grid.json unless given.")
_SHAPES = flags.DEFINE_list("shapes", None, "Shape names (default: DEFAULT_SHAPES, "
                            "the headline shapes).")
_IMPLS = flags.DEFINE_list(
    "impls", ["flex", "cudnn", "xla", "mha", *TOKAMAX_IMPLEMENTATIONS],
    "Implementations, by name: " + ", ".join([*workloads.ATTENTION, *TOKAMAX_IMPLEMENTATIONS])
    + "; 'mha' is JAX's mha at its defaults and, with --mha_sweep, at the tiles of "
    "`workloads.MHA_SWEEP`.")
_TRITON_FWD = flags.DEFINE_multi_string(
    "triton_fwd", [], "Also time flex with its forward on the Triton kernel on these "
    "tiles: a JSON object of `configs.TritonConfig`'s fields (repeatable).")
_MOSAIC_FWD = flags.DEFINE_multi_string(
    "mosaic_fwd", [], "Also time flex with every forward on the Mosaic GPU kernel on "
    "these tiles: a JSON object of `configs.MosaicConfig`'s fields, and "
    "optionally \"fwd_softmax\" (repeatable).")
_MOSAIC_BWD = flags.DEFINE_multi_string(
    "mosaic_bwd", [], "Also time flex with its backward on the Mosaic GPU kernel on "
    "these tiles: a JSON object of `configs.MosaicBackwardConfig`'s fields "
    "(repeatable).")
_CHECK = flags.DEFINE_bool("check", False, "Check flex against the reference first.")
_CHECK_CASES = flags.DEFINE_list("check_cases", None, "Indices of the check cases to run.")
_CHECK_MOSAIC_BWD = flags.DEFINE_multi_string(
    "check_mosaic_bwd", [], "Also check flex with its backward on the Mosaic GPU "
    "kernel on these tiles, a JSON object as --mosaic_bwd takes (for the 16-bit cases "
    "whose head size they fit; repeatable).")
_CHECK_MOSAIC_FWD = flags.DEFINE_string(
    "check_mosaic_fwd", None, "Also check flex with its forward on the Mosaic GPU "
    "kernel on these tiles, a JSON object of `configs.MosaicConfig`'s fields "
    "(for the 16-bit cases it takes).")
_CHECK_FWD_SOFTMAX = flags.DEFINE_enum(
    "check_fwd_softmax", None, flex_configs.FWD_SOFTMAX, "Also check flex with its "
    "forward on the Triton kernel with this softmax (`FlexConfig.fwd_softmax`) in "
    "every case.")
_CHECK_REFRESH = flags.DEFINE_enum(
    "check_refresh", None, flex_configs.REFRESH,
    "Also check flex with this `FlexConfig.refresh` in every case.")
_CHAIN = flags.DEFINE_integer(
    "chain", None, "Calls per executable (workloads.chained): with more than one, "
    "short calls are timed on the device instead of as host dispatches; times "
    "are per call. Default: `chain_for` of the shape.")
_MHA_SWEEP = flags.DEFINE_bool("mha_sweep", True, "Sweep JAX mha's block sizes.")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls per case.")
_MODES = flags.DEFINE_list("modes", ["fwd", "fwd+bwd"], "Modes to time.")
_CAUSAL = flags.DEFINE_enum(
    "causal", None, ["true", "false"],
    "Time only the causal (true) or only the full (false) calls of each shape "
    "(default: the shape's own).")
_BUDGET_S = flags.DEFINE_float("budget_s", 1e9, "Stop starting new cases after this.")
_SMOKE = flags.DEFINE_bool(
    "smoke", False, "Tiny shapes (`SMOKE_SHAPES`; with --grid the grid's 'smoke' subset) "
    "and two timed calls: every path of the program on a CPU.")
_GRID = shape_grid.define_flags()
_GRID_IMPLS = flags.DEFINE_list(
    "grid_impls", ["flex", "cudnn", "xla", *TOKAMAX_IMPLEMENTATIONS],
    "With --grid: the implementations, any of " + ", ".join(GRID_IMPLS) + ".")

# name: (B, N, T, H, causal values); keys = queries, K = N.
SHAPES = {
    "b8_n8_t4096_h32": (8, 8, 4096, 32, (False, True)),
    "b8_n8_t1024_h32": (8, 8, 1024, 32, (False,)),
    # Where `FlexConfig.refresh='auto'` and the score limits change over
    # (configs.py).
    "b8_n8_t512_h32": (8, 8, 512, 32, (False, True)),
    "b8_n8_t2048_h32": (8, 8, 2048, 32, (False,)),
    "b32_n8_t1024_h32": (32, 8, 1024, 32, (False,)),
    "b2_n8_t2048_h32": (2, 8, 2048, 32, (False,)),
    "b8_n8_t256_h32": (8, 8, 256, 32, (False, True)),
    "b16_n8_t512_h32": (16, 8, 512, 32, (False, True)),
    "b4_n8_t1024_h32": (4, 8, 1024, 32, (False, True)),
    # Short H64 calls, where the H64 entry's causal calls take other tiles
    # (`FlexConfig.mosaic_fwd_short_bounded`).
    "b4_n16_t1024_h64": (4, 16, 1024, 64, (False, True)),
    "b4_n16_t512_h64": (4, 16, 512, 64, (True,)),
    "b4_n16_t2048_h64": (4, 16, 2048, 64, (True,)),
    "b4_n16_t4096_h64": (4, 16, 4096, 64, (False, True)),
    "b2_n16_t8192_h128": (2, 16, 8192, 128, (False, True)),
    # Beyond cuDNN's head sizes: flex's two forwards.
    "b2_n16_t4096_h256": (2, 16, 4096, 256, (False, True)),
}
DEFAULT_SHAPES = ("b8_n8_t4096_h32", "b8_n8_t1024_h32", "b4_n16_t4096_h64",
                  "b2_n16_t8192_h128")
# --smoke: a CPU run (flex in Pallas interpret mode), and the check's smallest case.
SMOKE_SHAPES = {"b1_n2_t128_h32": (1, 2, 128, 32, (False, True))}
SMOKE_CHECK_CASES = ("1",)

# Calls of at most this many scores (B x N x T x T) run ten to an executable by
# default: one takes 15-50 us on an H200, less than the host's dispatch of an
# executable, so one call per executable would time the host (BUILD_NOTES.md,
# "flex_attention").
CHAINED_MAX_SCORES = 2**26


def chain_for(b: int, n: int, t: int, s: int | None = None) -> int:
  """Calls per executable for a shape (S = T unless given), unless --chain says."""
  return 10 if b * n * t * (t if s is None else s) <= CHAINED_MAX_SCORES else 1


def _flops(b, n, t, h, causal, mode):
  fwd = 4.0 * b * n * t * t * h * (0.5 if causal else 1.0)
  return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


@dataclasses.dataclass(frozen=True)
class Tokamax(workloads._Attention):  # pylint: disable=protected-access
  """`tokamax.dot_product_attention` with this `implementation`: 'mosaic'
  (its Mosaic GPU kernels) or 'triton' (its Pallas Triton ones)."""
  implementation: str

  @property
  def name(self) -> str:
    return f"tokamax_{self.implementation}"

  def fn(self, head_dim, causal):
    del head_dim
    return tokamax_attention(self.implementation, is_causal=causal)


def tokamax_attention(implementation: str, **options):
  """`(q, k, v) -> tokamax.dot_product_attention(q, k, v, **options)` on this
  implementation.

  tokamax is imported here, not with the program: where it is missing this
  raises `harness.Unsupported` with the import error, and the function raises
  it when traced on inputs the implementation declines (its
  NotImplementedError), so either case is a row with status 'unsup'.
  """
  try:
    import tokamax  # pylint: disable=g-import-not-at-top
  except ImportError as exc:
    raise harness.Unsupported(f"tokamax is not installed: {type(exc).__name__}: {exc}") from exc

  def attend(q, k, v):
    try:
      return tokamax.dot_product_attention(q, k, v, implementation=implementation, **options)
    except NotImplementedError as exc:
      raise harness.Unsupported(f"tokamax implementation={implementation!r}: {exc}") from exc
  return attend


# Every implementation --impls can name.
ATTENTION = {**workloads.ATTENTION,
             **{name: Tokamax(impl) for name, impl in TOKAMAX_IMPLEMENTATIONS.items()}}


def _tokamax_for_check(implementation: str):
  """A check case's options -> tokamax's attention on them (harness.Unsupported
  for the segment ids, which it does not take)."""
  def attend(opts):
    if "segment_ids" in opts:
      raise harness.Unsupported("tokamax.dot_product_attention takes no segment_ids")
    return tokamax_attention(implementation, **opts)
  return attend


def _check_rows():
  """flex (and tokamax) vs the f32 reference on the GPU: forward and gradients."""
  cases = [
      # B, T, S, N, K, H, dtype, options
      (2, 300, 300, 4, 2, 80, jnp.bfloat16, dict(is_causal=True, local_window_size=(64, 0),
                                                  key_value_seq_lengths=np.array([300, 211]))),
      (1, 1, 33, 4, 1, 32, jnp.float32, {}),
      (2, 256, 256, 8, 2, 64, jnp.bfloat16, dict(segment_ids=np.repeat(
          np.array([[0] * 100 + [1] * 156]), 2, 0))),
      (1, 512, 384, 2, 2, 128, jnp.float16, dict(is_causal=True)),
      (1, 128, 128, 2, 1, 256, jnp.bfloat16, dict(local_window_size=(16, 16))),
      (8, 1024, 1024, 8, 8, 32, jnp.bfloat16, dict(is_causal=True)),
      (1, 256, 256, 2, 1, 256, jnp.float32, dict(is_causal=True)),
      (2, 1024, 1024, 8, 4, 64, jnp.bfloat16, {}),  # the Mosaic forward's H64 full case
      (1, 1024, 1024, 4, 2, 256, jnp.bfloat16, {}),  # and its H256 one
      (2, 1024, 1024, 8, 4, 32, jnp.bfloat16, {}),  # and its H32 one
      # The H64 entry's short causal walk (persistent, query prefetch), GQA.
      (4, 1024, 1024, 16, 8, 64, jnp.bfloat16, dict(is_causal=True)),
  ]
  indices = _CHECK_CASES.value or (SMOKE_CHECK_CASES if _SMOKE.value else None)
  if indices:
    cases = [cases[int(i)] for i in indices]
  rows = _check_cases(cases, "table")
  variants = []  # (name, the fields of the table's config to replace)
  if _CHECK_MOSAIC_FWD.value:
    tiles = workloads.parse_config(flex_configs.MosaicConfig, _CHECK_MOSAIC_FWD.value)
    variants.append((workloads.FlexMosaicForward(tiles).name, dict(mosaic_fwd=tiles)))
  for text in _CHECK_MOSAIC_BWD.value:
    tiles = workloads.parse_config(flex_configs.MosaicBackwardConfig, text)
    variants.append((workloads.FlexMosaicBackward(tiles).name, dict(mosaic_bwd=tiles)))
  if _CHECK_FWD_SOFTMAX.value:
    variants.append((workloads.FlexTritonForward(fwd_softmax=_CHECK_FWD_SOFTMAX.value).name,
                     dict(fwd_softmax=_CHECK_FWD_SOFTMAX.value, mosaic_fwd=None)))
  if _CHECK_REFRESH.value:
    variants.append((workloads.FlexRefresh(_CHECK_REFRESH.value).name,
                     dict(refresh=_CHECK_REFRESH.value)))
  for name, changes in variants:  # The table's config with these fields replaced.
    with workloads.flex_config_changes(**changes):
      rows += _check_cases(cases, name)
  for name, implementation in TOKAMAX_IMPLEMENTATIONS.items():
    rows += _check_cases(cases, name, _tokamax_for_check(implementation))
  return rows


def _flex_for_check(opts):
  return functools.partial(flex_api.flex_attention, implementation="pallas", **opts)


def _check_cases(cases, variant, attend_for=_flex_for_check):
  """Checks each case: `attend_for(options)` (flex's kernel path by default,
  on its config for the case as `variant` names it) against the reference."""
  rows = []
  for b, t, s, n, kh, h, dtype, opts in cases:
    opts = {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in opts.items()}
    q, k, v, w = workloads.attention_inputs(b, t, s, n, kh, h, dtype)
    ref = functools.partial(flex_api.flex_attention, implementation="xla", **opts)
    row = dict(kind="check", variant=variant, shape=[b, t, s, n, kh, h],
               dtype=jnp.dtype(dtype).name, options=sorted(opts))
    try:
      attend = attend_for(opts)
      want = checks.attention_reference_outputs(ref, w, q, k, v)
      row.update(status="ok", **checks.attention_errors(attend, want, q, k, v, w))
    except harness.Unsupported as exc:
      row.update(status="unsup", message=str(exc)[:1500])
    except Exception as exc:  # Record and go on: the timing still matters.
      row.update(status="error", message=f"{type(exc).__name__}: {str(exc)[:1500]}")
    logging.info("check %s", row)
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def main(argv):
  del argv
  if _GRID.grid.value:
    grid_main()
    return
  start = time.time()
  shapes = {**SHAPES, **SMOKE_SHAPES}
  names = _SHAPES.value or list(SMOKE_SHAPES if _SMOKE.value else DEFAULT_SHAPES)
  unknown = [name for name in names if name not in shapes]
  if unknown:
    raise app.UsageError(f"--shapes: unknown {unknown}; known: {sorted(shapes)}")
  impls = implementations()
  rows = _check_rows() if _CHECK.value else []
  for name in names:
    b, n, t, h, causals = shapes[name]
    if _CAUSAL.value is not None:
      causals = [c for c in causals if c == (_CAUSAL.value == "true")]
    for causal in causals:
      for mode in _MODES.value:
        for impl in impls:
          config = dict(kind="time", shape=name, B=b, N=n, T=t, H=h, causal=causal,
                        mode=mode, impl=impl.name)
          if time.time() - start > _BUDGET_S.value:
            row = dict(config, status="unsup", message="time budget")
          else:
            iters = _iters(impl.name)
            chain = _chain(b, n, t, t)
            case = workloads.attention_case(impl, (b, n, t, h), causal, mode, chain=chain)
            row = dict(harness.run_case(config, case, iters=iters), chain=chain)
            if row["status"] == "ok":  # per call
              row["median_ms"] /= chain
              row["min_ms"] /= chain
              row["tflops"] = _flops(b, n, t, h, causal, mode) / (row["median_ms"] * 1e9)
          print(json.dumps({k: row.get(k) for k in ("shape", "causal", "mode", "impl",
                                                     "status", "median_ms", "message")}),
                flush=True)
          rows.append(row)
  _add_ratios(rows, {impl.name: _family(impl) for impl in impls})
  harness.write_rows(rows, _OUTPUT.value)
  summary = [r for r in rows if r.get("kind") == "summary"]
  print(harness.format_table(summary, ["shape", "causal", "mode", "flex_ms", "cudnn_ms",
                                       "xla_ms", "mha_best_ms", "mha_best", "flex_tflops",
                                       "flex_vs_cudnn", "flex_vs_mha_best"]))
  if any("tokamax_best_ms" in r for r in summary):
    print(harness.format_table(summary, ["shape", "causal", "mode", "flex_ms",
                                         "tokamax_mosaic_ms", "tokamax_triton_ms",
                                         "flex_vs_tokamax_best"]))
  if any("flex_mosaic_bwd_best_ms" in r for r in summary):
    print(harness.format_table(summary, [
        "shape", "causal", "mode", "flex_ms", "flex_mosaic_bwd_best",
        "flex_mosaic_bwd_best_ms", "cudnn_ms", "flex_vs_cudnn",
        "flex_mosaic_bwd_best_vs_cudnn"]))
  if any("flex_triton_ms" in r or "mgpu_best_ms" in r for r in summary):
    print(harness.format_table(summary, [
        "shape", "causal", "mode", "flex_ms", "flex_triton_ms", "flex_mosaic_best",
        "flex_mosaic_best_ms", "mgpu_best", "mgpu_best_ms", "cudnn_ms",
        "flex_triton_vs_cudnn", "mgpu_best_vs_cudnn"]))


# --- the shape grid -----------------------------------------------------------

# The implementations of ours (`dot_product_attention` can pick) and the peers
# the summary rows compare the default with.
_OURS = ("flex", "cudnn", "xla")
_PEERS = ("tokamax_mosaic", "tokamax_triton", "cudnn")


def grid_attention(name: str, point: shape_grid.AttentionPoint, q, k):
  """`(q, k, v) -> out` of implementation `name` (one of `GRID_IMPLS`) with
  `point`'s mask; `harness.Unsupported`, with the reason, where the
  implementation cannot take the point (cuDNN above H 128 or in f32, say)."""
  options = dict(is_causal=point.is_causal, local_window_size=point.window)
  if name in TOKAMAX_IMPLEMENTATIONS:
    return tokamax_attention(TOKAMAX_IMPLEMENTATIONS[name], **options)
  if name in ("flex", "cudnn"):
    try:
      pk_attention.choose_attention_implementation(q, k, k, implementation=name, **options)
    except ValueError as exc:
      raise harness.Unsupported(str(exc)) from exc
  if name == "flex":
    return functools.partial(flex_api.flex_attention, implementation="pallas", **options)
  if name == "default":
    return functools.partial(pk_attention.dot_product_attention, **options)
  if name in ("cudnn", "xla"):
    return functools.partial(jax.nn.dot_product_attention, implementation=name, **options)
  raise ValueError(f"unknown grid implementation {name!r}; known: {GRID_IMPLS}")


def grid_inputs(point: shape_grid.AttentionPoint, seed: int = 0):
  """q [B, T, N, H] and k, v [B, S, K, H] of `point`, standard normal, in its dtype."""
  dtype = jnp.dtype(point.dtype)
  size = point.shape
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(keys[0], (size["B"], size["T"], size["N"], size["H"]), dtype)
  k, v = (jax.random.normal(key, (size["B"], size["S"], size["K"], size["H"]), dtype)
          for key in keys[1:])
  return q, k, v


def grid_case(name: str, point: shape_grid.AttentionPoint, mode: str, chain: int = 1):
  """A harness build thunk: (jitted forward or gradient of the output's sum
  w.r.t. q, k, v, `chain` calls per executable; (q, k, v))."""
  def build():
    q, k, v = grid_inputs(point)
    attend = grid_attention(name, point, q, k)
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))
    fn = attend if mode == "fwd" else jax.grad(loss, argnums=(0, 1, 2))
    return jax.jit(workloads.chained(fn, chain)), (q, k, v)
  return build


def default_choice(point: shape_grid.AttentionPoint) -> str:
  """What `dot_product_attention(implementation=None)` runs at `point` here."""
  size = point.shape
  dtype = jnp.dtype(point.dtype)
  q = jax.ShapeDtypeStruct((size["B"], size["T"], size["N"], size["H"]), dtype)
  k = jax.ShapeDtypeStruct((size["B"], size["S"], size["K"], size["H"]), dtype)
  return pk_attention.choose_attention_implementation(
      q, k, k, is_causal=point.is_causal, local_window_size=point.window)


def _point_fields(point: shape_grid.AttentionPoint) -> dict:
  return dict(grid="attention", point=point.name, variant=point.variant, dtype=point.dtype,
              causal=point.is_causal, window=point.window, **point.shape)


def grid_check_rows(points, names) -> list[dict]:
  """Every implementation in `names` at every point against the f32 reference
  (flex's dense XLA path): forward and gradient errors."""
  rows = []
  for point in points:
    q, k, v = grid_inputs(point, seed=1)
    w = jax.random.normal(jax.random.PRNGKey(2), q.shape, jnp.float32)
    want = checks.attention_reference_outputs(functools.partial(
        flex_api.flex_attention, implementation="xla", is_causal=point.is_causal,
        local_window_size=point.window), w, q, k, v)
    for name in names:
      row = harness.check_row(
          dict(kind="check", impl=name, **_point_fields(point)),
          lambda name=name: checks.attention_errors(grid_attention(name, point, q, k), want,
                                                   q, k, v, w))
      print(json.dumps({f: row.get(f) for f in ("point", "impl", "status", "fwd_rel", "dq_rel",
                                                 "dk_rel", "dv_rel", "message")}), flush=True)
      rows.append(row)
  return rows


def grid_summary(rows: list[dict], points) -> list[dict]:
  """One row per (point, mode): each implementation's time, what the default
  picks there (`default_impl`) and its time over the fastest of ours
  (`default_vs_best_ours`) and over the fastest peer (`default_vs_best_peer`)."""
  timed = {}
  for r in rows:
    if r.get("kind") == "time" and r.get("status") == "ok":
      timed.setdefault((r["point"], r["mode"]), {})[r["impl"]] = r["median_ms"]
  out = []
  for point in points:
    for mode in _MODES.value:
      ms = timed.get((point.name, mode))
      if not ms:
        continue
      s = dict(kind="summary", **_point_fields(point), mode=mode,
               **{f"{name}_ms": t for name, t in ms.items()})
      s["default_impl"] = default_choice(point)
      default_ms = ms.get("default", ms.get(s["default_impl"]))
      for label, names in (("ours", _OURS), ("peer", _PEERS)):
        times = {n: ms[n] for n in names if n in ms}
        if times:
          s[f"best_{label}"] = min(times, key=times.get)
          s[f"best_{label}_ms"] = times[s[f"best_{label}"]]
          if default_ms is not None:
            s[f"default_vs_best_{label}"] = default_ms / s[f"best_{label}_ms"]
      out.append(s)
  return out


def grid_main():
  """--grid: the attention points of `shape_grid` for --grid_impls."""
  unknown = [n for n in _GRID_IMPLS.value if n not in GRID_IMPLS]
  if unknown:
    raise app.UsageError(f"--grid_impls: unknown {unknown}; known: {list(GRID_IMPLS)}")
  points = _GRID.points("attention", "smoke" if _SMOKE.value else None)
  output = _OUTPUT.value if flags.FLAGS["output"].present else "/tmp/attention_grid.json"
  logging.info("%d attention grid points, writing %s", len(points), output)
  start = time.time()
  rows = []
  for point in points:
    if _GRID.check.value:
      rows += grid_check_rows([point], _GRID_IMPLS.value)
    size = point.shape
    for mode in _MODES.value:
      for name in _GRID_IMPLS.value:
        config = dict(kind="time", **_point_fields(point), mode=mode, impl=name)
        if time.time() - start > _BUDGET_S.value:
          row = dict(config, status="unsup", message="time budget")
        else:
          chain = _chain(size["B"], size["N"], size["T"], size["S"])
          row = dict(harness.run_case(config, grid_case(name, point, mode, chain),
                                      iters=_iters(name)), chain=chain)
          if row["status"] == "ok":  # per call
            row["median_ms"] /= chain
            row["min_ms"] /= chain
            row["tflops"] = point.flops(mode) / (row["median_ms"] * 1e9)
        print(json.dumps({k: row.get(k) for k in ("point", "mode", "impl", "status",
                                                   "median_ms", "message")}), flush=True)
        rows.append(row)
    harness.write_rows(rows, output)  # a run cut short keeps its points
  rows += grid_summary(rows, points)
  harness.write_rows(rows, output)
  print(harness.format_table(
      [r for r in rows if r["kind"] == "summary"],
      ["point", "mode", *(f"{n}_ms" for n in _GRID_IMPLS.value), "default_impl",
       "best_ours", "default_vs_best_ours", "best_peer", "default_vs_best_peer"]))
  print(f"{len(points)} points, {time.time() - start:.0f} s; rows in {output}")


def _iters(impl: str) -> int:
  """Timed samples of a case (XLA's calls are long: half as many)."""
  if _SMOKE.value:
    return 2
  return max(5, _ITERS.value // 2) if impl == "xla" else _ITERS.value


def _chain(b: int, n: int, t: int, s: int) -> int:
  """Calls per executable: --chain, else `chain_for` (one under --smoke)."""
  if _CHAIN.value is not None:
    return _CHAIN.value
  return 1 if _SMOKE.value else chain_for(b, n, t, s)


def implementations() -> list:
  """The typed implementations the flags ask for, in order."""
  impls = []
  for name in _IMPLS.value:
    if name == "mha":
      impls += list(workloads.MHA_SWEEP) if _MHA_SWEEP.value else [workloads.PallasMha()]
    elif name in ATTENTION:
      impls.append(ATTENTION[name])
    else:
      raise app.UsageError(f"--impls: unknown {name!r}; known: {sorted(ATTENTION) + ['mha']}")
  for text in _TRITON_FWD.value:
    impls.append(workloads.FlexTritonForward(
        tiles=workloads.parse_config(flex_configs.TritonConfig, text)))
  for text in _MOSAIC_FWD.value:
    fields = json.loads(text)
    softmax = fields.pop("fwd_softmax", None) if isinstance(fields, dict) else None
    impls.append(workloads.FlexMosaicForward(
        workloads.parse_config(flex_configs.MosaicConfig, fields), fwd_softmax=softmax))
  for text in _MOSAIC_BWD.value:
    impls.append(workloads.FlexMosaicBackward(
        workloads.parse_config(flex_configs.MosaicBackwardConfig, text)))
  return impls


# The sweeps whose best member a summary row reports.
_FAMILIES = {workloads.PallasMha: "mha", workloads.MosaicGpuAttention: "mgpu",
             workloads.FlexMosaicForward: "flex_mosaic",
             workloads.FlexMosaicBackward: "flex_mosaic_bwd"}


def _family(impl) -> str | None:
  """The sweep an implementation belongs to (None: not a sweep)."""
  return _FAMILIES.get(type(impl))


def _add_ratios(rows, families: dict):
  """One summary row per (shape, causal, mode): times and ratios of one run;
  `families` maps each implementation's name to its sweep (`_family`)."""
  groups = {}
  for r in rows:
    if r.get("kind") == "time" and r.get("status") == "ok":
      groups.setdefault((r["shape"], r["causal"], r["mode"]), {})[r["impl"]] = r
  for (shape, causal, mode), by_impl in groups.items():
    s = dict(kind="summary", shape=shape, causal=causal, mode=mode)
    for impl in ("flex", "flex_triton", "cudnn", "xla", *TOKAMAX_IMPLEMENTATIONS):
      if impl in by_impl:
        s[f"{impl}_ms"] = by_impl[impl]["median_ms"]
    tokamax = {k: s[f"{k}_ms"] for k in TOKAMAX_IMPLEMENTATIONS if f"{k}_ms" in s}
    if tokamax:
      s["tokamax_best"] = min(tokamax, key=tokamax.get)
      s["tokamax_best_ms"] = tokamax[s["tokamax_best"]]
    for family in ("mha", "mgpu", "flex_mosaic", "flex_mosaic_bwd"):  # best of each sweep
      times = {k: v["median_ms"] for k, v in by_impl.items() if families.get(k) == family}
      if times:
        s[f"{family}_best"] = min(times, key=times.get)
        s[f"{family}_best_ms"] = times[s[f"{family}_best"]]
    for name in ("flex", "flex_triton", "mgpu_best", "mha_best", "flex_mosaic_bwd_best"):
      if f"{name}_ms" in s and "cudnn_ms" in s:
        s[f"{name}_vs_cudnn"] = s[f"{name}_ms"] / s["cudnn_ms"]
    if "flex" in by_impl:
      s["flex_tflops"] = by_impl["flex"]["tflops"]
      if "mha_best_ms" in s:
        s["flex_vs_mha_best"] = s["flex_ms"] / s["mha_best_ms"]
      if "tokamax_best_ms" in s:
        s["flex_vs_tokamax_best"] = s["flex_ms"] / s["tokamax_best_ms"]
    rows.append(s)


if __name__ == "__main__":
  app.run(main)
