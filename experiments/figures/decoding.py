"""The decoding page: the split-K decode attention kernel against its peers on one
KV cache, and `pk.generate` end to end (suite `decode`, written by
`benchmark_decode`)."""

from experiments.figures.common import (Record, Suite, cell, compare, error_table,
                                        not_measured, number, ratio_text, reproduce_section,
                                        run_table, section, span)

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
  header = (["B", "S", "K", "N", "H"] + (["T"] if several_t else [])
            + ["Pallas ms", "XLA ms", "jax.nn XLA ms", "cuDNN ms", "floor ms",
               "Pallas / floor", "XLA / Pallas", "cuDNN / Pallas"])
  return run_table(suite, header, [
      (r, [str(r.config[k]) for k in ("B", "S", "K", "N", "H")]
       + ([str(r.config["T"])] if several_t else [])
       + [cell(r, impl) for impl in _DECODE_IMPLS]
       + [number(_floor_ms(r)), ratio_text(_over_floor(r)), ratio_text(r.ratio("xla", "pallas")),
          ratio_text(r.ratio("cudnn", "pallas"))]) for r in records])


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
  header = ["model", "layers", "params", "batch", "prefill ms", "per-token ms", "tokens/s",
            "per-token / Transformer's"]
  lines = []
  for r in records:
    for model in _generate_models([r]):
      row = r.cells[model]
      lines.append((r, [_GENERATE_MODELS.get(model, model), str(row.get("num_layers", "")),
                        number(row.get("params")), str(r.config["B"]),
                        cell(r, model, "prefill_ms"), cell(r, model, "per_token_ms"),
                        cell(r, model, "tokens_per_s"),
                        ratio_text(r.ratio(model, "transformer", "per_token_ms"))]))
  return run_table(suite, header, lines)


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
  out += section("### Numerics on the GPU",
                 "Relative L2 error of the kernel against the float32 reference on the GPU "
                 "(key lengths that differ per sequence, GQA and MHA, a window).",
                 error_table(suite, lambda r: r.get("section") == "kernel"
                             and r.get("kind") == "check",
                             [("shape", "B, T, S, N, K, H"), ("dtype", "dtype"),
                              ("window", "window"), ("status", "status"), ("finite", "finite")],
                             [("rel", "error")]), "The decode kernel's check")
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
  out += ["## How to reproduce", ""] + reproduce_section(manifest, ("decode",))
  return "\n".join(out)
