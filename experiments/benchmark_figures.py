"""Rebuilds docs/benchmarks/README.md and its figures from the JSON files alone.

    python -m experiments.benchmark_figures [--directory docs/benchmarks]

Every `*.json` there is a harness file (`{"environment": ..., "rows": [...]}`).
For each one the page gets the environment it was measured in, a table of
its rows (the columns that vary, then the measurements) and, where rows carry
`median_ms`, a bar chart `<name>.png`. Where rows differ by an implementation
(`attention`, `implementation` or `impl`) and a peer implementation ('cudnn',
'xla') was timed in the same file, each row gets its time over the peer's at
the same configuration (`<axis>_vs_<peer>`), computed here from the medians.
No number is typed by hand: rerun this after any benchmark and commit the
result.
"""

import glob
import json
import os

from absl import app
from absl import flags

_DIRECTORY = flags.DEFINE_string("directory", "docs/benchmarks", "Where the JSON files are.")

MEASUREMENTS = ["status", "median_ms", "min_ms", "compile_s", "planned_peak_mb", "peak_mb",
                "tflops", "ratio_vs_cudnn", "steps_per_s"]
HIDDEN = {"message", "traceback", "stage", "iters", "wall_s", "kernels"}


def _label_columns(rows: list[dict]) -> list[str]:
  """Configuration columns (not floats) whose value differs between rows."""
  columns = []
  for row in rows:
    for key in row:
      if (key not in columns and key not in HIDDEN and key not in MEASUREMENTS
          and not isinstance(row[key], float)):
        columns.append(key)
  return [c for c in columns if len({json.dumps(r.get(c)) for r in rows}) > 1]


def _measurement_columns(rows: list[dict]) -> list[str]:
  present = [m for m in MEASUREMENTS if any(m in r for r in rows)]
  extra = sorted({k for r in rows for k, v in r.items()
                  if isinstance(v, float) and k not in MEASUREMENTS and k not in HIDDEN})
  return present + extra


IMPLEMENTATION_AXES = ("attention", "implementation", "impl")
PEERS = ("cudnn", "xla")
# Configuration columns that name or tune one implementation, so they differ
# between a row and its peer at the same configuration.
_PER_IMPLEMENTATION = {"blocks", "default_blocks", "name", "chunk_size"}


def peer_ratios(rows: list[dict]) -> list[dict]:
  """Copies of `rows` with `<axis>_vs_<peer>`: median over the peer's median."""
  labels = _label_columns(rows)
  out = [dict(r) for r in rows]
  for axis in IMPLEMENTATION_AXES:
    if axis not in labels:
      continue
    group = [c for c in labels if c != axis and c not in _PER_IMPLEMENTATION]
    key = lambda r: tuple(json.dumps(r.get(c)) for c in group)
    for peer in PEERS:
      medians = {key(r): r["median_ms"] for r in rows
                 if r.get(axis) == peer and r.get("median_ms")}
      for r in out:
        peer_ms = medians.get(key(r))
        if peer_ms and r.get("median_ms") and r.get(axis) != peer:
          r[f"{axis}_vs_{peer}"] = r["median_ms"] / peer_ms
  return out


def _cell(value) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  if isinstance(value, (list, tuple)):
    return "x".join(map(str, value))
  return "" if value is None else str(value)


def table(rows: list[dict]) -> str:
  columns = _label_columns(rows) + _measurement_columns(rows)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
  return "\n".join(lines)


def bar_chart(rows: list[dict], path: str, title: str) -> bool:
  """Horizontal bars of median_ms per ok row; False if there are none."""
  timed = [r for r in rows if r.get("status") == "ok" and "median_ms" in r]
  if not timed:
    return False
  import matplotlib  # Imported here: the page's tables need no plotting library.
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  labels = _label_columns(timed)
  names = [", ".join(f"{c}={_cell(r.get(c))}" for c in labels) or str(i)
           for i, r in enumerate(timed)]
  times = [r["median_ms"] for r in timed]
  fig, ax = plt.subplots(figsize=(9, 0.25 * len(timed) + 1.2))
  ax.barh(range(len(timed)), times, color="tab:blue")
  ax.set_yticks(range(len(timed)), names, fontsize=7)
  ax.invert_yaxis()
  wide = max(times) > 20 * min(times)  # Log scale only where linear would hide bars.
  if wide:
    ax.set_xscale("log")
  ax.set_xlabel("median ms" + (" (log scale)" if wide else ""))
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def main(argv):
  del argv
  directory = _DIRECTORY.value
  sections = ["# Benchmarks", "",
              "Rebuilt by `python -m experiments.benchmark_figures` from the JSON files "
              "beside this page; each section names the program that wrote its file (see "
              "BUILD_NOTES.md) and the machine it ran on. Times are medians of timed calls "
              "after warm-up, blocked with `jax.block_until_ready`; peers were timed in the "
              "same process. Compare ratios within one file, not across files.", ""]
  for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
    with open(path) as f:
      data = json.load(f)
    name = os.path.splitext(os.path.basename(path))[0]
    env = data.get("environment", {})
    rows = data.get("rows", [])
    sections += [f"## {name}", "",
                 "Measured on " + ", ".join(f"{k} {v}" for k, v in env.items()) + ".", ""]
    if bar_chart(rows, os.path.join(directory, f"{name}.png"), name):
      sections += [f"![{name}]({name}.png)", ""]
    sections += [table(peer_ratios(rows)), ""]
  with open(os.path.join(directory, "README.md"), "w") as f:
    f.write("\n".join(sections))
  print(f"wrote {os.path.join(directory, 'README.md')}")


if __name__ == "__main__":
  app.run(main)
