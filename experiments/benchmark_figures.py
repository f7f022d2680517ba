r"""Renders the performance pages (docs/performance/*.md) from the curated benchmark JSON.

    python -m experiments.benchmark_figures [--benchmarks docs/benchmarks] \
        [--pages docs/performance]

`docs/benchmarks/manifest.json` names one JSON file per suite, the pages it
feeds and the benchmark program and command that write it; this program reads
those files and no others. A suite file is either what a benchmark program
writes, one run (`{"environment": ..., "rows": [...]}`), or a merge of several
runs (`{"sources": {run id: {"environment", "commit", "blob"}}, "rows": [...]}`,
every row naming its run in `source`; `commit` and `blob` find the original
file in git). Where several runs measured one configuration, its table row
comes from the newest of them, and every ratio is taken between rows of one
run. No number is typed here: rerun this after a benchmark and commit the pages
with the JSON (tests/experiments/test_benchmark_figures.py fails when they
differ).

A suite whose file is not in the directory is left out: the pages it alone
feeds are not written, and the index and setup pages neither link nor list
it. Dropping a measured file in under the manifest's name and rerunning this
program adds its pages. The platforms page is always written: what each
default runs on each GPU kind, from the committed dispatch tables
(`ops/dispatch_tables/*.json`), and the `gpu_check` runs where present.
"""

import dataclasses
import inspect
import json
import os
import re
from typing import Callable, Iterable

from absl import app
from absl import flags

from experiments import dispatch_tables
from experiments import harness
from ops import _measured

_BENCHMARKS = flags.DEFINE_string("benchmarks", "docs/benchmarks",
                                  "Directory of manifest.json and the suite files.")
_PAGES = flags.DEFINE_string("pages", "docs/performance", "Where the pages are written.")

MANIFEST = "manifest.json"
PAGES = ("index", "platforms", "setup", "attention", "kernels", "models", "decoding", "grid")
# Written whatever suites are present.
ALWAYS = ("index", "platforms", "setup")
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


def pages_of(manifest: dict, suites: dict[str, Suite]) -> list[str]:
  """The pages to write, in `PAGES` order: `ALWAYS` and those a present suite feeds."""
  fed = {page for name in suites for page in manifest["suites"][name]["pages"]}
  return [p for p in PAGES if p in ALWAYS or p in fed]


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


def table(header: list[str], body: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(row) + " |" for row in body]
  return "\n".join(lines)


def run_label(source: str) -> str:
  """`2026-12-05T07:02:15` -> `2026-12-05 07:02`."""
  return source.replace("T", " ")[:16]


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


def run_column(suite: Suite, records: list["Record"]) -> tuple[dict[str, str] | None, str]:
  """Letters for a `run` column (None when the rows share one run) and its legend."""
  sources = {r.source for r in records}
  letters = run_letters(sources) if len(sources) > 1 else None
  return letters, runs_line(suite, sources, letters)


def span(values: Iterable[float | None]) -> str:
  """`0.674-0.694`, or one value, from the values that exist."""
  present = sorted(v for v in values if v is not None)
  if not present:
    return "not measured"
  low, high = ratio_text(present[0]), ratio_text(present[-1])
  return low if low == high else f"{low}-{high}"


def _mode_key(mode) -> int:
  return _MODE_ORDER.get(mode, 9)


def not_measured(title: str) -> str:
  return f"{title}: not measured in the committed runs."


# ---------------------------------------------------------------------------
# Attention.


def _attention_label(row: dict) -> str | None:
  if row.get("kind") != "time":
    return None
  impl = row.get("impl", "")
  if impl in ("flex", "cudnn", "xla", "flex_alibi", "flex_documents"):
    return impl
  if impl.startswith("mha_"):
    return "mha"
  return None  # Tile and variant experiments are not the default path.


def attention_records(suite: Suite) -> list[Record]:
  records = compare(suite.rows, config=("B", "N", "T", "H", "causal", "mode", "chain"),
                    label=_attention_label, ours="flex")
  records.sort(key=lambda r: (r.config["H"], -r.config["T"], r.config["causal"],
                              _mode_key(r.config["mode"])))
  return records


def _shape_text(config: dict) -> str:
  text = f"{config['B']}, {config['N']}, {config['T']}, {config['H']}"
  if (config.get("chain") or 1) > 1:
    text += f" (chain {config['chain']})"
  return text


_ATTENTION_PEERS = (("cudnn", "cuDNN"), ("mha", "Pallas `mha` best"), ("xla", "XLA"))


def attention_headlines(records: list[Record]) -> list[str]:
  lines = []
  for head in sorted({r.config["H"] for r in records}):
    at_head = [r for r in records if r.config["H"] == head]
    longest = max(r.config["T"] for r in at_head)
    at_longest = [r for r in at_head if r.config["T"] == longest]
    b, n = at_longest[0].config["B"], at_longest[0].config["N"]
    parts = []
    for mode, name in (("fwd+bwd", "fwd+bwd"), ("fwd", "forward")):
      of_mode = [r for r in at_longest if r.config["mode"] == mode]
      cudnn = span(r.ratio("flex", "cudnn") for r in of_mode)
      mha = span(r.ratio("flex", "mha") for r in of_mode)
      parts.append(f"{name} {cudnn} x cuDNN's time ({mha} x Pallas `mha` at its best blocks)")
    lines.append(f"- Head size {head} (B {b}, N {n}, T {longest}, full and causal): "
                 + "; ".join(parts) + ".")
  return lines


def attention_table(suite: Suite, records: list[Record]) -> str:
  peers = [(key, name) for key, name in _ATTENTION_PEERS
           if any(key in r.cells for r in records)]
  header = (["B, N, T, H", "causal", "mode", "flex ms"] + [f"{name} ms" for _, name in peers]
            + [f"flex / {name}" for _, name in peers])
  letters, legend = run_column(suite, records)
  if letters:
    header.append("run")
  body = []
  for r in records:
    line = ([_shape_text(r.config), "yes" if r.config["causal"] else "no", r.config["mode"],
             cell(r, "flex")] + [cell(r, key) for key, _ in peers]
            + [ratio_text(r.ratio("flex", key)) for key, _ in peers])
    if letters:
      line.append(letters[r.source])
    body.append(line)
  return table(header, body) + "\n\n" + legend


def mods_table(suite: Suite) -> str | None:
  records = compare(suite.rows, config=("B", "N", "T", "H", "causal", "mode", "chain"),
                    label=_attention_label, ours="flex", needs=("flex_alibi", "flex_documents"))
  if not records:
    return None
  records.sort(key=lambda r: (r.config["H"], -r.config["T"], r.config["causal"],
                              _mode_key(r.config["mode"])))
  header = ["B, N, T, H", "causal", "mode", "flex ms", "+ ALiBi `score_mod` ms",
            "+ documents `mask_mod` ms", "cuDNN ms (plain)", "ALiBi / flex",
            "documents / flex"]
  body = [[_shape_text(r.config), "yes" if r.config["causal"] else "no", r.config["mode"],
           cell(r, "flex"), cell(r, "flex_alibi"), cell(r, "flex_documents"), cell(r, "cudnn"),
           ratio_text(r.ratio("flex_alibi", "flex")),
           ratio_text(r.ratio("flex_documents", "flex"))] for r in records]
  return table(header, body) + "\n\n" + runs_line(suite, (r.source for r in records))


def newest_rows(suite: Suite, keep: Callable[[dict], bool]) -> tuple[str | None, list[dict]]:
  """The rows that `keep` accepts, from the newest run that has any."""
  for source in suite.sources:
    rows = [r for r in suite.rows if r["source"] == source and keep(r)]
    if rows:
      return source, rows
  return None, []


def attention_checks(suite: Suite) -> str | None:
  source, rows = newest_rows(suite, lambda r: r.get("kind") == "check")
  if not rows:
    return None
  header = ["B, T, S, N, K, H", "dtype", "options", "status", "forward", "dq", "dk", "dv"]
  body = [[", ".join(map(str, r.get("shape", []))), r.get("dtype", ""),
           ", ".join(r.get("options") or []) or "none", r.get("status", ""),
           number(r.get("fwd_rel"), 2), number(r.get("dq_rel"), 2), number(r.get("dk_rel"), 2),
           number(r.get("dv_rel"), 2)] for r in rows]
  return table(header, body) + "\n\n" + runs_line(suite, [source])


def attention_page(suites: dict[str, Suite], figure: "Figure | None",
                   figure_file: str | None) -> str:
  suite = suites["attention"]
  records = attention_records(suite)
  out = ["# Attention", "",
         "`ops.flex_attention` (`flex`, the path `dot_product_attention` takes on an NVIDIA "
         "GPU where it fits) against cuDNN (`jax.nn.dot_product_attention(..., "
         "implementation='cudnn')`), JAX's Pallas `mha` (the fastest of its block sizes "
         "in the same run) and XLA, bf16, on the shapes of `benchmark_kernel_attention`. "
         "Ratios are flex's time over the peer's, in the same run: below 1 flex is faster. "
         "fwd+bwd is the gradient of a scalar sum with respect to q, k and v; `chain N` "
         "marks shapes timed N calls to an executable, per call ([setup](setup.md)).", ""]
  out += ["## Headlines", ""]
  out += attention_headlines(records) if records else [not_measured("Attention")]
  out += [""] + figure_link(figure, figure_file)
  out += ["## flex against its peers", ""]
  if records:
    out += [attention_table(suite, records), ""]
  else:
    out += [not_measured("The attention table"), ""]
  out += ["## Masks and score modifications", "",
          "Calls cuDNN cannot express: an ALiBi bias as a `score_mod` and 512-token "
          "documents as a `mask_mod`, against plain flex on the same shapes (cuDNN's time "
          "is for plain attention).", ""]
  mods = mods_table(suite)
  out += [mods if mods else not_measured("`mask_mod` and `score_mod` calls"), ""]
  out += ["## Numerics on the GPU", "",
          "Relative L2 error of flex against the float32 reference on the GPU, forward "
          "and gradients.", ""]
  checks = attention_checks(suite)
  out += [checks if checks else not_measured("The GPU check"), ""]
  return "\n".join(out)


