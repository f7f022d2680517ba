"""What every performance page is made of: the suite files, comparisons within a
run, and the Markdown of numbers, tables and sections.

A suite file is either what a benchmark program writes, one run
(`{"environment": ..., "rows": [...]}`), or a merge of several runs
(`{"sources": {run id: {"environment", "commit", "blob"}}, "rows": [...]}`, every
row naming its run in `source`). Every ratio is taken between rows of one run.
"""

import dataclasses
import json
import os
from typing import Callable, Iterable

MANIFEST = "manifest.json"
_MODE_ORDER = {"fwd": 0, "forward": 0, "fwd+bwd": 1, "train_step": 2}


@dataclasses.dataclass(frozen=True)
class Suite:
  """One suite file: its runs (newest first) and its rows, each with `source`."""
  name: str
  file: str
  sources: dict[str, dict]
  rows: list[dict]

  def environment(self, source: str) -> dict:
    return self.sources[source].get("environment", {})


def load_manifest(directory: str) -> dict:
  """The manifest: `{"suites": {name: {"file", "pages", "program", "command", ...}}}`."""
  with open(os.path.join(directory, MANIFEST)) as f:
    return json.load(f)


def load_suite(directory: str, name: str, file: str) -> Suite:
  """Reads a suite file of either form (one run, or merged runs with `sources`).

  Raises:
    ValueError: if a row names a run the file does not describe.
  """
  with open(os.path.join(directory, file)) as f:
    data = json.load(f)
  if "sources" in data:
    sources, rows = data["sources"], data["rows"]
  else:
    # A program's own output: one run, named by the time it was written.
    environment = data.get("environment")
    if not isinstance(environment, dict):
      environment = {"note": str(environment)}
    run_id = environment.get("time", "run")
    sources = {run_id: {"environment": environment}}
    rows = [dict(r, source=run_id) for r in data["rows"]]
  unknown = {r.get("source") for r in rows} - set(sources)
  if unknown:
    raise ValueError(f"{file}: rows name runs {sorted(map(str, unknown))} that `sources` "
                     f"does not describe")
  ordered = dict(sorted(sources.items(), reverse=True))
  return Suite(name=name, file=file, sources=ordered, rows=rows)


def load_suites(directory: str) -> tuple[dict, dict[str, Suite]]:
  """The manifest and the suites whose file is in `directory` (in its order)."""
  manifest = load_manifest(directory)
  suites = {name: load_suite(directory, name, entry["file"])
            for name, entry in manifest["suites"].items()
            if os.path.exists(os.path.join(directory, entry["file"]))}
  return manifest, suites


def suite_or_empty(suites: dict[str, Suite], name: str) -> Suite:
  """`suites[name]`, or an empty suite (no runs, no rows) where it is absent."""
  return suites.get(name) or Suite(name, "", {}, [])


def with_empty(manifest: dict, suites: dict[str, Suite]) -> dict[str, Suite]:
  """`suites` and an empty Suite for each of the manifest's absent ones, so that a
  page fed by several suites says "not measured" where one is missing."""
  return {name: suites.get(name) or Suite(name, entry["file"], {}, [])
          for name, entry in manifest["suites"].items()}



# ---------------------------------------------------------------------------
# Comparisons: rows of one configuration, per implementation, within one run.


@dataclasses.dataclass
class Record:
  """One configuration of one run: `cells[label]` is the chosen row or None."""
  config: dict
  source: str
  cells: dict[str, dict | None]

  def ms(self, label: str, value: str = "median_ms") -> float | None:
    row = self.cells.get(label)
    if row is None or row.get("status", "ok") != "ok":
      return None
    return row.get(value)

  def ratio(self, label: str, peer: str, value: str = "median_ms") -> float | None:
    """`label`'s value over `peer`'s, both of this run (None if either is missing)."""
    a, b = self.ms(label, value), self.ms(peer, value)
    return a / b if a is not None and b else None


