"""The shape grid page: the default path against the best peer at every point of
`experiments/shape_grid.py`, the targets it is held to, and the on-device checks
there."""

from experiments.figures import charts
from experiments.figures.common import (Record, Suite, cell, chunked_shape, mode_word,
                                        newest_rows, not_measured, number, ratio_text,
                                        reproduce_section, run_table, runs_line, section,
                                        shape_join, sourced_table, span, suite_or_empty, table)
from experiments.figures.grid_records import (GridTarget, attention_grid_records, by_mode,
                                              chunked_grid_records, grid_targets, judge,
                                              moe_grid_records, scan_grid_records)

LOSS_MARGIN = 1.05  # the attention points listed as losses: above this ratio

_SUITES = ("attention_grid", "moe_grid", "chunked_grid", "scan_grid")
_OURS = ("flex", "cudnn", "xla")
_NAMES = {"flex": "flex", "cudnn": "cuDNN", "xla": "XLA", "default": "default",
          "tokamax_mosaic": "tokamax Mosaic", "tokamax_triton": "tokamax Triton",
          "pallas": "Pallas", "tokamax_ragged_dot": "tokamax.ragged_dot",
          "ragged_dot": "ragged_dot"}


def _share_text(part: int, whole: int) -> str:
  return f"{part} of {whole}" + (f" ({part / whole:.0%})".replace("%", " %") if whole else "")