# ---------------------------------------------------------------------------
# Kernels: SSM scans, chunked ops, grouped matmul.


def _scan_label(row: dict) -> str | None:
  if row.get("kind") != "time" or not row.get("default_blocks", True):
    return None
  return {"pallas": "pallas", "xla": "xla"}.get(row.get("impl"))


def _shape_join(shape) -> str:
  return ", ".join(map(str, shape)) if isinstance(shape, (list, tuple)) else str(shape)


def scan_records(suite: Suite) -> list[Record]:
  records = compare(suite.rows, config=("op", "shape", "mode"), label=_scan_label,
                    ours="pallas")
  order = {"selective_scan": 0, "linear_scan": 1, "linear_scan_lru": 2}
  records.sort(key=lambda r: (order.get(r.config["op"], 9), r.config["shape"],
                              _mode_key(r.config["mode"])))
  return records


_SCAN_CASES = {
    "selective_scan": ("`ops.selective_scan`", "B, T, D, S"),
    "linear_scan": ("`ops.linear_scan` (a decay per step, complex64)", "B, T, D"),
    "linear_scan_lru": ("`ops.linear_scan` as `LRUCell` calls it (one decay [D], real planes)",
                        "B, T, D"),
}


def scan_headlines(records: list[Record]) -> list[str]:
  """One line per selective-scan shape, one span per linear-scan form (fwd+bwd)."""
  lines = []
  for op, (name, dims) in _SCAN_CASES.items():
    of_op = [r for r in records if r.config["op"] == op and r.config["mode"] == "fwd+bwd"
             and r.ratio("pallas", "xla") is not None]
    if not of_op:
      continue
    if op == "selective_scan":
      for r in of_op:
        value = r.ratio("pallas", "xla")
        lines.append(f"- {name} at {dims} = {_shape_join(r.config['shape'])}, fwd+bwd: "
                     f"{ratio_text(value)} x `lax.associative_scan`'s time "
                     f"({ratio_text(1 / value)} x faster).")
    else:
      shapes = ", ".join(f"({_shape_join(r.config['shape'])})" for r in of_op)
      lines.append(f"- {name}, fwd+bwd: {span(r.ratio('pallas', 'xla') for r in of_op)} x "
                   f"`lax.associative_scan`'s time at {dims} = {shapes}.")
  return lines


def scan_table(suite: Suite, records: list[Record]) -> str:
  letters, legend = run_column(suite, records)
  header = ["op", "B, T, D[, S]", "mode", "Pallas ms", "XLA (associative scan) ms",
            "Pallas / XLA"] + (["run"] if letters else [])
  body = []
  for r in records:
    line = [r.config["op"], _shape_join(r.config["shape"]), r.config["mode"], cell(r, "pallas"),
            cell(r, "xla"), ratio_text(r.ratio("pallas", "xla"))]
    if letters:
      line.append(letters[r.source])
    body.append(line)
  return table(header, body) + "\n\n" + legend


def scan_memory(suite: Suite) -> str | None:
  records = compare(suite.rows, config=("op", "shape", "mode"),
                    label=lambda r: r.get("impl") if r.get("kind") == "memory" else None,
                    ours="pallas")
  if not records:
    return None
  header = ["op", "B, T, D, S", "mode", "Pallas temp MB", "XLA temp MB", "Pallas / XLA memory",
            "Pallas ms", "XLA ms"]
  body = [[r.config["op"], _shape_join(r.config["shape"]), r.config["mode"],
           cell(r, "pallas", "temp_mb"), cell(r, "xla", "temp_mb"),
           ratio_text(r.ratio("pallas", "xla", "temp_mb")), cell(r, "pallas"), cell(r, "xla")]
          for r in records]
  return table(header, body) + "\n\n" + runs_line(suite, (r.source for r in records))


def _chunked_label(row: dict) -> str | None:
  if row.get("kind") != "op":
    return None
  if row.get("implementation") == "xla":
    return "xla"
  if row.get("implementation") == "pallas":
    return "pallas" if row.get("chunk_size") is None else "pallas_other_chunk"
  return None


def chunked_records(suite: Suite) -> list[Record]:
  records = compare(suite.rows, config=("op", "B", "T", "N", "K", "V", "dtype", "mode"),
                    label=_chunked_label, ours="pallas")
  records.sort(key=lambda r: (r.config["N"] * r.config["K"], r.config["op"],
                              _mode_key(r.config["mode"])))
  return records


def _chunked_shape(config: dict) -> str:
  return ", ".join(str(config[k]) for k in ("B", "T", "N", "K", "V"))


def chunked_headlines(records: list[Record]) -> list[str]:
  lines = []
  for op in sorted({r.config["op"] for r in records}):
    of_op = [r for r in records if r.config["op"] == op]
    fwd = span(r.ratio("pallas", "xla") for r in of_op if r.config["mode"] == "fwd")
    both = span(r.ratio("pallas", "xla") for r in of_op if r.config["mode"] == "fwd+bwd")
    shapes = ", ".join(dict.fromkeys(f"({_chunked_shape(r.config)})" for r in of_op))
    lines.append(f"- `ops.{op}`: forward {fwd} x the chunked XLA path's time, fwd+bwd "
                 f"{both} x, at B, T, N, K, V = {shapes}.")
  return lines


def chunked_table(suite: Suite, records: list[Record]) -> str:
  header = ["op", "B, T, N, K, V", "mode", "Pallas ms (default chunk)",
            "Pallas ms (other chunk)", "other chunk", "XLA chunked ms", "Pallas / XLA"]
  body = []
  for r in records:
    other = r.cells.get("pallas_other_chunk")
    body.append([r.config["op"], _chunked_shape(r.config), r.config["mode"], cell(r, "pallas"),
                 cell(r, "pallas_other_chunk"), str(other.get("chunk_size")) if other else "",
                 cell(r, "xla"), ratio_text(r.ratio("pallas", "xla"))])
  return table(header, body) + "\n\n" + runs_line(suite, (r.source for r in records))


def _error_table(suite: Suite, keep: Callable[[dict], bool], columns: list[tuple[str, str]],
                 errors: list[tuple[str, str]]) -> str | None:
  source, rows = newest_rows(suite, keep)
  if not rows:
    return None
  header = [name for _, name in columns] + [name for _, name in errors]
  body = [[_column_text(r.get(key)) for key, _ in columns]
          + [number(r.get(key), 2) for key, _ in errors] for r in rows]
  return table(header, body) + "\n\n" + runs_line(suite, [source])


def _column_text(value) -> str:
  if isinstance(value, bool):
    return "yes" if value else "no"
  if isinstance(value, (list, tuple)):
    return _shape_join(value)
  return "" if value is None else str(value)


def _gmm_label(row: dict) -> str | None:
  return row.get("impl") if row.get("section") == "op" else None


_GMM_NAMES = {
    "pallas": "`ops.grouped_matmul` (default: Mosaic GPU kernels)",
    "pallas_triton": "`ops.grouped_matmul`, Triton kernels",
    "ragged_dot": "`jax.lax.ragged_dot`",
    "every_expert_einsum": "every expert on every row (einsum, G x the work)",
    "dense_matmul_same_flops": "one dense `jnp.matmul` of the same work",
}


def gmm_section(suite: Suite) -> tuple[list[str], str | None]:
  """Headlines and the table of the grouped matmul against its peers."""
  records = compare(suite.rows, config=("rows", "mode"), label=_gmm_label, ours="pallas")
  if not records:
    return [], None
  by_mode = {r.config["mode"]: r for r in records}
  modes = sorted(by_mode, key=_mode_key)
  impls = [i for i in _GMM_NAMES if any(i in r.cells for r in records)]
  header = ["implementation"]
  for mode in modes:
    header += [f"{mode} ms", f"{mode} TFLOP/s", f"{mode}: dense time / this"]
  body = []
  for impl in impls:
    line = [_GMM_NAMES[impl]]
    for mode in modes:
      r = by_mode[mode]
      dense = r.ratio("dense_matmul_same_flops", impl)
      line += [cell(r, impl), cell(r, impl, "tflops"), ratio_text(dense)]
    body.append(line)
  headlines = []
  for mode in modes:
    r = by_mode[mode]
    fraction = r.ratio("dense_matmul_same_flops", "pallas")
    versus = r.ratio("pallas", "ragged_dot")
    headlines.append(f"- `ops.grouped_matmul` {mode} at M {r.config['rows']}: "
                     f"{ratio_text(fraction)} of one dense matmul's rate on the same work; "
                     f"{ratio_text(versus)} x `jax.lax.ragged_dot`'s time.")
  return headlines, table(header, body) + "\n\n" + runs_line(suite, (r.source for r in records))


