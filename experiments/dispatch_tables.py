r"""Writes the measured dispatch tables, `ops/dispatch_tables/*.json`.

The defaults that choose between implementations (`dot_product_attention`,
`MoELayer(dropless_impl='auto')`, and `implementation=None` of every op) read
these tables (`ops/_measured.py`). Each is built from the committed benchmark
JSON: the fwd+bwd rows (forward, for decoding) of the headline shapes' file,
of the shape grid's where it was run (`--grid` of each benchmark,
docs/benchmarks/*_grid.json) and of `gpu_check.json`, whose timing rows name
the points they measure. Rows are grouped by the device kind and JAX minor
release of their run; where several runs timed the same point and
implementation, the median of their medians is kept. A table's kernels count
on a device kind only where `gpu_check.json` holds a run of that kind and
release whose checks of the ops they run all passed (`checked`: when).

    python -m experiments.gpu_check                  # on the GPU: checks and timings
    python -m experiments.dispatch_tables            # from docs/benchmarks
    python -m experiments.dispatch_tables --verify   # exit 1 when a table is stale
"""

import collections
import dataclasses
import json
import pathlib
import re
import statistics
import sys
from typing import Callable

from absl import app
from absl import flags

from experiments import workloads

# Names of their own: tests import several programs into one process.
_BENCHMARKS = flags.DEFINE_string("benchmark_dir", "docs/benchmarks",
                                  "Folder of the benchmark JSON files read.")
_OUTPUT_DIR = flags.DEFINE_string("tables_dir", "ops/dispatch_tables",
                                  "Folder the tables are written to.")
_CHECK = flags.DEFINE_bool("verify", False, "Write nothing; exit 1 when a table in "
                           "--tables_dir differs from what the benchmarks give.")

MODE = "fwd+bwd"  # training: what the defaults are chosen for
GPU_CHECK = "gpu_check.json"
# A gpu_check row whose status is one of these fails its op's check.
FAILED = ("fail", "error", "OOM")
_ATTENTION_SHAPE = re.compile(r"b\d+_n\d+_t(\d+)_h(\d+)$")


@dataclasses.dataclass(frozen=True)
class Table:
  """How one table is read off the benchmark rows."""
  files: tuple[str, ...]            # benchmark JSON files, headline then grid
  keys: tuple[str, ...]             # exact-match features
  axes: tuple[str, ...]             # size features
  implementations: tuple[str, ...]  # what the default may choose
  point: Callable[[dict], dict | None]  # a timed row's features, or None: not this table's
  # This library's kernels among `implementations`, each with the gpu_check
  # ops whose checks must all pass on a device kind before a default runs it.
  kernels: dict[str, tuple[str, ...]]
  mode: str = MODE


def _attention_point(row: dict) -> dict | None:
  if row.get("kind") != "time":
    return None
  if "variant" in row:  # a grid row
    return dict(dtype=row["dtype"], variant=row["variant"], head_dim=row["H"], length=row["S"])
  match = _ATTENTION_SHAPE.match(str(row.get("shape")))
  if match is None:
    return None  # the check cases and hand-picked variants
  return dict(dtype="bfloat16", variant="causal" if row["causal"] else "full",
              head_dim=int(match[2]), length=int(match[1]))


def _moe_point(row: dict) -> dict | None:
  if row.get("section") != "moe":
    return None
  layer = (row["experts"], row["top_k"], row["d_model"], row["d_hidden"]) if "experts" in row \
      else (workloads.NUM_EXPERTS, workloads.TOP_K, workloads.D_MODEL, workloads.D_HIDDEN)
  return dict(zip(("experts", "top_k", "d_model", "d_hidden"), layer), tokens=row["tokens"])