def compare(rows: Iterable[dict], *, config: tuple[str, ...],
            label: Callable[[dict], str | None], ours: str,
            needs: tuple[str, ...] = (), value: str = "median_ms") -> list[Record]:
  """Groups rows by configuration and run, one row per implementation label.

  Args:
    rows: suite rows (each with `source`).
    config: the keys that name a configuration (not the implementation).
    label: maps a row to its column label, or None to leave it out. Several
      rows of one label in one configuration (e.g. a peer's block sizes) keep
      the fastest: the peer at its best.
    ours: the label of this library's default path.
    needs: labels of which a run must also have one, to be chosen.
    value: the measurement compared.

  Returns:
    One Record per configuration, from the newest run that measured `ours`
    (and one of `needs`) there, in the order the configurations first appear.
  """
  groups: dict[tuple, dict[str, dict[str, dict]]] = {}
  for row in rows:
    name = label(row)
    if name is None:
      continue
    key = tuple(json.dumps(row.get(k), sort_keys=True) for k in config)
    cells = groups.setdefault(key, {}).setdefault(row["source"], {})
    best = cells.get(name)
    if best is None or _faster(row, best, value):
      cells[name] = row
  records = []
  for key, by_source in groups.items():
    measured = [s for s, cells in by_source.items()
                if ours in cells and (not needs or any(n in cells for n in needs))]
    if not measured:
      continue
    source = max(measured)
    cells = by_source[source]
    some = cells[ours]
    records.append(Record({k: some.get(k) for k in config}, source, dict(cells)))
  return records


def _faster(row: dict, than: dict, value: str) -> bool:
  mine, theirs = row.get(value), than.get(value)
  if row.get("status", "ok") != "ok" or mine is None:
    return False
  return than.get("status", "ok") != "ok" or theirs is None or mine < theirs


# ---------------------------------------------------------------------------
# Formatting.


def number(value, digits: int = 4) -> str:
  """A measurement: `digits` significant figures, thousands separated."""
  if value is None:
    return ""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return str(value)
  if abs(value) >= 1000:
    return f"{value:,.0f}"
  return f"{value:#.{digits}g}".rstrip(".")


def ratio_text(value: float | None) -> str:
  """Three significant figures, trailing zeros kept (0.790, 11.0)."""
  return "" if value is None else f"{value:#.3g}".rstrip(".")


def cell(record: Record, label: str, value: str = "median_ms") -> str:
  """A record's value for `label`, or the row's status where it did not run."""
  row = record.cells.get(label)
  if row is None:
    return "—"
  if row.get("status", "ok") != "ok":
    return row["status"]
  return number(row.get(value))


def run_label(source: str) -> str:
  """`2026-12-05T07:02:15` -> `2026-12-05 07:02`."""
  return source.replace("T", " ")[:16]


def span(values: Iterable[float | None]) -> str:
  """`0.674-0.694`, or one value, from the values that exist."""
  present = sorted(v for v in values if v is not None)
  if not present:
    return "not measured"
  low, high = ratio_text(present[0]), ratio_text(present[-1])
  return low if low == high else f"{low}-{high}"


def mode_key(mode) -> int:
  return _MODE_ORDER.get(mode, 9)


def mode_word(mode: str) -> str:
  return {"fwd": "forward", "train_step": "train step"}.get(mode, mode)


def shape_join(shape) -> str:
  return ", ".join(map(str, shape)) if isinstance(shape, (list, tuple)) else str(shape)


def chunked_shape(config: dict) -> str:
  """A chunked op's shape: `B, T, N, K, V`."""
  return ", ".join(str(config[k]) for k in ("B", "T", "N", "K", "V"))


def not_measured(title: str) -> str:
  return f"{title}: not measured in the committed runs."


def _column_text(value) -> str:
  if isinstance(value, bool):
    return "yes" if value else "no"
  if isinstance(value, (list, tuple)):
    return shape_join(value)
  return "" if value is None else str(value)


# ---------------------------------------------------------------------------
# Tables and sections: every table names the runs its rows come from.


