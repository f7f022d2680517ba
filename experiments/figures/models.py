"""The models page: whole models with their default kernels beside a peer
(suites `models`, `scan_remat`, `unet`, `fit`, and the model rows of `ssm_scans`,
`chunked_ops` and `moe`)."""

import json

from experiments.figures import charts
from experiments.figures.common import (Record, Suite, cell, compare, mode_key, newest_rows,
                                        not_measured, number, ratio_text, reproduce_section,
                                        run_letters, run_table, runs_line,
                                        sourced_table, table)


MODEL_NAMES = {"transformer": "Transformer", "dit": "DiffusionTransformer"}
_MODEL_SHORT = {"transformer": "Transformer", "dit": "DiT"}
_SSM_CELLS = {"lru": "LRUCell", "mamba": "MambaCell"}
_MODEL_PEERS = (("cudnn", "cuDNN"), ("xla", "XLA"))


def _attention_model_label(row: dict) -> str | None:
  return row.get("attention")


def _ssm_model_label(row: dict) -> str | None:
  """benchmark_kernel_ssm's model rows, by implementation."""
  return row.get("impl") if row.get("kind") == "model" else None


def _chunked_model_label(row: dict) -> str | None:
  """benchmark_kernel_ssd's model rows: 'default' where no implementation was named."""
  if row.get("kind") != "model":
    return None
  return "default" if row.get("implementation") in (None, "None") else row.get("implementation")


def _moe_label(row: dict) -> str | None:
  """benchmark_kernel_moe's MoELayer rows, by `dropless_impl`."""
  return row.get("impl") if row.get("section") == "moe" else None


def model_records(suite: Suite) -> list[Record]:
  records = compare(suite.rows, config=("model", "dtype", "tokens", "batch", "mode"),
                    label=_attention_model_label, ours="default")
  models = list(MODEL_NAMES)
  records.sort(key=lambda r: (models.index(r.config["model"]) if r.config["model"] in models
                              else 9, r.config["dtype"] != "bfloat16", -r.config["tokens"],
                              mode_key(r.config["mode"])))
  return records


def newest_train_steps(suite: Suite) -> list[Record]:
  """The train steps of the newest run that timed cuDNN beside the default."""
  steps = [r for r in model_records(suite) if r.config["mode"] == "train_step"
           and r.ratio("default", "cudnn") is not None]
  newest = max((r.source for r in steps), default=None)
  return [r for r in steps if r.source == newest]


def model_table(suite: Suite, records: list[Record]) -> str:
  peers = [(k, n) for k, n in _MODEL_PEERS if any(k in r.cells for r in records)]
  header = (["model", "dtype", "tokens", "mode", "default ms"] + [f"{n} ms" for _, n in peers]
            + [f"default / {n}" for _, n in peers])
  return run_table(suite, header, [
      (r, [_MODEL_SHORT.get(r.config["model"], r.config["model"]), r.config["dtype"],
           str(r.config["tokens"]), r.config["mode"].replace("_", " "), cell(r, "default")]
       + [cell(r, k) for k, _ in peers] + [ratio_text(r.ratio("default", k)) for k, _ in peers])
      for r in records])


def missing_combinations(rows: list[dict], axes: tuple[str, ...],
                         names: dict[str, dict] | None = None) -> list[str]:
  """Combinations of the values seen on `axes` that no row has."""
  names = names or {}
  values = [sorted({json.dumps(r.get(a)) for r in rows if a in r}) for a in axes]
  seen = {tuple(json.dumps(r.get(a)) for a in axes) for r in rows}
  combos = [()]
  for options in values:
    combos = [c + (v,) for c in combos for v in options]
  out = []
  for combo in combos:
    if combo not in seen:
      shown = [str(names.get(a, {}).get(json.loads(v), json.loads(v)))
               for a, v in zip(axes, combo)]
      out.append(" ".join(shown))
  return out


