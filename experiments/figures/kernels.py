"""The kernels page: the SSM scans, the chunked ops and the grouped matmul against
the XLA path of the same op (suites `ssm_scans`, `chunked_ops` and `moe`)."""

from experiments.figures import charts
from experiments.figures.common import (Record, Suite, cell, chunked_shape, compare,
                                        error_table, mode_key, mode_word, not_measured,
                                        ratio_text, run_table, section, shape_join,
                                        sourced_table, span)


def _scan_label(row: dict) -> str | None:
  if row.get("kind") != "time" or not row.get("default_blocks", True):
    return None
  return {"pallas": "pallas", "xla": "xla"}.get(row.get("impl"))


def scan_records(suite: Suite) -> list[Record]:
  records = compare(suite.rows, config=("op", "shape", "mode"), label=_scan_label,
                    ours="pallas")
  order = {"selective_scan": 0, "linear_scan": 1, "linear_scan_lru": 2}
  records.sort(key=lambda r: (order.get(r.config["op"], 9), r.config["shape"],
                              mode_key(r.config["mode"])))
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
        lines.append(f"- {name} at {dims} = {shape_join(r.config['shape'])}, fwd+bwd: "
                     f"{ratio_text(value)} x `lax.associative_scan`'s time "
                     f"({ratio_text(1 / value)} x faster).")
    else:
      shapes = ", ".join(f"({shape_join(r.config['shape'])})" for r in of_op)
      lines.append(f"- {name}, fwd+bwd: {span(r.ratio('pallas', 'xla') for r in of_op)} x "
                   f"`lax.associative_scan`'s time at {dims} = {shapes}.")
  return lines


def scan_table(suite: Suite, records: list[Record]) -> str:
  header = ["op", "B, T, D[, S]", "mode", "Pallas ms", "XLA (associative scan) ms",
            "Pallas / XLA"]
  return run_table(suite, header, [
      (r, [r.config["op"], shape_join(r.config["shape"]), r.config["mode"], cell(r, "pallas"),
           cell(r, "xla"), ratio_text(r.ratio("pallas", "xla"))]) for r in records])


def scan_memory(suite: Suite) -> str | None:
  records = compare(suite.rows, config=("op", "shape", "mode"),
                    label=lambda r: r.get("impl") if r.get("kind") == "memory" else None,
                    ours="pallas")
  if not records:
    return None
  header = ["op", "B, T, D, S", "mode", "Pallas temp MB", "XLA temp MB", "Pallas / XLA memory",
            "Pallas ms", "XLA ms"]
  body = [[r.config["op"], shape_join(r.config["shape"]), r.config["mode"],
           cell(r, "pallas", "temp_mb"), cell(r, "xla", "temp_mb"),
           ratio_text(r.ratio("pallas", "xla", "temp_mb")), cell(r, "pallas"), cell(r, "xla")]
          for r in records]
  return sourced_table(suite, header, body, (r.source for r in records))


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
                              mode_key(r.config["mode"])))
  return records


def chunked_headlines(records: list[Record]) -> list[str]:
  lines = []
  for op in sorted({r.config["op"] for r in records}):
    of_op = [r for r in records if r.config["op"] == op]
    fwd = span(r.ratio("pallas", "xla") for r in of_op if r.config["mode"] == "fwd")
    both = span(r.ratio("pallas", "xla") for r in of_op if r.config["mode"] == "fwd+bwd")
    shapes = ", ".join(dict.fromkeys(f"({chunked_shape(r.config)})" for r in of_op))
    lines.append(f"- `ops.{op}`: forward {fwd} x the chunked XLA path's time, fwd+bwd "
                 f"{both} x, at B, T, N, K, V = {shapes}.")
  return lines


