r"""Writes the measured dispatch tables, `ops/dispatch_tables/*.json`.

The defaults that choose between implementations (`dot_product_attention`,
`MoELayer(dropless_impl='auto')`, and `implementation=None` of ssd, the gated
delta rule and the scans) read these tables (`ops/_measured.py`). Each is
built from the fwd+bwd rows of the committed benchmark JSON: the headline
shapes' file and, where it was run, the shape grid's (`--grid` of each
benchmark, docs/benchmarks/*_grid.json). Where several runs timed the same
point and implementation, the median of their medians is kept.

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
_ATTENTION_SHAPE = re.compile(r"b\d+_n\d+_t(\d+)_h(\d+)$")


@dataclasses.dataclass(frozen=True)
class Table:
  """How one table is read off the benchmark rows."""
  files: tuple[str, ...]            # benchmark JSON files, headline then grid
  keys: tuple[str, ...]             # exact-match features
  axes: tuple[str, ...]             # size features
  implementations: tuple[str, ...]  # what the default may choose
  point: Callable[[dict], dict | None]  # a timed row's features, or None: not this table's


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


_chunked_sizes = lambda row: dict(key_dim=row["K"], length=row["T"])
_scan_sizes = lambda row: dict(length=row["shape"][1])
_selective_sizes = lambda row: dict(state=row["shape"][3], length=row["shape"][1])

TABLES = {
    "attention": Table(("attention.json", "attention_grid.json"), ("dtype", "variant"),
                       ("head_dim", "length"), ("flex", "cudnn", "xla"), _attention_point),
    "moe": Table(("moe.json", "moe_grid.json"), (),
                 ("experts", "top_k", "d_model", "d_hidden", "tokens"),
                 ("dense", "ragged_dot", "sort", "gmm"), _moe_point),
    "ssd": Table(("chunked_ops.json", "chunked_grid.json"), (), ("key_dim", "length"),
                 ("pallas", "xla"), _op_point("ssd", _chunked_sizes)),
    "gated_delta_rule": Table(("chunked_ops.json", "chunked_grid.json"), (),
                              ("key_dim", "length"), ("pallas", "xla"),
                              _op_point("gated_delta_rule", _chunked_sizes)),
    "selective_scan": Table(("ssm_scans.json", "scan_grid.json"), (), ("state", "length"),
                            ("pallas", "xla"), _op_point("selective_scan", _selective_sizes)),
    "linear_scan": Table(("ssm_scans.json",), (), ("length",), ("pallas", "xla"),
                         _op_point("linear_scan", _scan_sizes)),
}


def _implementation(row: dict) -> str | None:
  return row.get("impl", row.get("implementation"))


def build(name: str, benchmarks: pathlib.Path) -> dict | None:
  """Table `name` from the JSON files in `benchmarks`, or None when no point
  has two of its implementations timed."""
  spec = TABLES[name]
  times = collections.defaultdict(lambda: collections.defaultdict(list))
  sources, devices, versions = [], set(), set()
  for file in spec.files:
    path = benchmarks / file
    if not path.is_file():
      continue
    data = json.loads(path.read_text())
    used = False
    for row in data["rows"]:
      if row.get("status") != "ok" or row.get("mode") != MODE:
        continue
      impl = _implementation(row)
      point = spec.point(row) if impl in spec.implementations else None
      if point is None:
        continue
      times[tuple(point.items())][impl].append(row["median_ms"])
      used = True
    if used:
      sources.append(file)
      # A merge of runs names each run's environment; one run's file has its own.
      runs = data["sources"].values() if "sources" in data else [data]
      for run in runs:
        environment = run.get("environment", {})
        devices.add(environment.get("device_kind", "unknown"))
        versions.add(environment.get("jax", "unknown"))
  points = [dict(point, ms={impl: round(statistics.median(ms), 5) for impl, ms in sorted(by.items())})
            for point, by in sorted(times.items()) if len(by) >= 2]
  if not points:
    return None
  return dict(table=name, device=", ".join(sorted(devices)), jax=", ".join(sorted(versions)),
              mode=MODE, sources=sources, keys=list(spec.keys), axes=list(spec.axes),
              points=points)


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
      print(f"wrote {path}: {len(table['points'])} points from {', '.join(table['sources'])}")
  if _CHECK.value and stale:
    print(f"stale tables: {stale}; run python -m experiments.dispatch_tables")
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