def scan_remat_section(suite: Suite) -> list[str]:
  rows = [r for r in suite.rows if r.get("section", "scan_remat") == "scan_remat"
          and "remat_policy" in r]
  source, rows = newest_rows(suite, lambda r: r in rows)
  if not rows:
    return [not_measured("scan_layers x remat_policy")]
  ok = [r for r in rows if r.get("status") == "ok"]
  unrolled = {r["attention"]: r for r in ok if r["remat_policy"] is None
              and not r["scan_layers"]}
  base = unrolled.get("default")

  header = ["attention", "remat", "scan", "lower s", "compile s", "compile: unrolled / this",
            "step ms", "step / base", "peak MB", "peak / base", "planned MB"]
  body = []
  for r in rows:
    if r.get("status") != "ok":
      body.append([r["attention"], str(r["remat_policy"]), str(r["scan_layers"]),
                   r.get("status", "")] + [""] * 7)
      continue
    own = unrolled.get(r["attention"])
    compile_ratio = own["compile_s"] / r["compile_s"] if own else None
    body.append([r["attention"], str(r["remat_policy"]), "yes" if r["scan_layers"] else "no",
                 number(r.get("lower_s"), 3), number(r.get("compile_s"), 3),
                 ratio_text(compile_ratio), number(r.get("median_ms")),
                 ratio_text(_over(r, base, "median_ms")), number(r.get("peak_mb")),
                 ratio_text(_over(r, base, "peak_mb")), number(r.get("planned_peak_mb"))])
  first = rows[0]
  out = [f"A {first.get('num_layers')}-layer Transformer of width {first.get('model_dim')}, "
         f"batch {first.get('batch')}, {first.get('tokens')} tokens, {first.get('dtype')}, "
         "causal, Adam, donated train step; every case in a fresh process so that `peak MB` "
         "(the device's `peak_bytes_in_use`) is its own; `planned MB` is XLA's buffer plan. "
         "`default` attention is the library's dispatch; `cudnn` and `xla` (einsum) are the "
         "peers. `base` is the unrolled stack without remat and with the default attention; "
         "the compile ratio is against the unrolled, no-remat row of the same attention.", ""]
  lines = []
  full_scan = next((r for r in ok if r["attention"] == "default" and r["remat_policy"] == "full"
                    and r["scan_layers"]), None)
  if full_scan and base:
    peaks = sorted((r["peak_mb"], r["remat_policy"], r["scan_layers"]) for r in ok
                   if r["attention"] == "default" and r.get("peak_mb"))
    lowest = peaks[0][0] if peaks else None
    lines.append(f"- `scan_layers=True, remat_policy='full'`: compiles "
                 f"{ratio_text(base['compile_s'] / full_scan['compile_s'])} x faster than "
                 f"the unrolled stack, steps in {ratio_text(_over(full_scan, base, 'median_ms'))} "
                 f"x its time, peaks at {ratio_text(_over(full_scan, base, 'peak_mb'))} x its "
                 f"memory" + (" (the lowest peak of the default rows)."
                             if lowest is not None and full_scan["peak_mb"] <= lowest else "."))
  cudnn_scan = next((r for r in ok if r["attention"] == "cudnn" and r["scan_layers"]), None)
  if cudnn_scan and "cudnn" in unrolled:
    lines.append(f"- With cuDNN's attention (no Pallas kernel to lower) the scanned "
                 f"'{cudnn_scan['remat_policy']}' stack compiles "
                 f"{ratio_text(unrolled['cudnn']['compile_s'] / cudnn_scan['compile_s'])} x "
                 f"faster than its unrolled one.")
  out += lines + ([""] if lines else [])
  out.append(sourced_table(suite, header, body, [source]))
  return out


