"""The attention page: `ops.flex_attention` against cuDNN, Pallas `mha` and XLA
(suite `attention`, written by `benchmark_kernel_attention`)."""

from experiments.figures import charts
from experiments.figures.common import (Record, Suite, cell, compare, mode_key, mode_word,
                                        not_measured, newest_rows, number, ratio_text,
                                        run_table, section, sourced_table, span)

_PEERS = (("cudnn", "cuDNN"), ("mha", "Pallas `mha` best"), ("xla", "XLA"))


def _label(row: dict) -> str | None:
  if row.get("kind") != "time":
    return None
  impl = row.get("impl", "")
  if impl in ("flex", "cudnn", "xla", "flex_alibi", "flex_documents"):
    return impl
  if impl.startswith("mha_"):
    return "mha"
  return None  # Tile and variant experiments are not the default path.


def attention_records(suite: Suite, needs: tuple[str, ...] = ()) -> list[Record]:
  """flex and its peers per shape and mode (from runs that also timed one of `needs`)."""
  records = compare(suite.rows, config=("B", "N", "T", "H", "causal", "mode", "chain"),
                    label=_label, ours="flex", needs=needs)
  records.sort(key=lambda r: (r.config["H"], -r.config["T"], r.config["causal"],
                              mode_key(r.config["mode"])))
  return records


def _shape_text(config: dict) -> str:
  text = f"{config['B']}, {config['N']}, {config['T']}, {config['H']}"
  if (config.get("chain") or 1) > 1:
    text += f" (chain {config['chain']})"
  return text


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
  peers = [(key, name) for key, name in _PEERS if any(key in r.cells for r in records)]
  header = (["B, N, T, H", "causal", "mode", "flex ms"] + [f"{name} ms" for _, name in peers]
            + [f"flex / {name}" for _, name in peers])
  return run_table(suite, header, [
      (r, [_shape_text(r.config), "yes" if r.config["causal"] else "no", r.config["mode"],
           cell(r, "flex")] + [cell(r, key) for key, _ in peers]
       + [ratio_text(r.ratio("flex", key)) for key, _ in peers]) for r in records])


def mods_table(suite: Suite) -> str | None:
  records = attention_records(suite, needs=("flex_alibi", "flex_documents"))
  if not records:
    return None
  header = ["B, N, T, H", "causal", "mode", "flex ms", "+ ALiBi `score_mod` ms",
            "+ documents `mask_mod` ms", "cuDNN ms (plain)", "ALiBi / flex",
            "documents / flex"]
  body = [[_shape_text(r.config), "yes" if r.config["causal"] else "no", r.config["mode"],
           cell(r, "flex"), cell(r, "flex_alibi"), cell(r, "flex_documents"), cell(r, "cudnn"),
           ratio_text(r.ratio("flex_alibi", "flex")),
           ratio_text(r.ratio("flex_documents", "flex"))] for r in records]
  return sourced_table(suite, header, body, (r.source for r in records))


def attention_checks(suite: Suite) -> str | None:
  source, rows = newest_rows(suite, lambda r: r.get("kind") == "check")
  if not rows:
    return None
  header = ["B, T, S, N, K, H", "dtype", "options", "status", "forward", "dq", "dk", "dv"]
  body = [[", ".join(map(str, r.get("shape", []))), r.get("dtype", ""),
           ", ".join(r.get("options") or []) or "none", r.get("status", ""),
           number(r.get("fwd_rel"), 2), number(r.get("dq_rel"), 2), number(r.get("dk_rel"), 2),
           number(r.get("dv_rel"), 2)] for r in rows]
  return sourced_table(suite, header, body, [source])


def attention_figure(suites: dict[str, Suite]) -> charts.Figure | None:
  """flex's time over cuDNN's and over Pallas `mha`'s, per row of the first table."""
  bars = []
  for r in attention_records(suites["attention"]):
    c = r.config
    label = (f"H {c['H']}, T {c['T']}, {'causal' if c['causal'] else 'full'}, "
             f"{mode_word(c['mode'])}")
    for peer, name in (("cudnn", "flex / cuDNN"), ("mha", "flex / Pallas mha best")):
      value = r.ratio("flex", peer)
      if value is not None:
        bars.append((label, name, value))
  return charts.Figure("ops.flex_attention, bf16", charts.RATIO_AXIS, bars) if bars else None


def attention_page(suites: dict[str, Suite], figure: list[str]) -> str:
  """The page's Markdown; `figure` is the Markdown that shows its figure (or none)."""
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
  out += [""] + figure
  out += section("## flex against its peers", None,
                 attention_table(suite, records) if records else None, "The attention table")
  out += section("## Masks and score modifications",
                 "Calls cuDNN cannot express: an ALiBi bias as a `score_mod` and 512-token "
                 "documents as a `mask_mod`, against plain flex on the same shapes (cuDNN's "
                 "time is for plain attention).", mods_table(suite),
                 "`mask_mod` and `score_mod` calls")
  out += section("## Numerics on the GPU",
                 "Relative L2 error of flex against the float32 reference on the GPU, forward "
                 "and gradients.", attention_checks(suite), "The GPU check")
  return "\n".join(out)