def _op_point(op: str, sizes: Callable[[dict], dict]) -> Callable[[dict], dict | None]:
  def point(row: dict) -> dict | None:
    if row.get("kind") not in ("op", "time") or row.get("op") != op:
      return None
    # Only the default configuration: not a chunk size or block table set by hand.
    default_name = f"{op}/{_implementation(row)}"
    by_hand = row.get("name", default_name) != default_name or row.get("default_blocks") is False
    return None if by_hand else sizes(row)
  return point


def _no_rows(row: dict) -> None:
  """Tables measured by gpu_check alone."""
  del row


_chunked_sizes = lambda row: dict(key_dim=row["K"], length=row["T"])
_scan_sizes = lambda row: dict(length=row["shape"][1])
_selective_sizes = lambda row: dict(state=row["shape"][3], length=row["shape"][1])
_kernel = lambda op: {"pallas": (op,)}

TABLES = {
    "attention": Table(("attention.json", "attention_grid.json", GPU_CHECK), ("dtype", "variant"),
                       ("head_dim", "length"), ("flex", "cudnn", "xla"), _attention_point,
                       {"flex": ("flex_attention",)}),
    "flex_attention": Table((GPU_CHECK,), (), (), ("pallas", "xla"), _no_rows,
                            _kernel("flex_attention")),
    "decode_attention": Table((GPU_CHECK,), (), (), ("pallas", "xla", "cudnn"), _no_rows,
                              _kernel("decode_attention"), mode="fwd"),
    "moe": Table(("moe.json", "moe_grid.json", GPU_CHECK), (),
                 ("experts", "top_k", "d_model", "d_hidden", "tokens"),
                 ("dense", "ragged_dot", "sort", "gmm"), _moe_point,
                 {"gmm": ("grouped_mlp", "grouped_matmul")}),
    "grouped_matmul": Table((GPU_CHECK,), (), (), ("pallas", "xla"), _no_rows,
                            _kernel("grouped_matmul")),
    "grouped_mlp": Table((GPU_CHECK,), (), (), ("pallas", "xla"), _no_rows,
                         _kernel("grouped_mlp")),
    "ssd": Table(("chunked_ops.json", "chunked_grid.json", GPU_CHECK), (), ("key_dim", "length"),
                 ("pallas", "xla"), _op_point("ssd", _chunked_sizes), _kernel("ssd")),
    "gated_delta_rule": Table(("chunked_ops.json", "chunked_grid.json", GPU_CHECK), (),
                              ("key_dim", "length"), ("pallas", "xla"),
                              _op_point("gated_delta_rule", _chunked_sizes),
                              _kernel("gated_delta_rule")),
    "selective_scan": Table(("ssm_scans.json", "scan_grid.json", GPU_CHECK), (),
                            ("state", "length"), ("pallas", "xla"),
                            _op_point("selective_scan", _selective_sizes),
                            _kernel("selective_scan")),
    "linear_scan": Table(("ssm_scans.json", GPU_CHECK), (), ("length",), ("pallas", "xla"),
                         _op_point("linear_scan", _scan_sizes), _kernel("linear_scan")),
}


def _implementation(row: dict) -> str | None:
  return row.get("impl", row.get("implementation"))


def minor(version: str) -> str:
  """'0.11.2' -> '0.11'."""
  return ".".join(str(version).split(".")[:2])


def runs(data: dict) -> tuple[dict[str, dict], list[dict]]:
  """A suite file's runs (run id -> environment) and its rows, each naming
  its run in `source`: a merge of runs as it is, one run's file with its
  environment as the one run."""
  if "sources" in data:
    return ({run: source.get("environment", {}) for run, source in data["sources"].items()},
            data["rows"])
  environment = data.get("environment", {})
  run = environment.get("time", "run")
  return {run: environment}, [dict(r, source=run) for r in data["rows"]]


def _platform(environment: dict) -> tuple[str, str]:
  return environment.get("device_kind", "unknown"), minor(environment.get("jax", "unknown"))