def table(header: list[str], body: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(row) + " |" for row in body]
  return "\n".join(lines)


def run_letters(sources: Iterable[str], start: int = 0) -> dict[str, str]:
  """Short names for a table's runs, newest first: A, B, ..."""
  return {s: chr(ord("A") + start + i) for i, s in enumerate(sorted(set(sources), reverse=True))}


def runs_line(suite: Suite, sources: Iterable[str], letters: dict[str, str] | None = None) -> str:
  """Which runs a table's rows come from (with their letters), device and JAX."""
  parts = []
  for source in sorted(set(sources), reverse=True):
    env = suite.environment(source)
    device = env.get("device_kind", "device not recorded")
    name = f"{letters[source]}: " if letters else ""
    parts.append(f"{name}{run_label(source)} ({device}, JAX {env.get('jax', '?')})")
  if not parts:
    return ""
  which = "run" if len(parts) == 1 else "runs"
  return f"From `{suite.file}`, {which} " + "; ".join(parts) + "."


def run_column(suite: Suite, records: list[Record]) -> tuple[dict[str, str] | None, str]:
  """Letters for a `run` column (None when the rows share one run) and its legend."""
  sources = {r.source for r in records}
  letters = run_letters(sources) if len(sources) > 1 else None
  return letters, runs_line(suite, sources, letters)


def sourced_table(suite: Suite, header: list[str], body: list[list[str]],
                  sources: Iterable[str]) -> str:
  """A table and the line naming the runs of `suite` its rows come from."""
  return table(header, body) + "\n\n" + runs_line(suite, sources)


def run_table(suite: Suite, header: list[str], lines: list[tuple[Record, list[str]]]) -> str:
  """A table of records' lines, with a `run` column of letters where they come
  from more than one run, and its legend."""
  letters, legend = run_column(suite, [r for r, _ in lines])
  if letters:
    header = header + ["run"]
  body = [line + [letters[r.source]] if letters else line for r, line in lines]
  return table(header, body) + "\n\n" + legend


def newest_rows(suite: Suite, keep: Callable[[dict], bool]) -> tuple[str | None, list[dict]]:
  """The rows that `keep` accepts, from the newest run that has any."""
  for source in suite.sources:
    rows = [r for r in suite.rows if r["source"] == source and keep(r)]
    if rows:
      return source, rows
  return None, []


def error_table(suite: Suite, keep: Callable[[dict], bool], columns: list[tuple[str, str]],
                errors: list[tuple[str, str]]) -> str | None:
  """The newest run's check rows: `columns` as text, `errors` to two figures."""
  source, rows = newest_rows(suite, keep)
  if not rows:
    return None
  header = [name for _, name in columns] + [name for _, name in errors]
  body = [[_column_text(r.get(key)) for key, _ in columns]
          + [number(r.get(key), 2) for key, _ in errors] for r in rows]
  return sourced_table(suite, header, body, [source])


def section(heading: str, intro: str | None, body: str | None, missing: str) -> list[str]:
  """A page's section: its heading, what it shows, and `body`, or a line saying
  that `missing` was not measured where `body` is None."""
  return [heading, ""] + ([intro, ""] if intro else []) + [body or not_measured(missing), ""]


def reproduce_section(manifest: dict, names: tuple[str, ...] | None = None) -> list[str]:
  """The commands that write the suites `names` (every suite of `manifest` by default)."""
  suites = {n: e for n, e in manifest["suites"].items() if names is None or n in names}
  out = ["Each suite's file is written by one program; on a CUDA machine with this "
         "repository installed (`pip install -e .` and JAX for CUDA), from the repository "
         "root:", "", "```"]
  for entry in suites.values():
    out.append(f"{entry['command']}    # {entry['file']}")
  out += ["python -m experiments.benchmark_figures    # these pages", "```", "",
          "Each program writes `docs/benchmarks/<suite>.json` unless `--output` names another "
          "path (use one for trial runs). The programs rewrite their file after every row, so "
          "a run cut short keeps what it measured."]
  return out