def kernels_page(suites: dict[str, Suite], figure: "Figure | None",
                 figure_file: str | None) -> str:
  ssm, chunked, moe = suites["ssm_scans"], suites["chunked_ops"], suites["moe"]
  scans = scan_records(ssm)
  chunks = chunked_records(chunked)
  gmm_headlines, gmm_table = gmm_section(moe)
  out = ["# Kernels", "",
         "The Pallas kernels of `ops` against the XLA path of the same op (and, for the "
         "grouped matmul, `jax.lax.ragged_dot` and a dense matmul), timed in the same run. "
         "Ratios are this library's time over the peer's: below 1 the kernel is faster. "
         "fwd+bwd is the gradient of a scalar sum of the outputs with respect to every "
         "input.", "", "## Headlines", ""]
  headlines = scan_headlines(scans) + chunked_headlines(chunks) + gmm_headlines
  out += headlines if headlines else [not_measured("The kernels")]
  out += [""] + figure_link(figure, figure_file)
  out += ["## SSM scans", "",
          "`ops.selective_scan` (Mamba) and `ops.linear_scan` (LRU), float32 (complex64 "
          "for the linear scan), against `lax.associative_scan`, the XLA tier of the same "
          "op.", ""]
  out += [scan_table(ssm, scans) if scans else not_measured("The scans"), ""]
  out += ["### Memory", "",
          "XLA's temporary buffers of the compiled fwd+bwd at the longest shape.", ""]
  memory = scan_memory(ssm)
  out += [memory if memory else not_measured("Scan memory"), ""]
  out += ["### Numerics on the GPU", "",
          "Largest error of each tier against the `lax.scan` reference on the GPU "
          "(relative to the largest reference value).", ""]
  checks = _error_table(ssm, lambda r: r.get("kind") == "check" and "err_y" in r,
                        [("op", "op"), ("impl", "impl"), ("shape", "B, T, D, S"),
                         ("reverse", "reverse")],
                        [("err_y", "y"), ("err_final", "final state"),
                         ("err_grads", "gradients")])
  out += [checks if checks else not_measured("The scan check"), ""]
  out += ["## Chunked ops: SSD and the gated delta rule", "",
          "`ops.ssd` and `ops.gated_delta_rule`, bf16, against their chunked XLA forms "
          "(`implementation='xla'`) in the same run; the Pallas kernel at its default "
          "chunk and at one other.", ""]
  out += [chunked_table(chunked, chunks) if chunks else not_measured("The chunked ops"), ""]
  out += ["### Numerics on the GPU", "",
          "Largest error against the step-by-step reference on the GPU (relative to the "
          "largest reference value).", ""]
  checks = _error_table(chunked, lambda r: r.get("kind") == "check",
                        [("op", "op"), ("implementation", "implementation"),
                         ("dtype", "dtype"), ("shape", "B, T, N, K, V")],
                        [("y_err", "y"), ("final_err", "final state"),
                         ("grad_err", "gradients")])
  out += [checks if checks else not_measured("The chunked-op check"), ""]
  out += ["## Grouped matmul", "",
          "`ops.grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes)` at the MoE layer's "
          "widths (K 512, N 1024, G 8), bf16. TFLOP/s count the grouped work (fwd+bwd: "
          "three times the forward's).", ""]
  out += [gmm_table if gmm_table else not_measured("The grouped matmul"), ""]
  return "\n".join(out)


# ---------------------------------------------------------------------------
# Models.


def _attention_model_label(row: dict) -> str | None:
  return row.get("attention")


_MODEL_NAMES = {"transformer": "Transformer", "dit": "DiffusionTransformer"}
_MODEL_SHORT = {"transformer": "Transformer", "dit": "DiT"}
_SSM_CELLS = {"lru": "LRUCell", "mamba": "MambaCell"}
_MODEL_PEERS = (("cudnn", "cuDNN"), ("xla", "XLA"))


def model_records(suite: Suite) -> list[Record]:
  records = compare(suite.rows, config=("model", "dtype", "tokens", "batch", "mode"),
                    label=_attention_model_label, ours="default")
  models = list(_MODEL_NAMES)
  records.sort(key=lambda r: (models.index(r.config["model"]) if r.config["model"] in models
                              else 9, r.config["dtype"] != "bfloat16", -r.config["tokens"],
                              _mode_key(r.config["mode"])))
  return records


def newest_train_steps(suite: Suite) -> list[Record]:
  """The train steps of the newest run that timed cuDNN beside the default."""
  steps = [r for r in model_records(suite) if r.config["mode"] == "train_step"
           and r.ratio("default", "cudnn") is not None]
  newest = max((r.source for r in steps), default=None)
  return [r for r in steps if r.source == newest]


def model_table(suite: Suite, records: list[Record]) -> str:
  peers = [(k, n) for k, n in _MODEL_PEERS if any(k in r.cells for r in records)]
  letters, legend = run_column(suite, records)
  header = (["model", "dtype", "tokens", "mode", "default ms"] + [f"{n} ms" for _, n in peers]
            + [f"default / {n}" for _, n in peers] + (["run"] if letters else []))
  body = []
  for r in records:
    c = r.config
    line = ([_MODEL_SHORT.get(c["model"], c["model"]), c["dtype"], str(c["tokens"]),
             c["mode"].replace("_", " "), cell(r, "default")] + [cell(r, k) for k, _ in peers]
            + [ratio_text(r.ratio("default", k)) for k, _ in peers])
    if letters:
      line.append(letters[r.source])
    body.append(line)
  return table(header, body) + "\n\n" + legend


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
  out += [table(header, body), "", runs_line(suite, [source])]
  return out


def ssm_model_section(suites: dict[str, Suite]) -> list[str]:
  body = []
  ssm = suites["ssm_scans"]
  scans = compare(ssm.rows, config=("model", "cell", "dtype", "batch", "time", "mode"),
                  label=lambda r: r.get("impl") if r.get("kind") == "model" else None,
                  ours="pallas")
  scan_letters = run_letters(r.source for r in scans)
  for r in sorted(scans, key=lambda r: (r.config["cell"], _mode_key(r.config["mode"]))):
    mode = "forward" if r.config["mode"] == "fwd" else "train step (Adam)"
    body.append([_SSM_CELLS.get(r.config["cell"], r.config["cell"]), str(r.config["time"]), mode,
                 cell(r, "pallas"), cell(r, "xla"), ratio_text(r.ratio("pallas", "xla")),
                 scan_letters[r.source]])
  chunked = suites["chunked_ops"]
  chunks = compare(chunked.rows, config=("cell", "B", "T", "dtype", "step"),
                   label=lambda r: (("default" if r.get("implementation") in (None, "None")
                                     else r.get("implementation"))
                                    if r.get("kind") == "model" else None),
                   ours="default")
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


def moe_section(suite: Suite) -> list[str]:
  records = compare(suite.rows, config=("tokens", "mode"),
                    label=lambda r: r.get("impl") if r.get("section") == "moe" else None,
                    ours="auto")
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
  out += [table(["tokens", "dropless_impl", "forward ms", "fwd+bwd ms", "fwd+bwd / dense",
                 "fwd+bwd / ragged_dot"], body), "",
          runs_line(suite, (r.source for r in records))]
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
  out += [table(["case", "steps/s", "time / bare loop", "min-max"], body), "",
          runs_line(suite, [source])]
  return out


def reproduce_section(manifest: dict) -> list[str]:
  out = ["Each suite's file is written by one program; on a CUDA machine with this "
         "repository installed (`pip install -e .` and JAX for CUDA), from the repository "
         "root:", "", "```"]
  for name, entry in manifest["suites"].items():
    out.append(f"{entry['command']}    # {entry['file']}")
  out += ["python -m experiments.benchmark_figures    # these pages", "```", "",
          "Each program writes `docs/benchmarks/<suite>.json` unless `--output` names another "
          "path (use one for trial runs). The programs rewrite their file after every row, so "
          "a run cut short keeps what it measured."]
  return out


def models_page(manifest: dict, suites: dict[str, Suite], figure: "Figure | None",
                figure_file: str | None) -> str:
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
      out.append(f"- {_MODEL_NAMES.get(c['model'], c['model'])} train step, {c['dtype']}, "
                 f"{c['tokens']} tokens: {ratio_text(r.ratio('default', 'cudnn'))} x the "
                 "same model with cuDNN attention.")
  else:
    out.append(not_measured("The model train steps"))
  out += [""] + figure_link(figure, figure_file)
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
        ("model", "dtype", "tokens", "mode"), {"model": _MODEL_NAMES})
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


# ---------------------------------------------------------------------------
# Decoding: the split-K kernel and generation end to end.

_DECODE_IMPLS = ("pallas", "xla", "jax_nn_xla", "cudnn")


def _decode_kernel_label(row: dict) -> str | None:
  if row.get("section") != "kernel" or row.get("kind") != "time":
    return None
  impl = row.get("impl")
  return impl if impl in _DECODE_IMPLS else None  # Tiled variants are tuning runs.


def decode_kernel_records(suite: Suite) -> list[Record]:
  records = compare(suite.rows, config=("B", "T", "S", "N", "K", "H", "dtype", "fill"),
                    label=_decode_kernel_label, ours="pallas")
  records.sort(key=lambda r: (r.config["dtype"], r.config["T"], r.config["S"], r.config["B"],
                              r.config["K"], r.config["N"], r.config["H"]))
  return records


def _floor_ms(record: Record) -> float | None:
  """The bandwidth floor of a kernel record (the same in every row of its shape)."""
  return next((row.get("floor_ms") for row in record.cells.values() if row.get("floor_ms")),
              None)


def _over_floor(record: Record) -> float | None:
  ms, floor = record.ms("pallas"), _floor_ms(record)
  return ms / floor if ms is not None and floor else None


def decode_kernel_table(suite: Suite, records: list[Record]) -> str:
  several_t = len({r.config["T"] for r in records}) > 1
  letters, legend = run_column(suite, records)
  header = (["B", "S", "K", "N", "H"] + (["T"] if several_t else [])
            + ["Pallas ms", "XLA ms", "jax.nn XLA ms", "cuDNN ms", "floor ms",
               "Pallas / floor", "XLA / Pallas", "cuDNN / Pallas"] + (["run"] if letters else []))
  body = []
  for r in records:
    c = r.config
    line = ([str(c[k]) for k in ("B", "S", "K", "N", "H")] + ([str(c["T"])] if several_t else [])
            + [cell(r, impl) for impl in _DECODE_IMPLS] + [number(_floor_ms(r)),
               ratio_text(_over_floor(r)), ratio_text(r.ratio("xla", "pallas")),
               ratio_text(r.ratio("cudnn", "pallas"))])
    if letters:
      line.append(letters[r.source])
    body.append(line)
  return table(header, body) + "\n\n" + legend


def _bandwidth_tbps(records: list[Record]) -> float | None:
  """The bandwidth the run's floor assumes: a Pallas row's `tbps` (floor bytes over
  its time) times its time over the floor."""
  for r in records:
    row = r.cells.get("pallas") or {}
    if row.get("status") == "ok" and row.get("tbps") and row.get("floor_ms"):
      return row["tbps"] * row["median_ms"] / row["floor_ms"]
  return None