def targets_table(targets: list[GridTarget]) -> str:
  header = ["op", "against", "mode", "target (default / peer)", "points", "default <= peer",
            "above the limit", "default did not run", "worst ratio", "met"]
  body = [[t.op, t.peer, mode_word(t.mode), t.target, str(t.count.points),
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
      counts.append(f"{mode_word(t.mode)} at {_share_text(t.count.at_or_below, t.count.points)}"
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
  header = ["H, L, variant", "dtype", "mode", "B, T, S, N, K", "default runs", "default ms",
            "best peer", "peer ms", "default / peer", "fastest of ours"]
  lines = []
  for r in losing:
    c = r.config
    peer = r.cells["peer"]
    ours = [(n, r.ms(n)) for n in _OURS if r.ms(n) is not None]
    fastest = min(ours, key=lambda item: item[1]) if ours else None
    lines.append((r, [_point_text(c), c["dtype"], mode_word(c["mode"]),
                      ", ".join(str(c[k]) for k in ("B", "T", "S", "N", "K")),
                      _NAMES.get(c["default_impl"], str(c["default_impl"])), cell(r, "default"),
                      _NAMES.get(peer["impl"], peer["impl"]), cell(r, "peer"),
                      ratio_text(r.ratio("default", "peer")),
                      f"{_NAMES[fastest[0]]} ({number(fastest[1])} ms)" if fastest else ""]))
  return run_table(suite, header, lines)


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
                 mode_word(c["mode"]), str(c["rows"]), cell(r, "pallas"),
                 cell(r, "tokamax_ragged_dot"), cell(r, "ragged_dot"),
                 ratio_text(r.ratio("pallas", "tokamax_ragged_dot")),
                 ratio_text(r.ratio("pallas", "ragged_dot")),
                 cell(lay, "auto") if lay else "—",
                 f"'{fastest[0]}' ({number(fastest[1])} ms)" if fastest else "",
                 ratio_text(lay.ms("auto") / fastest[1])
                 if fastest and lay.ms("auto") is not None else ""])
  return sourced_table(suite, header, body, {r.source for r in op} | {r.source for r in layer})


def chunked_grid_table(suite: Suite, records: list[Record]) -> str:
  header = ["op", "B, T, N, K, V", "mode", "default runs", "default ms", "Pallas ms",
            "XLA ms", "default / XLA"]
  body = [[r.config["op"], chunked_shape(r.config), mode_word(r.config["mode"]),
           _NAMES.get(r.config["default_impl"], str(r.config["default_impl"])),
           cell(r, "default"), cell(r, "pallas"), cell(r, "xla"),
           ratio_text(r.ratio("default", "xla"))] for r in records]
  return sourced_table(suite, header, body, {r.source for r in records})


def scan_grid_table(suite: Suite, records: list[Record]) -> str:
  header = ["op", "B, T, D, S", "mode", "Pallas ms", "XLA (associative scan) ms",
            "Pallas / XLA"]
  body = [[r.config["op"], shape_join(r.config["shape"]), mode_word(r.config["mode"]),
           cell(r, "pallas"), cell(r, "xla"), ratio_text(r.ratio("pallas", "xla"))]
          for r in records]
  return sourced_table(suite, header, body, {r.source for r in records})


def _relative_errors(row: dict) -> list[float]:
  """A check row's error fields (`fwd_rel`, `y_err`, `err_grads`, `rel`, ...)."""
  return [v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
          and (k == "rel" or k.endswith(("_rel", "_err")) or k.startswith("err_"))]


def grid_checks(suites: dict[str, Suite]) -> str | None:
  """The on-device checks run at the grid's points (`--grid_check`): per op and
  implementation the points checked, skipped and failed and the largest
  relative error; then every failure with its message."""
  counts, failures, sources = {}, [], []
  for name in _SUITES:
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


def attention_heat_map(records: list[Record]) -> charts.HeatMap | None:
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
  return charts.HeatMap("Attention, bf16 fwd+bwd: the default's time / the fastest of cuDNN "
                        "and tokamax", "default / best peer (log scale; below 1, blue: the "
                        "default is faster)", "head size H", "length L (keys)", cells)


def grid_figure(suites: dict[str, Suite]) -> charts.HeatMap | None:
  return attention_heat_map(attention_grid_records(suite_or_empty(suites, "attention_grid")))


def grid_page(manifest: dict, suites: dict[str, Suite], figure: list[str]) -> str:
  """The grid page, from the grid suites' rows (a section says "not measured" where
  its suite is absent) and the commands of those in `manifest`; `figure` is the
  Markdown that shows its figure (or none)."""
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
    unjudged = [f"{t.op} {mode_word(t.mode)}: {t.count.not_judged}" for t in targets
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
    out += figure
    for dtype in dict.fromkeys(r.config["dtype"] for r in records):
      for mode, outcomes in by_mode([r for r in records if r.config["dtype"] == dtype],
                                    "default", "peer").items():
        ratios = [v for v in outcomes if v is not None and not isinstance(v, str)]
        if ratios:
          out.append(f"- {dtype}, {mode_word(mode)}: default / best peer {span(ratios)} "
                     f"over {len(ratios)} points.")
    out += ["", f"### Where the default takes more than {ratio_text(LOSS_MARGIN)} x the "
            "best peer's time", ""]
    losses = attention_losses(suite, records)
    out += [losses if losses else "Nowhere: the default is within "
            f"{ratio_text(LOSS_MARGIN)} x the best peer at every point measured.", ""]
  else:
    out += [not_measured("The attention grid"), ""]
  # These sections describe their table only where there is one.
  op, layer = moe_grid_records(suite_or_empty(suites, "moe_grid"))
  out += section("## MoE layer and grouped matmul", None,
                 "`ops.grouped_matmul` (Pallas) on M = tokens x top-k rows against "
                 "`tokamax.ragged_dot` (its Mosaic GPU kernel) and `jax.lax.ragged_dot`; the "
                 "`MoELayer` with `dropless_impl='auto'` (the default) against the fastest of "
                 "its other paths timed at the point.\n\n"
                 + moe_grid_table(suites["moe_grid"], op, layer) if op else None, "The MoE grid")
  chunked = chunked_grid_records(suite_or_empty(suites, "chunked_grid"))
  out += section("## Chunked ops", None,
                 "`ops.ssd` and `ops.gated_delta_rule`, bf16: `default runs` is what "
                 "`implementation=None` ran there (the Pallas kernel at its default chunk "
                 "where it takes the shape on an NVIDIA GPU, the chunked XLA form otherwise)."
                 "\n\n" + chunked_grid_table(suites["chunked_grid"], chunked)
                 if chunked else None, "The chunked-op grid")
  scans = scan_grid_records(suite_or_empty(suites, "scan_grid"))
  out += section("## Selective scan", None,
                 "`ops.selective_scan`, float32: the Pallas kernel (the default on an NVIDIA "
                 "GPU at every state size) against `lax.associative_scan`.\n\n"
                 + scan_grid_table(suites["scan_grid"], scans) if scans else None,
                 "The selective-scan grid")
  out += section("## Checks",
                 "With `--grid_check` every implementation timed at a point is first checked "
                 "there against the float32 reference: outputs, final states where the op has "
                 "one, and gradients, as relative errors.", grid_checks(suites), "The grid check")
  out += ["## How to reproduce", ""] + reproduce_section(manifest, _SUITES)
  return "\n".join(out)