def ssm_model_section(suites: dict[str, Suite]) -> list[str]:
  body = []
  ssm = suites["ssm_scans"]
  scans = compare(ssm.rows, config=("model", "cell", "dtype", "batch", "time", "mode"),
                  label=_ssm_model_label, ours="pallas")
  scan_letters = run_letters(r.source for r in scans)
  for r in sorted(scans, key=lambda r: (r.config["cell"], mode_key(r.config["mode"]))):
    mode = "forward" if r.config["mode"] == "fwd" else "train step (Adam)"
    body.append([_SSM_CELLS.get(r.config["cell"], r.config["cell"]), str(r.config["time"]), mode,
                 cell(r, "pallas"), cell(r, "xla"), ratio_text(r.ratio("pallas", "xla")),
                 scan_letters[r.source]])
  chunked = suites["chunked_ops"]
  chunks = compare(chunked.rows, config=("cell", "B", "T", "dtype", "step"),
                   label=_chunked_model_label, ours="default")
  chunk_letters = run_letters((r.source for r in chunks), start=len(scan_letters))
  for r in chunks:
    body.append([r.config["cell"], str(r.config["T"]),
                 f"train step ({str(r.config['step']).upper()})", cell(r, "default"),
                 cell(r, "xla"), ratio_text(r.ratio("default", "xla")), chunk_letters[r.source]])
  if not body:
    return [not_measured("SSMModel")]
  out = ["`SSMModel(16, 128, 16, 4)` (input 16, width 128, output 16, 4 layers), batch 8, "
         "bf16, with each cell on its default kernels against `implementation='xla'` in the "
         "same run. The LRU and Mamba cells come from `benchmark_kernel_ssm --models` "
         "(forward and an Adam step), the SSD, Mamba-2 and gated DeltaNet cells from "
         "`benchmark_kernel_ssd` (an SGD step).", "",
         table(["cell", "T", "mode", "default ms", "XLA ms", "default / XLA", "run"], body), ""]
  for suite, letters in ((ssm, scan_letters), (chunked, chunk_letters)):
    if letters:
      out += [runs_line(suite, letters, letters), ""]
  return out


def _over(row: dict, base: dict | None, key: str) -> float | None:
  """`row[key] / base[key]` for two measured rows (None where either is missing)."""
  if (base is None or row.get("status", "ok") != "ok" or base.get("status", "ok") != "ok"
      or not row.get(key) or not base.get(key)):
    return None
  return row[key] / base[key]


def _row_value(row: dict, key: str) -> str:
  """A row's measurement, its status where it did not run, a dash where it is absent."""
  if not row:
    return "—"
  return number(row.get(key)) if row.get("status") == "ok" else row.get("status", "")


def unet_bfloat16_lines(grid: list[dict]) -> list[str]:
  """When bfloat16 pays: bf16 over f32 at each resolution where both ran."""
  def ok(resolution, dtype, mode):
    return next((r for r in grid if (r["resolution"], r["dtype"], r["mode"])
                 == (resolution, dtype, mode) and r.get("status", "ok") == "ok"), None)
  faster, slower, body = [], [], []
  for resolution in sorted({r["resolution"] for r in grid}):
    bf16, f32 = ok(resolution, "bfloat16", "train_step"), ok(resolution, "float32", "train_step")
    if not (bf16 and f32):
      continue
    step = _over(bf16, f32, "median_ms")
    forward = _over(ok(resolution, "bfloat16", "forward"), ok(resolution, "float32", "forward"),
                    "median_ms")
    if step is not None:
      (faster if step < 1 else slower).append(str(resolution))
    body.append([str(resolution), ratio_text(step), ratio_text(_over(bf16, f32, "peak_mb")),
                 ratio_text(forward)])
  if not body:
    return []
  if faster and slower:
    where = f"faster than float32's at resolution {', '.join(faster)} and slower at " + (
        ", ".join(slower))
  else:
    where = (f"{'faster' if faster else 'slower'} than float32's at every resolution "
             f"measured ({', '.join(faster or slower)})")
  verdict = f"The bfloat16 train step is {where}; the memory column is what it saves."
  return [f"bfloat16 over float32 (below 1: bfloat16 is faster or smaller). {verdict}", "",
          table(["resolution", "train step time", "train peak MB", "forward time"], body), ""]


