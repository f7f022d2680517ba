"""Attention kernels on one GPU: flex (ours) vs cuDNN, XLA and JAX's Pallas mha.

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

Every implementation is a typed config (`workloads.ATTENTION`, named by
`--impls`); flex's kernels on other tiles are configs too, given as JSON
objects of their fields:

  python3 -m experiments.benchmark_kernel_attention --check    # docs/benchmarks/attention.json
  python3 -m experiments.benchmark_kernel_attention --shapes b8_n8_t4096_h32 \\
      --impls flex,cudnn --output /tmp/attention_tiles.json \\
      --mosaic_fwd '{"block_k": 256, "ping_pong": false, "persistent": true}'
"""

import functools
import json
import time
from unittest import mock

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from experiments import workloads
from ops.flex_attention import api as flex_api
from ops.flex_attention import configs as flex_configs
from ops.flex_attention import mosaic
from ops.flex_attention import mosaic_backward

_OUTPUT = flags.DEFINE_string("output", "docs/benchmarks/attention.json",
                              "JSON path (the curated suite file; another for trial runs).")
_SHAPES = flags.DEFINE_list("shapes", None, "Shape names (default: DEFAULT_SHAPES, "
                            "the headline shapes).")
_IMPLS = flags.DEFINE_list(
    "impls", ["flex", "cudnn", "xla", "mha"],
    "Implementations, by name: " + ", ".join(workloads.ATTENTION) + "; 'mha' is JAX's "
    "mha at its defaults and, with --mha_sweep, at the tiles of `workloads.MHA_SWEEP`.")
_TRITON_FWD = flags.DEFINE_multi_string(
    "triton_fwd", [], "Also time flex with its forward on the Triton kernel on these "
    "tiles: a JSON object of `configs.KernelConfig`'s fields (repeatable).")
_MOSAIC_FWD = flags.DEFINE_multi_string(
    "mosaic_fwd", [], "Also time flex with every forward on the Mosaic GPU kernel on "
    "these tiles: a JSON object of `mosaic.MosaicForwardConfig`'s fields, and "
    "optionally \"fwd_softmax\" (repeatable).")
_MOSAIC_BWD = flags.DEFINE_multi_string(
    "mosaic_bwd", [], "Also time flex with its backward on the Mosaic GPU kernel on "
    "these tiles: a JSON object of `mosaic_backward.MosaicBackwardConfig`'s fields "
    "(repeatable).")
_CHECK = flags.DEFINE_bool("check", False, "Check flex against the reference first.")
_CHECK_CASES = flags.DEFINE_list("check_cases", None, "Indices of the check cases to run.")
_CHECK_MOSAIC_BWD = flags.DEFINE_multi_string(
    "check_mosaic_bwd", [], "Also check flex with its backward on the Mosaic GPU "
    "kernel on these tiles, a JSON object as --mosaic_bwd takes (for the 16-bit cases "
    "whose head size they fit; repeatable).")