_GENERATE_MODELS = {
    "transformer": "Transformer, default attention",
    "transformer_xla": "Transformer, XLA attention",
    "mamba2": "SSMModel, Mamba2Cell",
    "gated_deltanet": "SSMModel, GatedDeltaNetCell",
}


def generate_records(suite: Suite) -> list[Record]:
  """Per batch size (and prompt, length, vocabulary): each model's summary row,
  all from one run, with the default-attention Transformer."""
  records = compare(suite.rows, config=("B", "T", "G", "V", "dtype", "temperature"),
                    label=lambda r: (r.get("model") if r.get("section") == "generate"
                                     and r.get("kind") == "summary" else None),
                    ours="transformer", value="per_token_ms")
  records.sort(key=lambda r: (r.config["dtype"], r.config["T"], r.config["G"], r.config["B"]))
  return records


def _generate_models(records: list[Record]) -> list[str]:
  seen = {m for r in records for m in r.cells}
  return [m for m in _GENERATE_MODELS if m in seen] + sorted(seen - set(_GENERATE_MODELS))


def generate_table(suite: Suite, records: list[Record]) -> str:
  letters, legend = run_column(suite, records)
  header = (["model", "layers", "params", "batch", "prefill ms", "per-token ms", "tokens/s",
             "per-token / Transformer's"] + (["run"] if letters else []))
  body = []
  for r in records:
    for model in _generate_models([r]):
      row = r.cells[model]
      line = [_GENERATE_MODELS.get(model, model), str(row.get("num_layers", "")),
              number(row.get("params")), str(r.config["B"]), cell(r, model, "prefill_ms"),
              cell(r, model, "per_token_ms"), cell(r, model, "tokens_per_s"),
              ratio_text(r.ratio(model, "transformer", "per_token_ms"))]
      if letters:
        line.append(letters[r.source])
      body.append(line)
  return table(header, body) + "\n\n" + legend


def decoding_headlines(suite: Suite) -> list[str]:
  kernel = decode_kernel_records(suite)
  lines = []
  if any(_over_floor(r) is not None for r in kernel):
    line = (f"- `ops.decode_attention`'s split-K kernel: {span(_over_floor(r) for r in kernel)}"
            " x the time of reading the KV cache at the bandwidth floor")
    if any(r.ratio("cudnn", "pallas") for r in kernel):
      line += f"; cuDNN takes {span(r.ratio('cudnn', 'pallas') for r in kernel)} x its time"
    if any(r.ratio("xla", "pallas") for r in kernel):
      line += f", its XLA path {span(r.ratio('xla', 'pallas') for r in kernel)} x"
    lines.append(line + ".")
  for r in generate_records(suite):
    others = [(m, r.ratio(m, "transformer", "per_token_ms")) for m in _generate_models([r])
              if m != "transformer"]
    parts = [f"{_GENERATE_MODELS.get(m, m)} {ratio_text(v)} x" for m, v in others
             if v is not None]
    if parts:
      lines.append(f"- Generation at batch {r.config['B']}, per token against the Transformer "
                   "with its default attention: " + "; ".join(parts) + ".")
  return lines


def decoding_page(manifest: dict, suites: dict[str, Suite]) -> str:
  suite = suites["decode"]
  kernel = decode_kernel_records(suite)
  generate = generate_records(suite)
  out = ["# Decoding", "",
         "Autoregressive decoding on one GPU: `ops.decode_attention`, the split-K kernel that "
         "`dot_product_attention` picks for one new query per sequence, against the peers "
         "on the same KV cache, and `pk.generate` end to end on Transformer and SSM language "
         "models. Every ratio is between rows of one run.", "", "## Headlines", ""]
  headlines = decoding_headlines(suite)
  out += headlines if headlines else [not_measured("Decoding")]
  out += ["", "## The decode attention kernel", ""]
  if kernel:
    bandwidth = _bandwidth_tbps(kernel)
    first = kernel[0].config
    queries = {r.config["T"] for r in kernel}
    tokens = ("One new token" if queries == {1} else f"T = {first['T']} new tokens"
              if len(queries) == 1 else "T new tokens")
    fill = f"{first['fill']:.0%}".replace("%", " %")
    out += [f"{tokens} per sequence against a cache of S slots, {fill} full, "
            f"{first['dtype']}, N query heads over K key/value heads of size H. Pallas and "
            "XLA are `ops.decode_attention` with `implementation='pallas'` / `'xla'`; jax.nn "
            "XLA and cuDNN are `jax.nn.dot_product_attention` on the same cache with the "
            "lengths as its key lengths. The floor is the time to read the keys and values "
            "each call must read" + (f" at {number(bandwidth, 3)} TB/s" if bandwidth else "")
            + "; `XLA / Pallas` and `cuDNN / Pallas` above 1 mean the kernel is faster.", "",
            decode_kernel_table(suite, kernel), ""]
  else:
    out += [not_measured("The decode kernel"), ""]
  out += ["### Numerics on the GPU", "",
          "Relative L2 error of the kernel against the float32 reference on the GPU "
          "(key lengths that differ per sequence, GQA and MHA, a window).", ""]
  checks = _error_table(suite, lambda r: r.get("section") == "kernel"
                        and r.get("kind") == "check",
                        [("shape", "B, T, S, N, K, H"), ("dtype", "dtype"), ("window", "window"),
                         ("status", "status"), ("finite", "finite")], [("rel", "error")])
  out += [checks if checks else not_measured("The decode kernel's check"), ""]
  out += ["## Generation", ""]
  if generate:
    row = generate[0].cells["transformer"]
    out += [f"`pk.generate` of G = {row.get('G')} tokens after a {row.get('T')}-token random "
            f"prompt, vocabulary {row.get('V')}, {row.get('dtype')} parameters, temperature "
            f"{row.get('temperature')}, one compiled call. The Transformer is "
            f"`Transformer({row.get('model_dim')}, {row.get('num_heads')}, "
            f"{row.get('num_layers')}, num_kv_heads={row.get('num_kv_heads')})` with RoPE; "
            "the SSMs have its width and the depth that brings their parameter count nearest "
            "its. `prefill ms` is the prompt's prefill alone; `per-token ms` is (the whole "
            "call - the prefill) / (G - 1), one decoding step; `tokens/s` is B x G over the "
            "whole call. `params` counts the embedding and the output projection too.", "",
            generate_table(suite, generate), ""]
  else:
    out += [not_measured("Generation"), ""]
  out += ["## How to reproduce", ""] + reproduce_section(
      dict(manifest, suites={n: e for n, e in manifest["suites"].items() if n == "decode"}))
  return "\n".join(out)


# ---------------------------------------------------------------------------
# The shape grid: the default against the best peer at every point.

# The targets the grid is judged by: the default's time over the peer's.
ATTENTION_SHARE = 0.8    # attention: at or below the best peer at this share of points,
ATTENTION_LIMIT = 1.10   # and never above this ratio
LOSS_MARGIN = 1.05       # the attention points listed as losses: above this ratio

_GRID_PEERS = ("cudnn", "tokamax_mosaic", "tokamax_triton")
_GRID_OURS = ("flex", "cudnn", "xla")
_GRID_NAMES = {"flex": "flex", "cudnn": "cuDNN", "xla": "XLA", "default": "default",
               "tokamax_mosaic": "tokamax Mosaic", "tokamax_triton": "tokamax Triton",
               "pallas": "Pallas", "tokamax_ragged_dot": "tokamax.ragged_dot",
               "ragged_dot": "ragged_dot"}


def _with_default(rows: Iterable[dict], choice: dict[tuple, str], key: Callable[[dict], tuple],
                  label: Callable[[dict], tuple[str, ...]]) -> list[dict]:
  """Rows with a `_label` each (a row under several labels is repeated): the labels
  `label` gives, and 'default' for the row of what the default ran. A row timing
  the default itself (impl 'default') is that row; otherwise it is the row of the
  implementation the run's summary says the default picks (`choice[key(row)]`)."""
  rows = list(rows)
  timed_itself = {key(r) for r in rows if r.get("impl") == "default"}
  out = []
  for r in rows:
    names = set(label(r))
    if r.get("impl") == "default" or (key(r) not in timed_itself
                                      and _impl_of(r) == choice.get(key(r))):
      names.add("default")
    out += [dict(r, _label=name) for name in sorted(names)]
  return out


def _impl_of(row: dict) -> str | None:
  if "impl" in row:
    return row["impl"]
  # benchmark_kernel_ssd: `implementation`, and the default chunk where `chunk_size` is None.
  if row.get("implementation") == "pallas" and row.get("chunk_size") is not None:
    return None
  return row.get("implementation")


def _labelled(row: dict) -> str:
  return row["_label"]


def attention_grid_records(suite: Suite) -> list[Record]:
  """Per (point, mode): 'default', 'peer' (the fastest of cuDNN and tokamax) and
  each implementation timed, from one run."""
  summaries = [r for r in suite.rows if r.get("grid") == "attention"
               and r.get("kind") == "summary"]
  key = lambda r: (r["source"], r.get("point"), r.get("mode"))
  choice = {key(r): r.get("default_impl") for r in summaries}
  rows = [r for r in suite.rows if r.get("grid") == "attention" and r.get("kind") == "time"]
  labelled = _with_default(rows, choice, key, lambda r: (r.get("impl"),) + (
      ("peer",) if r.get("impl") in _GRID_PEERS else ()))
  records = compare(labelled, config=("point", "variant", "dtype", "causal", "window", "H",
                                      "B", "T", "S", "N", "K", "mode"),
                    label=_labelled, ours="default")
  for r in records:  # What the default ran: the summary's choice, or the row's own impl.
    impl = r.cells["default"].get("impl")
    r.config["default_impl"] = (choice.get((r.source, r.config["point"], r.config["mode"]))
                                if impl == "default" else impl)
  variants = {v: i for i, v in enumerate(("full", "causal", "sliding_window", "gqa", "cross"))}
  records.sort(key=lambda r: (r.config["dtype"] != "bfloat16", _mode_key(r.config["mode"]),
                              variants.get(r.config["variant"], 9), r.config["H"],
                              r.config["S"]))
  return records