def chunked_table(suite: Suite, records: list[Record]) -> str:
  header = ["op", "B, T, N, K, V", "mode", "Pallas ms (default chunk)",
            "Pallas ms (other chunk)", "other chunk", "XLA chunked ms", "Pallas / XLA"]
  body = []
  for r in records:
    other = r.cells.get("pallas_other_chunk")
    body.append([r.config["op"], chunked_shape(r.config), r.config["mode"], cell(r, "pallas"),
                 cell(r, "pallas_other_chunk"), str(other.get("chunk_size")) if other else "",
                 cell(r, "xla"), ratio_text(r.ratio("pallas", "xla"))])
  return sourced_table(suite, header, body, (r.source for r in records))


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
  modes = sorted(by_mode, key=mode_key)
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
  return headlines, sourced_table(suite, header, body, (r.source for r in records))


def kernels_figure(suites: dict[str, Suite]) -> charts.Figure | None:
  """Each scan's and chunked op's Pallas time over its XLA tier's."""
  bars = []
  for r in scan_records(suites["ssm_scans"]):
    value = r.ratio("pallas", "xla")
    if value is not None:
      bars.append((f"{r.config['op']} ({shape_join(r.config['shape'])}), "
                   f"{mode_word(r.config['mode'])}", "scan / lax.associative_scan", value))
  for r in chunked_records(suites["chunked_ops"]):
    value = r.ratio("pallas", "xla")
    if value is not None:
      bars.append((f"{r.config['op']} ({chunked_shape(r.config)}), "
                   f"{mode_word(r.config['mode'])}", "chunked op / its XLA form", value))
  if not bars:
    return None
  return charts.Figure("Pallas kernels against the XLA tier of the same op", charts.RATIO_AXIS,
                       bars)


def kernels_page(suites: dict[str, Suite], figure: list[str]) -> str:
  """The page's Markdown; `figure` is the Markdown that shows its figure (or none)."""
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
  out += [""] + figure
  out += section("## SSM scans",
                 "`ops.selective_scan` (Mamba) and `ops.linear_scan` (LRU), float32 "
                 "(complex64 for the linear scan), against `lax.associative_scan`, the XLA "
                 "tier of the same op.", scan_table(ssm, scans) if scans else None, "The scans")
  out += section("### Memory",
                 "XLA's temporary buffers of the compiled fwd+bwd at the longest shape.",
                 scan_memory(ssm), "Scan memory")
  out += section("### Numerics on the GPU",
                 "Largest error of each tier against the `lax.scan` reference on the GPU "
                 "(relative to the largest reference value).",
                 error_table(ssm, lambda r: r.get("kind") == "check" and "err_y" in r,
                             [("op", "op"), ("impl", "impl"), ("shape", "B, T, D, S"),
                              ("reverse", "reverse")],
                             [("err_y", "y"), ("err_final", "final state"),
                              ("err_grads", "gradients")]), "The scan check")
  out += section("## Chunked ops: SSD and the gated delta rule",
                 "`ops.ssd` and `ops.gated_delta_rule`, bf16, against their chunked XLA forms "
                 "(`implementation='xla'`) in the same run; the Pallas kernel at its default "
                 "chunk and at one other.", chunked_table(chunked, chunks) if chunks else None,
                 "The chunked ops")
  out += section("### Numerics on the GPU",
                 "Largest error against the step-by-step reference on the GPU (relative to "
                 "the largest reference value).",
                 error_table(chunked, lambda r: r.get("kind") == "check",
                             [("op", "op"), ("implementation", "implementation"),
                              ("dtype", "dtype"), ("shape", "B, T, N, K, V")],
                             [("y_err", "y"), ("final_err", "final state"),
                              ("grad_err", "gradients")]), "The chunked-op check")
  out += section("## Grouped matmul",
                 "`ops.grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes)` at the MoE "
                 "layer's widths (K 512, N 1024, G 8), bf16. TFLOP/s count the grouped work "
                 "(fwd+bwd: three times the forward's).", gmm_table, "The grouped matmul")
  return "\n".join(out)
