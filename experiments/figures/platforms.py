"""The platforms page: what each default runs on each GPU kind, from the committed
dispatch tables (`ops/dispatch_tables/*.json`), and the `gpu_check` runs."""

from experiments import dispatch_tables
from experiments.figures.common import Suite, run_label, suite_or_empty, table
from ops import _measured


# The defaults each dispatch table decides, and what runs where it decides nothing.
DEFAULTS = {
    "attention": ("`dot_product_attention`", "cuDNN or XLA"),
    "decode_attention": ("`dot_product_attention`, one query per sequence; "
                         "`ops.decode_attention`", "cuDNN or XLA"),
    "flex_attention": ("`ops.flex_attention`", "XLA"),
    "moe": ("`MoELayer(dropless_impl='auto')`", "'ragged_dot'"),
    "grouped_matmul": ("`ops.grouped_matmul`", "XLA"),
    "grouped_mlp": ("`ops.grouped_mlp`", "XLA"),
    "ssd": ("`ops.ssd`", "XLA"),
    "gated_delta_rule": ("`ops.gated_delta_rule`", "XLA"),
    "selective_scan": ("`ops.selective_scan`", "XLA"),
    "linear_scan": ("`ops.linear_scan`", "XLA"),
}
_IMPL_NAMES = {"flex": "flex", "cudnn": "cuDNN", "xla": "XLA", "pallas": "the kernel",
               "gmm": "'gmm'", "ragged_dot": "'ragged_dot'", "sort": "'sort'",
               "dense": "'dense'"}


def _default_paths(table: dict, data: dict) -> tuple[str, str]:
  """What `None` runs at the points of one device kind's section (winners
  among the checked kernels and the other implementations, counted), and at
  how many points a kernel, checked or not, was the fastest timed."""
  kernels, checked = set(table["kernels"]), set(data["checked"])
  winners, kernel_fastest = {}, 0
  for point in data["points"]:
    ms = point["ms"]
    eligible = {k: v for k, v in ms.items() if k not in kernels or k in checked}
    name = (_IMPL_NAMES.get(min(eligible, key=eligible.get), min(eligible, key=eligible.get))
            if eligible else DEFAULTS[table["table"]][1])
    winners[name] = winners.get(name, 0) + 1
    kernel_fastest += min(ms, key=ms.get) in kernels
  total = len(data["points"])
  runs = ", ".join(f"{name} at {count}" for name, count in
                   sorted(winners.items(), key=lambda item: -item[1]))
  return f"{runs} of {total} points", f"{kernel_fastest} of {total}"


def platforms_table() -> str:
  """One row per default and device kind (with JAX release) of the committed
  tables, then what runs everywhere else."""
  body = []
  for name in dispatch_tables.TABLES:
    measured = _measured.load(name)
    if measured is None:
      continue
    for data in measured["devices"]:
      runs, faster = _default_paths(measured, data)
      checked = "; ".join(f"{_IMPL_NAMES.get(k, k)} {run_label(v)}"
                          for k, v in sorted(data["checked"].items())) or "never"
      body.append([DEFAULTS[name][0], data["device"], data["jax"], runs, faster, checked,
                   ", ".join(f"`{s}`" for s in data["sources"])])
  body.append(["every default", "any other GPU kind or JAX release", "", "cuDNN where it "
               "takes the call, else XLA ('ragged_dot' for the MoE layer)", "", "never", ""])
  body.append(["every default", "CPU, TPU", "", "XLA", "", "", ""])
  return table(["default", "GPU", "JAX", "`None` runs", "a kernel fastest at",
                "kernel last passed gpu_check", "measured in"], body)


def gpu_check_table(suite: Suite) -> str | None:
  """The newest gpu_check run of each device kind: per op, its checks and timings."""
  newest = {}
  for source in suite.sources:  # newest first
    env = suite.environment(source)
    newest.setdefault((env.get("device_kind"), _measured.minor(env.get("jax", ""))), source)
  body = []
  for source in newest.values():
    env = suite.environment(source)
    ops = {}
    for r in suite.rows:
      if r["source"] == source and r.get("kind") in ("check", "time"):
        count = ops.setdefault(r.get("op"), dict(ok=0, unsup=0, failed=0, timed=0))
        if r["kind"] == "time":
          count["timed"] += r.get("status") == "ok"
        else:
          status = r.get("status")
          count["ok" if status == "ok" else "unsup" if status == "unsup" else "failed"] += 1
    others = [r for r in suite.rows if r["source"] == source
              and r.get("kind") in ("model", "generate", "sharded")]
    for op, count in ops.items():
      body.append([str(env.get("device_kind", "")), str(env.get("jax", "")), run_label(source),
                   f"`{op}`", str(count["ok"]), str(count["unsup"]), str(count["failed"]),
                   str(count["timed"])])
    if others:
      failed = sum(r.get("status") not in ("ok", "unsup") for r in others)
      body.append([str(env.get("device_kind", "")), str(env.get("jax", "")), run_label(source),
                   "models, generate, sharded step", str(len(others) - failed), "",
                   str(failed), ""])
  if not body:
    return None
  return table(["GPU", "JAX", "run", "checked", "passed", "not supported", "failed",
                "timed"], body)


def platforms_page(suites: dict[str, Suite]) -> str:
  out = ["# Platforms", "",
         "What each default (`implementation=None`, `dot_product_attention`, `MoELayer`'s "
         "'auto') runs on each GPU kind, from the dispatch tables committed with the library "
         "(`ops/dispatch_tables/*.json`, written by `python -m experiments.dispatch_tables` "
         "from the benchmark JSON). A default takes one of this library's kernels only on a "
         "GPU kind where `python -m experiments.gpu_check` passed it and a measurement with a "
         "JAX of the same minor release shows it faster there; everywhere else it takes the "
         "established path, cuDNN where it takes the call and XLA otherwise, and logs once "
         "that it does.", "", "## Defaults by GPU kind", "",
         "`None` runs: the implementation a default takes at the table's measured points "
         "(a call is judged by the point that covers it); a kernel fastest at: the points "
         "where one of this library's kernels was timed fastest, checked or not.", "",
         platforms_table(), "",
         "To add a GPU kind (or a JAX release): run `python -m experiments.gpu_check` on it "
         "and commit `docs/benchmarks/gpu_check.json`, then `python -m "
         "experiments.dispatch_tables` and `python -m experiments.benchmark_figures`.", "",
         "## gpu_check runs", ""]
  checks = gpu_check_table(suite_or_empty(suites, "gpu_check"))
  if checks:
    out += ["The newest run of each GPU kind and JAX release: per op, its checks (each "
            "backend at each shape) and its timings that passed.", "", checks, ""]
  else:
    out += ["No `gpu_check` run is committed yet.", ""]
  return "\n".join(out)