def judge(record: Record, ours: str, peer: str) -> float | str | None:
  """`ours`'s time over `peer`'s at one point; the default's status where it did
  not run and the peer did; None where there is nothing to compare (no peer ran)."""
  if record.ms(peer) is None:
    return None
  row = record.cells.get(ours)
  if row is not None and row.get("status", "ok") != "ok":
    return row["status"]
  return record.ratio(ours, peer)


@dataclasses.dataclass(frozen=True)
class TargetCount:
  """How the default fares against a target over the points where it was judged."""
  points: int               # points judged (a peer ran there)
  at_or_below: int          # the default's time <= the peer's
  above_limit: int          # above the limit, or the default did not run
  failed: int               # the default did not run where the peer did
  worst: float | None       # the largest ratio
  held: bool                # at_or_below >= share * points and above_limit == 0
  not_judged: int           # points where no peer ran


def count_target(outcomes: Iterable[float | str | None], *, share: float,
                 limit: float) -> TargetCount:
  """Counts `judge`'s outcomes against "<= 1 at `share` of the points, never above `limit`".

  Args:
    outcomes: per point, a ratio (the default's time over the peer's), the
      default's status where it did not run, or None where nothing was compared.
    share: the fraction of judged points at which the ratio must be <= 1.
    limit: the ratio no point may exceed (1: at or below the peer everywhere).

  Returns:
    The counts; `held` is False when no point was judged.
  """
  outcomes = list(outcomes)
  ratios = [v for v in outcomes if v is not None and not isinstance(v, str)]
  failed = sum(isinstance(v, str) for v in outcomes)
  points = len(ratios) + failed
  at_or_below = sum(v <= 1.0 for v in ratios)
  above = failed + sum(v > limit for v in ratios)
  return TargetCount(points=points, at_or_below=at_or_below, above_limit=above, failed=failed,
                     worst=max(ratios, default=None),
                     held=points > 0 and at_or_below >= share * points - 1e-9 and above == 0,
                     not_judged=sum(v is None for v in outcomes))


@dataclasses.dataclass(frozen=True)
class GridTarget:
  """One row of the targets table: an op's comparison in one mode, and its counts."""
  op: str
  peer: str
  mode: str
  target: str
  count: TargetCount


def _by_mode(records: list[Record], ours: str, peer: str) -> dict[str, list]:
  out = {}
  for r in records:
    out.setdefault(r.config["mode"], []).append(judge(r, ours, peer))
  return dict(sorted(out.items(), key=lambda item: _mode_key(item[0])))


def moe_grid_records(suite: Suite) -> tuple[list[Record], list[Record]]:
  """The grouped matmul's records (ours 'pallas') and the MoE layer's ('auto')."""
  op = compare(suite.rows, config=("point", "experts", "top_k", "d_model", "d_hidden", "rows",
                                   "mode"),
               label=lambda r: (r.get("impl") if r.get("section") == "op"
                                and r.get("point") is not None else None), ours="pallas")
  layer = compare(suite.rows, config=("point", "experts", "top_k", "d_model", "d_hidden",
                                      "tokens", "mode"),
                  label=lambda r: (r.get("impl") if r.get("section") == "moe"
                                   and r.get("point") is not None else None), ours="auto")
  order = lambda r: (_mode_key(r.config["mode"]), r.config["experts"], r.config["top_k"],
                     r.config["d_model"], r.config["d_hidden"])
  return sorted(op, key=order), sorted(layer, key=order)


def chunked_grid_records(suite: Suite) -> list[Record]:
  """Per (op, point, mode): 'default' (what the summary says the default ran),
  'pallas' (the default chunk) and 'xla', from one run."""
  key = lambda r: (r["source"], r.get("op"), r.get("point"), r.get("mode"))
  choice = {key(r): r.get("default_impl") for r in suite.rows if r.get("kind") == "summary"
            and r.get("point") is not None}
  rows = [r for r in suite.rows if r.get("kind") == "op" and r.get("point") is not None]
  labelled = _with_default(rows, choice, key,
                           lambda r: tuple(n for n in (_impl_of(r),) if n in ("pallas", "xla")))
  records = compare(labelled, config=("op", "point", "B", "T", "N", "K", "V", "dtype", "mode"),
                    label=_labelled, ours="default")
  for r in records:
    r.config["default_impl"] = _impl_of(r.cells["default"])
  records.sort(key=lambda r: (r.config["op"], _mode_key(r.config["mode"]), r.config["K"],
                              r.config["T"]))
  return records


def scan_grid_records(suite: Suite) -> list[Record]:
  records = compare(suite.rows, config=("op", "point", "shape", "mode"),
                    label=lambda r: (r.get("impl") if r.get("kind") == "time"
                                     and r.get("point") is not None
                                     and r.get("default_blocks", True) else None),
                    ours="pallas")
  records.sort(key=lambda r: (r.config["op"], _mode_key(r.config["mode"]), r.config["shape"]))
  return records


def _per_op(records: list[Record]) -> dict[str, list[Record]]:
  out = {}
  for r in records:
    out.setdefault(r.config["op"], []).append(r)
  return out


def grid_targets(suites: dict[str, Suite]) -> list[GridTarget]:
  """The targets over the grid suites' rows, per op and mode: attention against the
  fastest of cuDNN and tokamax; the grouped matmul against tokamax.ragged_dot; the
  chunked ops and the selective scan against their XLA tier. An absent suite has none."""
  out = []
  attention = attention_grid_records(suite_or_empty(suites, "attention_grid"))
  share = f"{ATTENTION_SHARE:.0%}".replace("%", " %")
  for mode, outcomes in _by_mode(attention, "default", "peer").items():
    out.append(GridTarget(
        "attention", "fastest of cuDNN and tokamax", mode,
        f"<= 1 at >= {share} of points, never > {ratio_text(ATTENTION_LIMIT)}",
        count_target(outcomes, share=ATTENTION_SHARE, limit=ATTENTION_LIMIT)))
  everywhere = dict(share=1.0, limit=1.0)
  comparisons = [
      ("`ops.grouped_matmul`", "`tokamax.ragged_dot`", "pallas", "tokamax_ragged_dot",
       moe_grid_records(suite_or_empty(suites, "moe_grid"))[0]),
      (None, "its chunked XLA form", "default", "xla",
       chunked_grid_records(suite_or_empty(suites, "chunked_grid"))),
      (None, "`lax.associative_scan`", "pallas", "xla",
       scan_grid_records(suite_or_empty(suites, "scan_grid"))),
  ]
  for name, peer_name, ours, peer, records in comparisons:
    groups = {name: records} if name else {f"`ops.{op}`": of_op
                                           for op, of_op in _per_op(records).items()}
    for op, of_op in groups.items():
      for mode, outcomes in _by_mode(of_op, ours, peer).items():
        out.append(GridTarget(op, peer_name, mode, "<= 1 at every point",
                              count_target(outcomes, **everywhere)))
  return out


def _share_text(part: int, whole: int) -> str:
  return f"{part} of {whole}" + (f" ({part / whole:.0%})".replace("%", " %") if whole else "")


def targets_table(targets: list[GridTarget]) -> str:
  header = ["op", "against", "mode", "target (default / peer)", "points", "default <= peer",
            "above the limit", "default did not run", "worst ratio", "met"]
  body = [[t.op, t.peer, _mode_word(t.mode), t.target, str(t.count.points),
           _share_text(t.count.at_or_below, t.count.points), str(t.count.above_limit),
           str(t.count.failed), ratio_text(t.count.worst),
           ("yes" if t.count.held else "no") if t.count.points else "not measured"]
          for t in targets]
  return table(header, body)


def grid_headlines(targets: list[GridTarget]) -> list[str]:
  """One line per op: its counts in each mode and whether the target held in all."""
  ops = {}
  for t in targets:
    if t.count.points:
      ops.setdefault((t.op, t.peer, t.target), []).append(t)
  lines = []
  for (op, peer, target), of_op in ops.items():
    counts = []
    for t in of_op:
      worst = f"{ratio_text(t.count.worst)} x" if t.count.worst is not None else "not run"
      counts.append(f"{_mode_word(t.mode)} at {_share_text(t.count.at_or_below, t.count.points)}"
                    f" points (worst {worst})")
    counts = "; ".join(counts)
    met = "met" if all(t.count.held for t in of_op) else "not met"
    lines.append(f"- Shape grid, {op}: the default at or below {peer} {counts}; target "
                 f"({target}): {met}.")
  return lines


def _point_text(config: dict) -> str:
  return f"H {config['H']}, L {config['S']}, {config['variant'].replace('_', ' ')}"


def _variant_text(config: dict) -> str:
  """What a variant's masks and heads are, from one of its records."""
  parts = ["causal" if config["causal"] else "not causal"]
  if config.get("window"):
    parts.append(f"a window of {config['window'][0]} keys to the left")
  if config["K"] != config["N"]:
    parts.append(f"{config['N']} query heads over {config['K']} key/value heads")
  if config["T"] != config["S"]:
    parts.append(f"T = {config['T']} queries against S = L keys")
  return f"`{config['variant']}` ({', '.join(parts)})"


def attention_losses(suite: Suite, records: list[Record]) -> str | None:
  """The points where the default takes more than LOSS_MARGIN x the best peer's time."""
  losing = [r for r in records
            if isinstance(v := judge(r, "default", "peer"), str)
            or (v is not None and v > LOSS_MARGIN)]
  if not losing:
    return None
  letters, legend = run_column(suite, losing)
  header = (["H, L, variant", "dtype", "mode", "B, T, S, N, K", "default runs", "default ms",
             "best peer", "peer ms", "default / peer", "fastest of ours"]
            + (["run"] if letters else []))
  body = []
  for r in losing:
    c = r.config
    peer = r.cells["peer"]
    ours = [(n, r.ms(n)) for n in _GRID_OURS if r.ms(n) is not None]
    fastest = min(ours, key=lambda item: item[1]) if ours else None
    line = [_point_text(c), c["dtype"], _mode_word(c["mode"]),
            ", ".join(str(c[k]) for k in ("B", "T", "S", "N", "K")),
            _GRID_NAMES.get(c["default_impl"], str(c["default_impl"])), cell(r, "default"),
            _GRID_NAMES.get(peer["impl"], peer["impl"]), cell(r, "peer"),
            ratio_text(r.ratio("default", "peer")),
            f"{_GRID_NAMES[fastest[0]]} ({number(fastest[1])} ms)" if fastest else ""]
    if letters:
      line.append(letters[r.source])
    body.append(line)
  return table(header, body) + "\n\n" + legend