def unet_section(suite: Suite) -> list[str]:
  rows = [r for r in suite.rows if "resolution" in r]
  if not rows:
    return [not_measured("UNet")]
  first = rows[0]
  out = [f"`UNet({first.get('in_channels')}, {tuple(first.get('channels', ()))})`, batch "
         f"{first.get('batch')}, Adam train step; every case in a fresh process "
         "(`peak MB` is the device's counter for the whole process, `planned MB` XLA's plan "
         "for the step). `attention` is what the dispatch chose at the lowest level. No peer "
         "library was timed: the second table compares the step's variants with the plain "
         "step.", ""]
  grid = [r for r in rows if r.get("variant") == "plain"]
  keys = sorted({(r["resolution"], r["dtype"]) for r in grid},
                key=lambda k: (k[0], k[1] != "float32"))
  body = []
  for resolution, dtype in keys:
    by_mode = {r["mode"]: r for r in grid if (r["resolution"], r["dtype"]) == (resolution, dtype)}
    fwd, step = by_mode.get("forward", {}), by_mode.get("train_step", {})
    body.append([str(resolution), dtype, _row_value(fwd, "median_ms"),
                 _row_value(step, "median_ms"), _row_value(step, "peak_mb"),
                 _row_value(step, "planned_peak_mb"), _row_value(step, "compile_s"),
                 str((step or fwd).get("attention", ""))])
  out += [table(["resolution", "dtype", "forward ms", "train step ms", "train peak MB",
                 "train planned MB", "train compile s", "attention"], body), ""]
  out += unet_bfloat16_lines(grid)
  variants = [r for r in rows if r.get("mode") == "train_step" and r.get("variant")
              and r.get("dtype") == "bfloat16"
              and any(v.get("variant") != "plain" for v in rows
                      if v.get("resolution") == r.get("resolution"))]
  plain = next((r for r in variants if r["variant"] == "plain" and r.get("status") == "ok"),
               None)
  if variants and plain:
    body = []
    for r in variants:
      label = {"remat": f"`remat_policy='{r.get('remat_policy')}'`",
               "donated": "parameters and Adam state donated"}.get(r["variant"], r["variant"])
      line = [label]
      for key in ("median_ms", "peak_mb", "planned_peak_mb"):
        line += [_row_value(r, key), ratio_text(_over(r, plain, key))]
      body.append(line)
    out += [f"bf16 train step at resolution {plain['resolution']}, remat and donation:", "",
            table(["variant", "step ms", "/ plain", "peak MB", "/ plain", "planned MB",
                   "/ plain"], body), ""]
  else:
    out += [not_measured("The UNet's remat and donation variants"), ""]
  out.append(runs_line(suite, {r["source"] for r in rows}))
  return out


_MOE_ORDER = ("auto", "gmm", "gmm_mosaic", "gmm_triton", "gmm_triton_tgmm", "sort", "dense",
              "ragged_dot")


def moe_records(suite: Suite) -> list[Record]:
  """The MoELayer per `dropless_impl`, per token count and mode."""
  return compare(suite.rows, config=("tokens", "mode"), label=_moe_label, ours="auto")


def moe_section(suite: Suite) -> list[str]:
  records = moe_records(suite)
  if not records:
    return [not_measured("MoELayer per `dropless_impl`")]
  out = ["`MoELayer`, 8 experts, top-2, d_model 512, d_hidden 1024, GELU, bf16, per "
         "`dropless_impl` ('auto' is the default and picks 'gmm' on an NVIDIA GPU; the "
         "`gmm_*` rows force the grouped matmuls onto one kernel family). fwd+bwd is one "
         "`jax.vjp` with a random cotangent. Ratios are times over 'dense' (every token "
         "through a dense expert loop) and 'ragged_dot' (`jax.lax.ragged_dot`) in the same "
         "run.", ""]
  headlines = []
  body = []
  for tokens in sorted({r.config["tokens"] for r in records}):
    of = {r.config["mode"]: r for r in records if r.config["tokens"] == tokens}
    impls = [i for i in _MOE_ORDER if any(i in r.cells for r in of.values())]
    impls += sorted({i for r in of.values() for i in r.cells} - set(impls))
    for impl in impls:
      line = [str(tokens), f"'{impl}'"]
      for mode in ("forward", "fwd+bwd"):
        r = of.get(mode)
        line.append(cell(r, impl) if r else "—")
      r = of.get("fwd+bwd")
      line += [ratio_text(r.ratio(impl, "dense")) if r else "",
               ratio_text(r.ratio(impl, "ragged_dot")) if r else ""]
      body.append(line)
    r = of.get("fwd+bwd")
    if r:
      headlines.append(f"- {tokens} tokens, fwd+bwd, default ('auto'): "
                       f"{ratio_text(r.ratio('auto', 'dense'))} x 'dense', "
                       f"{ratio_text(r.ratio('auto', 'ragged_dot'))} x 'ragged_dot'.")
  out += headlines + [""]
  out.append(sourced_table(suite, ["tokens", "dropless_impl", "forward ms", "fwd+bwd ms",
                                   "fwd+bwd / dense", "fwd+bwd / ragged_dot"], body,
                           (r.source for r in records)))
  return out