def checked(name: str, benchmarks: pathlib.Path) -> dict[tuple[str, str], dict[str, str]]:
  """(device kind, JAX minor) -> {kernel: when its gpu_check passed} of table
  `name`: the newest gpu_check run of each device kind and release whose
  check rows of every op the kernel runs include a pass and no failure."""
  path = benchmarks / GPU_CHECK
  if not path.is_file():
    return {}
  environments, rows = runs(json.loads(path.read_text()))
  newest = {}
  for run, environment in sorted(environments.items()):
    newest[_platform(environment)] = run
  out = {}
  for platform, run in newest.items():
    statuses = collections.defaultdict(set)
    for row in rows:
      if row.get("source") == run and row.get("kind") == "check":
        statuses[row.get("op")].add(row.get("status"))
    passed = {kernel: environments[run].get("time", run)
              for kernel, ops in TABLES[name].kernels.items()
              if all("ok" in statuses[op] and not statuses[op] & set(FAILED) for op in ops)}
    if passed:
      out[platform] = passed
  return out


def build(name: str, benchmarks: pathlib.Path) -> dict | None:
  """Table `name` from the JSON files in `benchmarks`, or None when no point
  of any device kind has two of its implementations timed."""
  spec = TABLES[name]
  times = collections.defaultdict(
      lambda: collections.defaultdict(lambda: collections.defaultdict(list)))
  sources = collections.defaultdict(list)
  versions = collections.defaultdict(set)
  for file in spec.files:
    path = benchmarks / file
    if not path.is_file():
      continue
    environments, rows = runs(json.loads(path.read_text()))
    for row in rows:
      if row.get("status") != "ok" or row.get("mode") != spec.mode:
        continue
      if file == GPU_CHECK:  # its timing rows name their points
        named = row.get("points", {}).get(name)
        impl = None if named is None else named["impl"]
        point = None if named is None else {k: v for k, v in named.items() if k != "impl"}
      else:
        impl = _implementation(row)
        point = spec.point(row) if impl in spec.implementations else None
      if point is None or impl not in spec.implementations:
        continue
      environment = environments[row["source"]]
      platform = _platform(environment)
      times[platform][tuple(point.items())][impl].append(row["median_ms"])
      if file not in sources[platform]:
        sources[platform].append(file)
      versions[platform].add(environment.get("jax", "unknown"))
  passed = checked(name, benchmarks)
  devices = []
  for platform in sorted(times):
    points = [dict(point, ms={impl: round(statistics.median(ms), 5)
                              for impl, ms in sorted(by.items())})
              for point, by in sorted(times[platform].items()) if len(by) >= 2]
    if points:
      devices.append(dict(device=platform[0], jax=", ".join(sorted(versions[platform])),
                          sources=sources[platform], checked=passed.get(platform, {}),
                          points=points))
  if not devices:
    return None
  return dict(table=name, mode=spec.mode, keys=list(spec.keys), axes=list(spec.axes),
              kernels=sorted(spec.kernels), devices=devices)


def render(table: dict) -> str:
  return json.dumps(table, indent=1) + "\n"


def main(argv):
  del argv
  benchmarks, output = pathlib.Path(_BENCHMARKS.value), pathlib.Path(_OUTPUT_DIR.value)
  stale = []
  for name in TABLES:
    table = build(name, benchmarks)
    path = output / f"{name}.json"
    want = None if table is None else render(table)
    have = path.read_text() if path.is_file() else None
    if want == have:
      continue
    stale.append(name)
    if _CHECK.value:
      continue
    if want is None:
      path.unlink()
      print(f"removed {path} (no point with two implementations timed)")
    else:
      output.mkdir(parents=True, exist_ok=True)
      path.write_text(want)
      for data in table["devices"]:
        print(f"wrote {path}: {data['device']} (JAX {data['jax']}), {len(data['points'])} "
              f"points from {', '.join(data['sources'])}; kernels checked: "
              f"{sorted(data['checked']) or 'none'}")
  if _CHECK.value and stale:
    print(f"stale tables: {stale}; run python -m experiments.dispatch_tables")
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