def moe_grid_table(suite: Suite, op: list[Record], layer: list[Record]) -> str:
  layers = {(r.config["point"], r.config["mode"]): r for r in layer}
  header = ["experts, top-k", "d_model, d_hidden", "mode", "M", "Pallas ms",
            "tokamax.ragged_dot ms", "ragged_dot ms", "Pallas / tokamax", "Pallas / ragged_dot",
            "layer: 'auto' ms", "fastest other path", "'auto' / it"]
  body = []
  for r in op:
    c = r.config
    lay = layers.get((c["point"], c["mode"]))
    others = ([(n, lay.ms(n)) for n in lay.cells if n != "auto" and lay.ms(n) is not None]
              if lay else [])
    fastest = min(others, key=lambda item: item[1]) if others else None
    body.append([f"{c['experts']}, {c['top_k']}", f"{c['d_model']}, {c['d_hidden']}",
                 _mode_word(c["mode"]), str(c["rows"]), cell(r, "pallas"),
                 cell(r, "tokamax_ragged_dot"), cell(r, "ragged_dot"),
                 ratio_text(r.ratio("pallas", "tokamax_ragged_dot")),
                 ratio_text(r.ratio("pallas", "ragged_dot")),
                 cell(lay, "auto") if lay else "—",
                 f"'{fastest[0]}' ({number(fastest[1])} ms)" if fastest else "",
                 ratio_text(lay.ms("auto") / fastest[1])
                 if fastest and lay.ms("auto") is not None else ""])
  return table(header, body) + "\n\n" + runs_line(
      suite, {r.source for r in op} | {r.source for r in layer})


def chunked_grid_table(suite: Suite, records: list[Record]) -> str:
  header = ["op", "B, T, N, K, V", "mode", "default runs", "default ms", "Pallas ms",
            "XLA ms", "default / XLA"]
  body = [[r.config["op"], _chunked_shape(r.config), _mode_word(r.config["mode"]),
           _GRID_NAMES.get(r.config["default_impl"], str(r.config["default_impl"])),
           cell(r, "default"), cell(r, "pallas"), cell(r, "xla"),
           ratio_text(r.ratio("default", "xla"))] for r in records]
  return table(header, body) + "\n\n" + runs_line(suite, {r.source for r in records})


def scan_grid_table(suite: Suite, records: list[Record]) -> str:
  header = ["op", "B, T, D, S", "mode", "Pallas ms", "XLA (associative scan) ms",
            "Pallas / XLA"]
  body = [[r.config["op"], _shape_join(r.config["shape"]), _mode_word(r.config["mode"]),
           cell(r, "pallas"), cell(r, "xla"), ratio_text(r.ratio("pallas", "xla"))]
          for r in records]
  return table(header, body) + "\n\n" + runs_line(suite, {r.source for r in records})


_GRID_SUITES = ("attention_grid", "moe_grid", "chunked_grid", "scan_grid")


def _relative_errors(row: dict) -> list[float]:
  """A check row's error fields (`fwd_rel`, `y_err`, `err_grads`, `rel`, ...)."""
  return [v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
          and (k == "rel" or k.endswith(("_rel", "_err")) or k.startswith("err_"))]


def grid_checks(suites: dict[str, Suite]) -> str | None:
  """The on-device checks run at the grid's points (`--grid_check`): per op and
  implementation the points checked, skipped and failed and the largest
  relative error; then every failure with its message."""
  counts, failures, sources = {}, [], []
  for name in _GRID_SUITES:
    if name not in suites:
      continue
    suite = suites[name]
    source, rows = newest_rows(suite, lambda r: r.get("grid") and "check" in (
        r.get("kind"), r.get("section")))
    if rows:
      sources.append(runs_line(suite, [source]))
    for r in rows:
      # A chunked op's `name` tells its configurations apart (ssd/pallas_chunk128).
      impl = (str(r.get("name", "")).split("/")[-1] or r.get("impl") or r.get("implementation")
              or r.get("case"))
      key = (r.get("op") or r["grid"], impl)
      count = counts.setdefault(key, dict(ok=0, unsup=0, failed=0, worst=[]))
      if r.get("status") == "ok":
        count["ok"] += 1
        count["worst"] += _relative_errors(r)
      elif r.get("status") == "unsup":
        count["unsup"] += 1
      else:
        count["failed"] += 1
        failures.append([f"`{key[0]}`", str(key[1]), str(r.get("point")), str(r.get("status")),
                         str(r.get("message", ""))[:200].replace("|", "/").replace("\n", " ")])
  if not counts:
    return None
  body = [[f"`{op}`", str(impl), str(c["ok"]), str(c["unsup"]), str(c["failed"]),
           number(max(c["worst"]), 2) if c["worst"] else ""]
          for (op, impl), c in counts.items()]
  out = [table(["op", "implementation", "points checked", "not supported", "failed",
                "largest relative error"], body)]
  if failures:
    out += ["", "Failures:", "",
            table(["op", "implementation", "point", "status", "message"], failures)]
  return "\n".join(out + [""] + sources)


def grid_page(manifest: dict, suites: dict[str, Suite], figure: "HeatMap | None",
              figure_file: str | None) -> str:
  """The grid page, from the grid suites' rows (a section says "not measured" where
  its suite is absent) and the commands of those in `manifest`."""
  targets = grid_targets(suites)
  suite = suite_or_empty(suites, "attention_grid")
  records = attention_grid_records(suite)
  out = ["# Shape grid", "",
         "The library's default path (`implementation=None`, what a model gets) at every "
         "point of the shape grid (`experiments/shape_grid.py`: head sizes x lengths x "
         "masks for attention, (experts, top-k) x widths for the MoE layer, key sizes x "
         "lengths for the chunked ops, state sizes for the selective scan; about the same "
         "number of tokens at every point), against the best peer timed at the same point "
         "in the same run. Ratios are the default's time over the peer's: below 1 the "
         "default is faster.", "", "## Targets", ""]
  if targets:
    out += [targets_table(targets), "",
            "`points` counts the grid points where a peer ran; `above the limit` counts "
            "those above the target's largest ratio, or where the default did not run.", ""]
    unjudged = [f"{t.op} {_mode_word(t.mode)}: {t.count.not_judged}" for t in targets
                if t.count.not_judged]
    if unjudged:
      out += ["Points where no peer ran, not judged: " + "; ".join(unjudged) + ".", ""]
  else:
    out += [not_measured("The shape grid"), ""]
  out += ["## Attention", ""]
  if records:
    variants = {}
    for r in records:
      variants.setdefault(r.config["variant"], r.config)
    out += ["`default` is `probjax_hk.dot_product_attention`'s own choice (flex, cuDNN or "
            "XLA) at each point; the peer is the fastest of cuDNN, tokamax's Mosaic GPU "
            "kernel and tokamax's Triton kernel there (tokamax where it is installed and "
            "takes the inputs). The variants: "
            + "; ".join(_variant_text(c) for c in variants.values()) + ".", ""]
    out += figure_link(figure, figure_file)
    for dtype in dict.fromkeys(r.config["dtype"] for r in records):
      for mode, outcomes in _by_mode([r for r in records if r.config["dtype"] == dtype],
                                     "default", "peer").items():
        ratios = [v for v in outcomes if v is not None and not isinstance(v, str)]
        if ratios:
          out.append(f"- {dtype}, {_mode_word(mode)}: default / best peer {span(ratios)} "
                     f"over {len(ratios)} points.")
    out += ["", f"### Where the default takes more than {ratio_text(LOSS_MARGIN)} x the "
            "best peer's time", ""]
    losses = attention_losses(suite, records)
    out += [losses if losses else "Nowhere: the default is within "
            f"{ratio_text(LOSS_MARGIN)} x the best peer at every point measured.", ""]
  else:
    out += [not_measured("The attention grid"), ""]
  out += ["## MoE layer and grouped matmul", ""]
  op, layer = moe_grid_records(suite_or_empty(suites, "moe_grid"))
  if op:
    out += ["`ops.grouped_matmul` (Pallas) on M = tokens x top-k rows against "
            "`tokamax.ragged_dot` (its Mosaic GPU kernel) and `jax.lax.ragged_dot`; the "
            "`MoELayer` with `dropless_impl='auto'` (the default) against the fastest of "
            "its other paths timed at the point.", "",
            moe_grid_table(suites["moe_grid"], op, layer), ""]
  else:
    out += [not_measured("The MoE grid"), ""]
  out += ["## Chunked ops", ""]
  chunked = chunked_grid_records(suite_or_empty(suites, "chunked_grid"))
  if chunked:
    out += ["`ops.ssd` and `ops.gated_delta_rule`, bf16: `default runs` is what "
            "`implementation=None` ran there (the Pallas kernel at its default chunk where "
            "it takes the shape on an NVIDIA GPU, the chunked XLA form otherwise).", "",
            chunked_grid_table(suites["chunked_grid"], chunked), ""]
  else:
    out += [not_measured("The chunked-op grid"), ""]
  out += ["## Selective scan", ""]
  scans = scan_grid_records(suite_or_empty(suites, "scan_grid"))
  if scans:
    out += ["`ops.selective_scan`, float32: the Pallas kernel (the default on an NVIDIA "
            "GPU at every state size) against `lax.associative_scan`.", "",
            scan_grid_table(suites["scan_grid"], scans), ""]
  else:
    out += [not_measured("The selective-scan grid"), ""]
  out += ["## Checks", "",
          "With `--grid_check` every implementation timed at a point is first checked "
          "there against the float32 reference: outputs, final states where the op has "
          "one, and gradients, as relative errors.", ""]
  checks = grid_checks(suites)
  out += [checks if checks else not_measured("The grid check"), ""]
  out += ["## How to reproduce", ""] + reproduce_section(dict(manifest, suites={
      n: e for n, e in manifest["suites"].items() if n in _GRID_SUITES}))
  return "\n".join(out)