_CHECK_MOSAIC_FWD = flags.DEFINE_string(
    "check_mosaic_fwd", None, "Also check flex with its forward on the Mosaic GPU "
    "kernel on these tiles, a JSON object of `mosaic.MosaicForwardConfig`'s fields "
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

# Calls of at most this many scores (B x N x T x T) run ten to an executable by
# default: one takes 15-50 us on an H200, less than the host's dispatch of an
# executable, so one call per executable would time the host (BUILD_NOTES.md,
# "flex_attention").
CHAINED_MAX_SCORES = 2**26


def chain_for(b: int, n: int, t: int) -> int:
  """Calls per executable for a shape, unless --chain says."""
  return 10 if b * n * t * t <= CHAINED_MAX_SCORES else 1


def _flops(b, n, t, h, causal, mode):
  fwd = 4.0 * b * n * t * t * h * (0.5 if causal else 1.0)
  return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


def _check_rows():
  """flex vs the f32 reference on the GPU: forward and gradients."""
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
  if _CHECK_CASES.value:
    cases = [cases[int(i)] for i in _CHECK_CASES.value]
  rows = _check_cases(cases, "table")
  variants = []  # (name, the fields of the table's config to replace)
  if _CHECK_MOSAIC_FWD.value:
    tiles = workloads.parse_config(mosaic.MosaicForwardConfig, _CHECK_MOSAIC_FWD.value)
    variants.append((workloads.FlexMosaicForward(tiles).name, dict(mosaic_fwd=tiles)))
  for text in _CHECK_MOSAIC_BWD.value:
    tiles = workloads.parse_config(mosaic_backward.MosaicBackwardConfig, text)
    variants.append((workloads.FlexMosaicBackward(tiles).name, dict(mosaic_bwd=tiles)))
  if _CHECK_FWD_SOFTMAX.value:
    variants.append((workloads.FlexTritonForward(fwd_softmax=_CHECK_FWD_SOFTMAX.value).name,
                     dict(fwd_softmax=_CHECK_FWD_SOFTMAX.value, mosaic_fwd=None)))
  if _CHECK_REFRESH.value:
    variants.append((workloads.FlexRefresh(_CHECK_REFRESH.value).name,
                     dict(refresh=_CHECK_REFRESH.value)))
  table = flex_configs.get_config
  for name, changes in variants:  # The table's config with these fields replaced.
    patched = lambda *a, changes=changes, **kw: workloads.with_changes(
        table(*a, **kw), **changes)
    with mock.patch.object(flex_configs, "get_config", patched):
      rows += _check_cases(cases, name)
  return rows


def _check_cases(cases, variant):
  """Checks each case with flex's config for it as `variant` names it."""
  rows = []
  for b, t, s, n, kh, h, dtype, opts in cases:
    opts = {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in opts.items()}
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    k = jax.random.normal(keys[1], (b, s, kh, h), dtype)
    v = jax.random.normal(keys[2], (b, s, kh, h), dtype)
    w = jax.random.normal(keys[3], (b, t, n, h), jnp.float32)
    def loss(fn, q, k, v):
      return jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
    flex = lambda q, k, v: flex_api.flex_attention(q, k, v, implementation="pallas", **opts)
    ref = lambda q, k, v: flex_api.flex_attention(  # the dense reference
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        implementation="xla", **opts)
    row = dict(kind="check", variant=variant, shape=[b, t, s, n, kh, h],
               dtype=jnp.dtype(dtype).name, options=sorted(opts))
    try:
      out, grads = jax.jit(jax.value_and_grad(functools.partial(loss, flex), (0, 1, 2)))(q, k, v)
      out_r, grads_r = jax.jit(jax.value_and_grad(functools.partial(loss, ref), (0, 1, 2)))(q, k, v)
      fo = np.asarray(jax.jit(flex)(q, k, v), np.float32)
      ro = np.asarray(jax.jit(ref)(q, k, v), np.float32)
      rel = lambda a, r: float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(r, np.float32))
                               / max(np.linalg.norm(np.asarray(r, np.float32)), 1e-30))
      row.update(status="ok", fwd_rel=rel(fo, ro), nan=bool(np.isnan(fo).any()),
                 dq_rel=rel(grads[0], grads_r[0]), dk_rel=rel(grads[1], grads_r[1]),
                 dv_rel=rel(grads[2], grads_r[2]))
    except Exception as exc:  # Record and go on: the timing still matters.
      row.update(status="error", message=f"{type(exc).__name__}: {str(exc)[:1500]}")
    logging.info("check %s", row)
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def main(argv):
  del argv
  start = time.time()
  rows = _check_rows() if _CHECK.value else []
  names = _SHAPES.value or list(DEFAULT_SHAPES)
  impls = implementations()
  for name in names:
    b, n, t, h, causals = SHAPES[name]
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
            iters = max(5, _ITERS.value // 2) if impl.name == "xla" else _ITERS.value
            chain = chain_for(b, n, t) if _CHAIN.value is None else _CHAIN.value
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


def implementations() -> list:
  """The typed implementations the flags ask for, in order."""
  impls = []
  for name in _IMPLS.value:
    if name == "mha":
      impls += list(workloads.MHA_SWEEP) if _MHA_SWEEP.value else [workloads.PallasMha()]
    elif name in workloads.ATTENTION:
      impls.append(workloads.ATTENTION[name])
    else:
      raise app.UsageError(f"--impls: unknown {name!r}; known: "
                           f"{sorted(workloads.ATTENTION) + ['mha']}")
  for text in _TRITON_FWD.value:
    impls.append(workloads.FlexTritonForward(
        tiles=workloads.parse_config(flex_configs.KernelConfig, text)))
  for text in _MOSAIC_FWD.value:
    fields = json.loads(text)
    softmax = fields.pop("fwd_softmax", None) if isinstance(fields, dict) else None
    impls.append(workloads.FlexMosaicForward(
        workloads.parse_config(mosaic.MosaicForwardConfig, fields), fwd_softmax=softmax))
  for text in _MOSAIC_BWD.value:
    impls.append(workloads.FlexMosaicBackward(
        workloads.parse_config(mosaic_backward.MosaicBackwardConfig, text)))
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
    for impl in ("flex", "flex_triton", "cudnn", "xla"):
      if impl in by_impl:
        s[f"{impl}_ms"] = by_impl[impl]["median_ms"]
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
    rows.append(s)


if __name__ == "__main__":
  app.run(main)