_FIT_CASES = (
    ("bare_loop", "bare loop: a jitted, donated optax step in a Python loop, one sync"),
    ("fit_memory", "`fit()` on in-memory arrays, default arguments"),
    ("fit_stream", "`fit()` on a stream of host numpy batches, default arguments"),
    ("fit_memory_calls", "`fit(steps_per_call=K)`, in memory"),
    ("fit_stream_calls", "`fit(steps_per_call=K)`, stream"),
    ("fit_memory_one_step", "`fit(steps_per_call=1)`, in memory"),
    ("fit_stream_one_step", "`fit(steps_per_call=1)`, stream"),
    ("bare_loop_calls", "bare loop of K steps per jitted call (`lax.scan`)"),
)


def fit_like_for_like(by_case: dict[str, dict]) -> str | None:
  """`fit()`'s time over the bare loop's at the same steps per call: K steps
  against the bare K-step scan, one step against the bare loop, from the
  rows' medians (each row's `bare_loop_time_ratio` is over the one-step bare
  loop of the same rounds)."""
  parts = []
  for ours, base, label in (("fit_memory_calls", "bare_loop_calls", "{k} steps per call"),
                            ("fit_memory_one_step", "bare_loop", "one step per call")):
    theirs = by_case.get(base, {}).get("bare_loop_time_ratio")
    memory = by_case.get(ours, {}).get("bare_loop_time_ratio")
    if not theirs or memory is None:
      continue
    stream = by_case.get(ours.replace("memory", "stream"), {}).get("bare_loop_time_ratio")
    k = by_case[ours].get("steps_per_call") or by_case[base].get("steps_per_call")
    text = (f"at {label.format(k=k)} `fit()` takes {ratio_text(memory / theirs)} x the bare "
            f"loop's time in memory")
    if stream is not None:
      text += f", {ratio_text(stream / theirs)} x on a stream"
    parts.append(text)
  return "; ".join(parts) or None


def fit_section(suite: Suite) -> list[str]:
  source, rows = newest_rows(suite, lambda r: "case" in r)
  if not rows:
    return [not_measured("Training-loop overhead")]
  by_case = {r["case"]: r for r in rows}
  first = rows[0]
  what = (f"a {first.get('num_layers')}-layer Transformer of width {first.get('model_dim')}, "
          f"batch {first.get('batch')} x {first.get('seq_len')} tokens"
          if first.get("model") == "transformer" else
          f"the 3-hidden-layer MLP of width {first.get('model_dim')} on "
          f"{first.get('seq_len')} features, batch {first.get('batch')}")
  out = [f"`fit()` against a hand-written loop, on {what}, {first.get('dtype')}, Adam, "
         f"{first.get('steps')} steps per loop; the loops run interleaved in "
         f"{first.get('repeats')} rounds, and `time / bare loop` is the median of the "
         "per-round ratios (min-max beside it), so lower is better and 1 is no overhead. "
         "With default arguments `fit()` runs several steps per compiled call when the state "
         "is small, where the bare loop runs one; the bare loop of K steps per call is the "
         "like-for-like baseline of the K rows.", ""]
  memory, stream = by_case.get("fit_memory"), by_case.get("fit_stream")
  second = by_case.get("fit_second")
  like = fit_like_for_like(by_case)
  if like:
    out.append("- Like for like, the same steps per compiled call in both loops: " + like + ".")
  if memory and stream:
    out.append(f"- Default arguments (several steps per call) against the bare loop of one "
               f"step per call: in memory {ratio_text(memory.get('bare_loop_time_ratio'))}"
               f" x the bare loop's time, stream {ratio_text(stream.get('bare_loop_time_ratio'))}"
               " x; the gain is the steps per call, which a hand-written scan has too.")
  if second and second.get("second_over_first_wall") is not None:
    out.append(f"- A second `fit()` call takes {ratio_text(second['second_over_first_wall'])} "
               "x the first call's wall time (it compiles nothing).")
  out.append("")
  body = []
  for case, name in _FIT_CASES:
    r = by_case.get(case)
    if r is None:
      continue
    spread = (f"{ratio_text(r['ratio_min'])}-{ratio_text(r['ratio_max'])}"
              if r.get("ratio_min") != r.get("ratio_max") else "")
    k = r.get("steps_per_call")
    body.append([name + (f" (K = {k})" if k else ""), number(r.get("steps_per_s")),
                 ratio_text(r.get("bare_loop_time_ratio")), spread])
  out.append(sourced_table(suite, ["case", "steps/s", "time / bare loop", "min-max"], body,
                           [source]))
  return out