# ---------------------------------------------------------------------------
# Setup and index.


def _range(values: list) -> str:
  values = sorted(set(values))
  if not values:
    return ""
  return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


NOT_RECORDED = "not recorded"


def cuda_version_text(version) -> str:
  """A CUDA version as the CUDA runtime reports it (13000) -> '13.0'."""
  if not isinstance(version, int):
    return str(version)
  return f"{version // 1000}.{version % 1000 // 10}"


def cudnn_version_text(version) -> str:
  """A cuDNN version as cudnnGetVersion reports it -> 'major.minor.patch'
  (9.x: major * 10000 + minor * 100 + patch; 8.x: major * 1000 + ...)."""
  if not isinstance(version, int):
    return str(version)
  major = 10000 if version >= 90000 else 1000
  return f"{version // major}.{version % major // 100}.{version % 100}"


def environment_cell(env: dict, field: str, text: Callable = str) -> str:
  """`env[field]` as text: 'not recorded' for a run that predates the field,
  'none' where the machine had none (no GPU)."""
  if field not in env:
    return NOT_RECORDED
  return "none" if env[field] is None else text(env[field])


def setup_page(manifest: dict, suites: dict[str, Suite]) -> str:
  warmup = inspect.signature(harness.run_case).parameters["warmup"].default
  out = ["# Setup", "",
         "Where and how the numbers on these pages were measured, from what the benchmark "
         "JSON records and how `experiments/harness.py` times.", "", "## Machines", "",
         "Every run records its device, JAX and Python versions and when it was written, "
         "and, since `harness.environment` records them, the NVIDIA driver's version, the "
         f"CUDA runtime's, cuDNN's and jaxlib's: \"{NOT_RECORDED}\" marks a run from before "
         "then (the headlines compare against cuDNN, whose version is then unknown).", ""]
  machines, runs = [], []
  for name, suite in suites.items():
    for source in suite.sources:
      env = suite.environment(source)
      rows = [r for r in suite.rows if r["source"] == source]
      iters = [r["iters"] for r in rows if isinstance(r.get("iters"), int)]
      calls = [r["calls_per_sample"] for r in rows if isinstance(r.get("calls_per_sample"), int)]
      commit = suite.sources[source].get("commit", "")
      machines.append([f"`{suite.file}`", run_label(source), str(env.get("device_kind", "")),
                       str(env.get("device_count", "")), environment_cell(env, "driver"),
                       environment_cell(env, "cuda", cuda_version_text),
                       environment_cell(env, "cudnn", cudnn_version_text),
                       str(env.get("jax", "")), environment_cell(env, "jaxlib"),
                       str(env.get("python", ""))])
      runs.append([f"`{suite.file}`", run_label(source), str(len(rows)), _range(iters),
                   _range(calls), commit[:7]])
  out += [table(["file", "run", "device", "devices", "driver", "CUDA", "cuDNN", "JAX",
                 "jaxlib", "Python"], machines), "", "## Runs", "",
          table(["file", "run", "rows", "samples", "calls per sample", "commit"], runs), "",
          "`samples` is how many samples each row's median is taken over and `calls per "
          "sample` how many calls a sample held (below); a blank means the run recorded "
          "none and timed one call per sample, host dispatch and sync included. The "
          "sample's length is the harness's at the time of the run and is not recorded. "
          "`commit` is the last commit of the run's original file; the `blob` beside it in "
          "the JSON reads that file back with `git cat-file -p`.", ""]
  out += ["## How a case is timed", "",
          f"`harness.run_case` builds a case, compiles it with `jax.jit(...).lower(...)"
          ".compile()` (`compile_s`: tracing, lowering, which runs the Pallas kernels' "
          "Python lowering, and XLA's compile; `lower_s`: the first two) and records XLA's "
          "buffer plan (`planned_peak_mb`: arguments + outputs + temporaries - aliased "
          f"buffers). It then runs {warmup} warm-up calls and one call to size the samples, "
          "and times `iters` samples (the `samples` column above). Each sample dispatches "
          f"calls back to back for about {harness.SAMPLE_MS:g} ms (at least "
          f"{harness.MIN_CALLS_PER_SAMPLE}, at most 50; one when a call takes over 50 ms) and "
          "blocks once with `jax.block_until_ready`, so a call of tens of microseconds is "
          "timed on the device rather than as host dispatch plus a sync. `median_ms` is the "
          "median over samples of the time per call, `min_ms` the fastest sample.", "",
          "- Train steps donate their parameter and optimizer buffers and feed each call's "
          "outputs to the next, as in training.",
          "- Peers (cuDNN, XLA, JAX's Pallas `mha`, `lax.associative_scan`, "
          "`jax.lax.ragged_dot`, a dense matmul) run in the same process as this library's "
          "kernels, on the same inputs; every ratio on these pages is between rows of one "
          "run. Runs on different machines of the same kind differ by a few percent, so "
          "compare ratios, not times, across runs.",
          "- Attention calls of up to `CHAINED_MAX_SCORES` scores run several calls in one "
          "executable (the rows' `chain`), each on the previous call's inputs through an "
          "optimization barrier; the time is per call.",
          "- `peak_mb` is the device's `peak_bytes_in_use` in a fresh process per case "
          "(scan x remat, UNet), so that each peak is its own.",
          "- The training-loop suite times whole loops of `fit()` and of a bare jitted "
          "loop, interleaved in rounds, and reports the median of the per-round ratios.", ""]
  out += ["## Suites", "", "Which file feeds which page, and the program that writes it:", ""]
  body = [[name, f"`{entry['file']}`", ", ".join(f"[{p}]({p}.md)" for p in entry["pages"]),
           f"`{entry['command']}`"] for name, entry in manifest["suites"].items()]
  out += [table(["suite", "file", "pages", "command"], body), ""]
  return "\n".join(out)


def index_page(manifest: dict, suites: dict[str, Suite], pages: list[str]) -> str:
  """The index: headlines of every suite present and a contents list of `pages`."""
  out = ["# Performance", "",
         "Measured on one GPU, this library beside the peers timed in the same run. "
         "These pages are generated from the JSON in `docs/benchmarks/` by "
         "`python -m experiments.benchmark_figures`; ratios are this library's time over "
         "the peer's (below 1 is faster).", "", "## Headlines", ""]
  attention = attention_records(suites["attention"])
  headlines = attention_headlines(attention)
  for r in newest_train_steps(suites["models"]):
    headlines.append(f"- {_MODEL_NAMES.get(r.config['model'], r.config['model'])} train "
                     f"step ({r.config['dtype']}, {r.config['tokens']} tokens): "
                     f"{ratio_text(r.ratio('default', 'cudnn'))} x cuDNN attention's.")
  headlines += scan_headlines(scan_records(suites["ssm_scans"]))
  headlines += chunked_headlines(chunked_records(suites["chunked_ops"]))
  headlines += gmm_section(suites["moe"])[0]
  if "decoding" in pages:
    headlines += decoding_headlines(suites["decode"])
  if "grid" in pages:
    headlines += grid_headlines(grid_targets(suites))
  out += headlines if headlines else [not_measured("The benchmarks")]
  out += ["", "Machines, timing and the files behind each page are on the setup page.", "",
          "```{toctree}", ":maxdepth: 1", ""] + [p for p in pages if p != "index"] + ["```", ""]
  return "\n".join(out)


# ---------------------------------------------------------------------------
# Platforms: what each default runs on each GPU kind.

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


# ---------------------------------------------------------------------------
# Figures: one bar chart per page, of the ratios in its first table.

_AXIS = "time / the peer's time in the same run (log scale; left of 1: faster)"


@dataclasses.dataclass(frozen=True)
class Figure:
  """Horizontal bars: `bars` are (label, series, ratio to the peer)."""
  title: str
  axis: str
  bars: list[tuple[str, str, float]]


def _mode_word(mode: str) -> str:
  return {"fwd": "forward", "train_step": "train step"}.get(mode, mode)