def models_figure(suites: dict[str, Suite]) -> charts.Figure | None:
  """Each model's train step (the MoE layer's fwd+bwd) with its default kernels
  over the same model on a peer."""
  bars = [(f"{MODEL_NAMES.get(r.config['model'], r.config['model'])}, {r.config['dtype']}, "
           f"{r.config['tokens']} tokens, train step", "default / cuDNN attention",
           r.ratio("default", "cudnn")) for r in newest_train_steps(suites["models"])]
  for r in compare(suites["ssm_scans"].rows, config=("cell", "mode"), label=_ssm_model_label,
                   ours="pallas"):
    value = r.ratio("pallas", "xla")
    if value is not None and r.config["mode"] == "train_step":
      bars.append((f"SSMModel, {_SSM_CELLS.get(r.config['cell'], r.config['cell'])}, "
                   "train step", "default / XLA", value))
  for r in compare(suites["chunked_ops"].rows, config=("cell", "step"),
                   label=_chunked_model_label, ours="default"):
    value = r.ratio("default", "xla")
    if value is not None:
      bars.append((f"SSMModel, {r.config['cell']}, train step", "default / XLA", value))
  for r in moe_records(suites["moe"]):
    if r.config["mode"] != "fwd+bwd":
      continue
    for peer in ("dense", "ragged_dot"):
      value = r.ratio("auto", peer)
      if value is not None:
        bars.append((f"MoELayer, {r.config['tokens']} tokens, fwd+bwd", f"default / '{peer}'",
                     value))
  if not bars:
    return None
  return charts.Figure("Models with their default kernels against a peer", charts.RATIO_AXIS,
                       bars)


def models_page(manifest: dict, suites: dict[str, Suite], figure: list[str]) -> str:
  """The page's Markdown; `figure` is the Markdown that shows its figure (or none)."""
  records = model_records(suites["models"])
  out = ["# Models", "",
         "Whole models on one GPU: forward passes and train steps of the library's models "
         "with their default kernels beside the same model on a peer implementation, in the "
         "same run. Ratios are the default's time over the peer's: below 1 the default is "
         "faster.", "", "## Headlines", ""]
  headline = newest_train_steps(suites["models"])
  if headline:
    for r in headline:
      c = r.config
      out.append(f"- {MODEL_NAMES.get(c['model'], c['model'])} train step, {c['dtype']}, "
                 f"{c['tokens']} tokens: {ratio_text(r.ratio('default', 'cudnn'))} x the "
                 "same model with cuDNN attention.")
  else:
    out.append(not_measured("The model train steps"))
  out += [""] + figure
  out += ["## Transformer and DiffusionTransformer", ""]
  if records:
    first = next(r for r in records)
    row = first.cells["default"]
    out += [f"Batch {row.get('batch')}, width 256, 8 heads of 32, 4 layers "
            "(`benchmark_gpu_nn`'s profile); the train step is the gradient of a mean-square "
            "loss plus an Adam update with donated buffers. `default` is "
            "`attention_fn=dot_product_attention` with the library's dispatch; cuDNN and XLA "
            "are the same model with `implementation='cudnn'` / `'xla'`. DiT is the "
            "DiffusionTransformer.", "",
            model_table(suites["models"], records), ""]
    missing = missing_combinations(
        [r for r in suites["models"].rows if r.get("attention") == "default"],
        ("model", "dtype", "tokens", "mode"), {"model": MODEL_NAMES})
    if missing:
      out += ["Not measured: " + "; ".join(m.replace("_", " ") for m in missing) + ".", ""]
  else:
    out += [not_measured("The Transformer and DiffusionTransformer"), ""]
  out += ["## scan_layers x remat_policy", ""] + scan_remat_section(suites["scan_remat"])
  out += ["", "## SSMModel per cell", ""] + ssm_model_section(suites)
  out += ["", "## UNet", ""] + unet_section(suites["unet"])
  out += ["", "## MoELayer per dropless_impl", ""] + moe_section(suites["moe"])
  out += ["", "## Training-loop overhead", ""] + fit_section(suites["fit"])
  out += ["", "## How to reproduce", ""] + reproduce_section(manifest)
  return "\n".join(out) + "\n"