def figures(suites: dict[str, Suite]) -> dict[str, "Figure | HeatMap"]:
  """The figure of each page that has one, from the same records as its tables.

  Args:
    suites: every suite the manifest names, an absent one empty (`with_empty`).
  """
  out = {}
  bars = []
  for r in attention_records(suites["attention"]):
    c = r.config
    label = (f"H {c['H']}, T {c['T']}, {'causal' if c['causal'] else 'full'}, "
             f"{_mode_word(c['mode'])}")
    for peer, name in (("cudnn", "flex / cuDNN"), ("mha", "flex / Pallas mha best")):
      value = r.ratio("flex", peer)
      if value is not None:
        bars.append((label, name, value))
  if bars:
    out["attention"] = Figure("ops.flex_attention, bf16", _AXIS, bars)
  bars = []
  for r in scan_records(suites["ssm_scans"]):
    value = r.ratio("pallas", "xla")
    if value is not None:
      bars.append((f"{r.config['op']} ({_shape_join(r.config['shape'])}), "
                   f"{_mode_word(r.config['mode'])}", "scan / lax.associative_scan", value))
  for r in chunked_records(suites["chunked_ops"]):
    value = r.ratio("pallas", "xla")
    if value is not None:
      bars.append((f"{r.config['op']} ({_chunked_shape(r.config)}), "
                   f"{_mode_word(r.config['mode'])}", "chunked op / its XLA form", value))
  if bars:
    out["kernels"] = Figure("Pallas kernels against the XLA tier of the same op", _AXIS, bars)
  bars = [(f"{_MODEL_NAMES.get(r.config['model'], r.config['model'])}, {r.config['dtype']}, "
           f"{r.config['tokens']} tokens, train step", "default / cuDNN attention",
           r.ratio("default", "cudnn")) for r in newest_train_steps(suites["models"])]
  for r in compare(suites["ssm_scans"].rows, config=("cell", "mode"),
                   label=lambda r: r.get("impl") if r.get("kind") == "model" else None,
                   ours="pallas"):
    value = r.ratio("pallas", "xla")
    if value is not None and r.config["mode"] == "train_step":
      bars.append((f"SSMModel, {_SSM_CELLS.get(r.config['cell'], r.config['cell'])}, "
                   "train step", "default / XLA", value))
  for r in compare(suites["chunked_ops"].rows, config=("cell", "step"),
                   label=lambda r: (("default" if r.get("implementation") in (None, "None")
                                     else r.get("implementation"))
                                    if r.get("kind") == "model" else None),
                   ours="default"):
    value = r.ratio("default", "xla")
    if value is not None:
      bars.append((f"SSMModel, {r.config['cell']}, train step", "default / XLA", value))
  for r in compare(suites["moe"].rows, config=("tokens", "mode"),
                   label=lambda r: r.get("impl") if r.get("section") == "moe" else None,
                   ours="auto"):
    if r.config["mode"] != "fwd+bwd":
      continue
    for peer in ("dense", "ragged_dot"):
      value = r.ratio("auto", peer)
      if value is not None:
        bars.append((f"MoELayer, {r.config['tokens']} tokens, fwd+bwd", f"default / '{peer}'",
                     value))
  if bars:
    out["models"] = Figure("Models with their default kernels against a peer", _AXIS, bars)
  heat_map = attention_heat_map(attention_grid_records(
      suite_or_empty(suites, "attention_grid")))
  if heat_map:
    out["grid"] = heat_map
  return out


@dataclasses.dataclass(frozen=True)
class HeatMap:
  """Panels of cells coloured by a ratio on a log scale centred at 1.

  `cells` are (panel, row, column, ratio, text): the ratio is None where there is
  none (the cell is grey), and the text is written on the cell.
  """
  title: str
  axis: str
  row_name: str
  column_name: str
  cells: list[tuple[str, int, int, float | None, str]]

  @property
  def panels(self) -> list[str]:
    return list(dict.fromkeys(panel for panel, *_ in self.cells))


def attention_heat_map(records: list[Record]) -> HeatMap | None:
  """The default's bf16 fwd+bwd time over the best peer's, head size x length per
  variant (None where no point has a peer's time)."""
  cells = []
  for r in records:
    c = r.config
    if c["dtype"] != "bfloat16" or c["mode"] != "fwd+bwd":
      continue
    value = judge(r, "default", "peer")
    if value is None:
      continue
    failed = isinstance(value, str)
    cells.append((c["variant"].replace("_", " "), c["H"], c["S"], None if failed else value,
                  value if failed else ratio_text(value)))
  if not cells:
    return None
  return HeatMap("Attention, bf16 fwd+bwd: the default's time / the fastest of cuDNN and "
                 "tokamax", "default / best peer (log scale; below 1, blue: the default is "
                 "faster)", "head size H", "length L (keys)", cells)


def draw(figure: "Figure | HeatMap", path: str) -> None:
  """Writes `figure` as a PNG (no timestamp or version in it: reruns give the same file).

  Each bar runs from 1 (parity with the peer) to the ratio, on a log axis, so that
  twice as fast and twice as slow are bars of one length.
  """
  if isinstance(figure, HeatMap):
    draw_heat_map(figure, path)
    return
  import matplotlib  # Imported here: the pages' Markdown needs no plotting library.
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  labels = list(dict.fromkeys(label for label, _, _ in figure.bars))
  series = list(dict.fromkeys(name for _, name, _ in figure.bars))
  colors = dict(zip(series, plt.get_cmap("tab10").colors))
  fig, ax = plt.subplots(figsize=(9, 0.36 * len(labels) + 1.6))
  drawn = set()
  for y, label in enumerate(labels):
    at_label = [(name, value) for l, name, value in figure.bars if l == label]
    height = 0.8 / len(at_label)
    for i, (name, value) in enumerate(at_label):
      ax.barh(y + (i - (len(at_label) - 1) / 2) * height, value - 1.0, left=1.0, height=height,
              color=colors[name], label=None if name in drawn else name)
      drawn.add(name)
  values = [value for _, _, value in figure.bars]
  low, high = min(values + [1.0]) / 1.25, max(values + [1.0]) * 1.25
  ax.set_xscale("log")
  ax.set_xlim(low, high)
  ticks = [t for t in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5) if low <= t <= high]
  ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
  ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax.axvline(1.0, color="black", linewidth=0.8)
  ax.set_yticks(range(len(labels)), labels, fontsize=8)
  ax.set_ylim(len(labels) - 0.5, -0.5)
  ax.set_xlabel(figure.axis, fontsize=9)
  columns = min(len(series), 2)
  ax.set_title(figure.title, fontsize=10, pad=12 + 12 * -(-len(series) // columns))
  ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=columns,
            frameon=False)
  fig.tight_layout()
  fig.savefig(path, dpi=100, metadata={"Software": None})
  plt.close(fig)


def draw_heat_map(heat_map: HeatMap, path: str) -> None:
  """Writes `heat_map` as a PNG: one panel per variant, rows and columns the values
  seen in any panel, a diverging colour map whose ends are equally far from 1 on a
  log scale, each cell annotated with its ratio."""
  import math
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import colors
  from matplotlib import pyplot as plt
  import numpy as np
  rows = sorted({row for _, row, _, _, _ in heat_map.cells})
  columns = sorted({column for _, _, column, _, _ in heat_map.cells})
  values = [v for *_, v, _ in heat_map.cells if v is not None]
  reach = max([1.25] + [max(v, 1 / v) for v in values])
  norm = colors.LogNorm(vmin=1 / reach, vmax=reach)
  cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#d9d9d9")  # grey: no ratio
  panels = heat_map.panels
  ncols = min(len(panels), 3)
  nrows = -(-len(panels) // ncols)
  fig, axes = plt.subplots(nrows, ncols, squeeze=False, layout="constrained",
                           figsize=(ncols * (0.62 * len(columns) + 1.2) + 1.2,
                                    nrows * (0.36 * len(rows) + 1.1) + 0.6))
  image = None
  for ax, panel in zip(axes.flat, panels):
    grid = np.full((len(rows), len(columns)), np.nan)
    for name, row, column, value, text in heat_map.cells:
      if name != panel:
        continue
      i, j = rows.index(row), columns.index(column)
      if value is not None:
        grid[i, j] = value
      dark = value is not None and abs(math.log(value)) > 0.6 * math.log(reach)
      ax.text(j, i, text, ha="center", va="center", fontsize=7,
              color="white" if dark else "black")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
    ax.set_xticks(range(len(columns)), [str(c) for c in columns], fontsize=7)
    ax.set_yticks(range(len(rows)), [str(r) for r in rows], fontsize=7)
    ax.set_xlabel(heat_map.column_name, fontsize=8)
    ax.set_ylabel(heat_map.row_name, fontsize=8)
    ax.set_title(panel, fontsize=9)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  bar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
  ticks = [t for t in (0.5, 0.67, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2) if 1 / reach <= t <= reach]
  bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
  bar.ax.minorticks_off()
  bar.set_label(heat_map.axis, fontsize=8)
  fig.suptitle(heat_map.title, fontsize=10)
  fig.savefig(path, dpi=100, metadata={"Software": None})
  plt.close(fig)


def figure_link(figure: "Figure | HeatMap | None", file: str | None) -> list[str]:
  """The Markdown that shows a page's figure, drawn into docs/benchmarks/`file`."""
  if figure is None or file is None:
    return []
  return [f"![{figure.title}](../benchmarks/{file})", ""]


def render_pages(directory: str) -> dict[str, str]:
  """The performance pages' Markdown, from the manifest's files in `directory`:
  index, setup and every page a present suite feeds (`pages_of`)."""
  manifest, present = load_suites(directory)
  shown = dict(manifest, suites={n: e for n, e in manifest["suites"].items() if n in present})
  suites = with_empty(manifest, present)
  names = pages_of(manifest, present)
  drawn, files = figures(suites), manifest.get("figures", {})
  writers = {
      "index": lambda: index_page(shown, suites, names),
      "setup": lambda: setup_page(shown, present),
      "platforms": lambda: platforms_page(suites),
      "attention": lambda: attention_page(suites, drawn.get("attention"),
                                          files.get("attention")),
      "kernels": lambda: kernels_page(suites, drawn.get("kernels"), files.get("kernels")),
      "models": lambda: models_page(shown, suites, drawn.get("models"), files.get("models")),
      "decoding": lambda: decoding_page(shown, suites),
      "grid": lambda: grid_page(shown, suites, drawn.get("grid"), files.get("grid")),
  }
  # Sections that end in a blank line meet the next one's: one blank line between blocks.
  return {f"{name}.md": re.sub(r"\n{3,}", "\n\n", writers[name]()).rstrip("\n") + "\n"
          for name in names}


def drawn_figures(directory: str) -> dict[str, "Figure | HeatMap"]:
  """The figures of the pages `render_pages` writes, by the manifest's file name."""
  manifest, present = load_suites(directory)
  drawn, names = figures(with_empty(manifest, present)), pages_of(manifest, present)
  return {file: drawn[page] for page, file in manifest.get("figures", {}).items()
          if page in drawn and page in names}


def main(argv):
  del argv
  os.makedirs(_PAGES.value, exist_ok=True)
  for name, text in render_pages(_BENCHMARKS.value).items():
    path = os.path.join(_PAGES.value, name)
    with open(path, "w") as f:
      f.write(text)
    print(f"wrote {path}")
  for file, figure in drawn_figures(_BENCHMARKS.value).items():
    path = os.path.join(_BENCHMARKS.value, file)
    draw(figure, path)
    print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
