"""The performance pages: rendered from the curated JSON that the manifest names."""

import ast
import copy
import json
import os
import re
import shutil

import pytest

from experiments import benchmark_figures
from experiments import dispatch_tables
from experiments.figures import platforms
from ops import _measured

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(ROOT, "docs", "benchmarks")
PAGES = os.path.join(ROOT, "docs", "performance")


@pytest.fixture(scope="module")
def rendered():
  return benchmark_figures.render_pages(BENCHMARKS)


def test_committed_pages_equal_what_the_committed_json_renders_to(rendered):
  committed = {name for name in os.listdir(PAGES) if name.endswith(".md")}
  assert committed == set(rendered), "rerun `python -m experiments.benchmark_figures`"
  for name, text in rendered.items():
    with open(os.path.join(PAGES, name)) as f:
      assert f.read() == text, (f"docs/performance/{name} is stale: rerun "
                                "`python -m experiments.benchmark_figures`")


def test_manifest_files_name_their_runs_and_absent_ones_are_left_out():
  manifest, suites = benchmark_figures.load_suites(BENCHMARKS)
  files = {entry["file"] for entry in manifest["suites"].values()}
  assert len(files) == len(manifest["suites"])
  for name, entry in manifest["suites"].items():
    assert set(entry["pages"]) <= set(benchmark_figures.PAGES), name
    assert (name in suites) == os.path.exists(os.path.join(BENCHMARKS, entry["file"])), name
  for name, suite in suites.items():
    assert suite.rows, name
    for source in suite.sources:
      environment = suite.environment(source)
      assert environment.get("device_kind") and environment.get("jax"), (name, source)
  # Nothing but the manifest, the suite files present and the figures the pages show.
  present = {suite.file for suite in suites.values()}
  shown = set(benchmark_figures.drawn_figures(BENCHMARKS))
  assert set(os.listdir(BENCHMARKS)) == {"manifest.json"} | present | shown


def test_every_figure_is_drawn_and_shown(rendered):
  manifest, _ = benchmark_figures.load_suites(BENCHMARKS)
  drawn = benchmark_figures.drawn_figures(BENCHMARKS)
  for page, file in manifest["figures"].items():
    if file in drawn:
      assert f"](../benchmarks/{file})" in rendered[f"{page}.md"], page
    else:
      assert f"{page}.md" not in rendered, page
  linked = {line.split("](../benchmarks/")[1].rstrip(")") for text in rendered.values()
            for line in text.splitlines() if line.startswith("![")}
  assert linked == set(drawn)


def test_a_figure_is_the_same_file_when_drawn_again(tmp_path):
  figure = benchmark_figures.Figure("t", "ratio", [("a", "x", 0.5), ("a", "y", 2.0),
                                                   ("b", "x", 1.0)])
  benchmark_figures.draw(figure, str(tmp_path / "1.png"))
  benchmark_figures.draw(figure, str(tmp_path / "2.png"))
  first = (tmp_path / "1.png").read_bytes()
  assert first.startswith(b"\x89PNG") and first == (tmp_path / "2.png").read_bytes()


def test_each_command_writes_its_suite_file():
  """A command names `--output docs/benchmarks/<file>`, or its program writes there by default."""
  manifest = benchmark_figures.load_manifest(BENCHMARKS)
  for entry in manifest["suites"].values():
    assert entry["command"].startswith(f"python -m {entry['program']}")
    named = re.findall(r"--output[= ](\S+)", entry["command"])
    if named:
      assert named == [f"docs/benchmarks/{entry['file']}"], entry["command"]
      continue
    path = os.path.join(ROOT, *entry["program"].split(".")) + ".py"
    with open(path) as f:
      tree = ast.parse(f.read())
    defaults = [node.args[1].value for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "DEFINE_string"
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "output"]
    assert defaults == [f"docs/benchmarks/{entry['file']}"], entry["program"]


def _row(source, impl, ms, status="ok", **config):
  return dict(config, source=source, impl=impl, median_ms=ms, status=status)


def test_compare_takes_each_configuration_from_its_newest_run():
  rows = [
      _row("2026-01-01", "ours", 2.0, shape="a"), _row("2026-01-01", "peer", 4.0, shape="a"),
      _row("2026-02-01", "ours", 3.0, shape="a"), _row("2026-02-01", "peer", 4.0, shape="a"),
      _row("2026-02-01", "peer_64", 5.0, shape="a"),
      _row("2026-01-01", "ours", 1.0, shape="b"), _row("2026-01-01", "peer", 2.0, shape="b"),
      _row("2026-03-01", "peer", 9.0, shape="b"),  # a run without ours is not chosen
      _row("2026-01-01", "ours", 1.0, shape="c"), _row("2026-01-01", "peer", 1.0, "OOM",
                                                       shape="c"),
  ]
  label = lambda r: "peer" if r["impl"].startswith("peer") else r["impl"]
  records = benchmark_figures.compare(rows, config=("shape",), label=label, ours="ours")
  by_shape = {r.config["shape"]: r for r in records}
  assert by_shape["a"].source == "2026-02-01"
  assert by_shape["a"].ratio("ours", "peer") == pytest.approx(0.75)  # the peer at its best
  assert by_shape["b"].source == "2026-01-01"
  assert by_shape["b"].ratio("ours", "peer") == pytest.approx(0.5)
  assert by_shape["c"].ratio("ours", "peer") is None
  assert benchmark_figures.cell(by_shape["c"], "peer") == "OOM"
  assert benchmark_figures.cell(by_shape["c"], "missing") == "—"
  needs = benchmark_figures.compare(rows, config=("shape",), label=label, ours="ours",
                                    needs=("peer_other",))
  assert needs == []


def test_a_program_output_renders_and_a_changed_number_changes_the_page(tmp_path, rendered):
  directory = tmp_path / "benchmarks"
  shutil.copytree(BENCHMARKS, directory)
  suite = benchmark_figures.load_suite(str(directory), "fit", "fit.json")
  source = next(iter(suite.sources))
  rows = [{k: v for k, v in r.items() if k != "source"} for r in suite.rows
          if r["source"] == source]
  fit_memory = next(r for r in rows if r["case"] == "fit_memory")
  fit_memory["bare_loop_time_ratio"] = 1.2345
  # As benchmark_fit writes it: one run, no `sources`.
  with open(directory / "fit.json", "w") as f:
    json.dump({"environment": suite.environment(source), "rows": rows}, f)
  pages = benchmark_figures.render_pages(str(directory))
  assert pages["models.md"] != rendered["models.md"]
  assert "in memory 1.23 x the bare loop's time" in pages["models.md"]
  # The setup page lists the run's commit, which a program's own output lacks.
  line = [l for l in pages["setup.md"].splitlines() if l.startswith("| `fit.json` |")][-1]
  assert benchmark_figures.run_label(source) in line and line.endswith("|  |")
  unchanged = ("index.md", "attention.md", "kernels.md")
  assert [pages[k] for k in unchanged] == [rendered[k] for k in unchanged]


def test_a_row_of_an_undescribed_run_is_refused(tmp_path):
  with open(tmp_path / "x.json", "w") as f:
    json.dump({"sources": {"2026-01-01": {"environment": {}}},
               "rows": [{"source": "2026-02-01"}]}, f)
  with pytest.raises(ValueError, match="2026-02-01"):
    benchmark_figures.load_suite(str(tmp_path), "x", "x.json")


# ---------------------------------------------------------------------------
# The decoding and grid pages, from rows as the programs write them (taken from
# CPU smoke runs of benchmark_decode, benchmark_kernel_attention --grid,
# benchmark_kernel_moe --grid, benchmark_kernel_ssd --grid and
# benchmark_kernel_ssm --grid), with the times set by hand.

NEW_SUITES = ("decode", "attention_grid", "moe_grid", "chunked_grid", "scan_grid")
_ENVIRONMENT = {"jax": "0.11.2", "backend": "gpu", "device_kind": "NVIDIA H200",
                "device_count": 1, "python": "3.12.3", "host": "vm",
                "time": "2026-12-06T13:27:35"}
_KERNEL_TIME = {
    "section": "kernel", "kind": "time", "shape": "b2_t1_s200_n4_k2_h32", "B": 2, "T": 1,
    "S": 200, "N": 4, "K": 2, "H": 32, "dtype": "bfloat16", "fill": 1.0, "impl": "pallas",
    "floor_ms": 2.3813953488372093e-05, "num_splits": 5, "block_k": 16, "num_warps": 4,
    "num_stages": 1, "lower_s": 0.32, "compile_s": 0.82, "planned_peak_mb": 0.40,
    "status": "ok", "median_ms": 0.794, "min_ms": 0.747, "iters": 3, "calls_per_sample": 13,
    "tbps": 0.00012897221487545013}
_KERNEL_CHECK = {"section": "kernel", "kind": "check", "shape": [4, 1, 4096, 32, 8, 128],
                 "dtype": "bfloat16", "window": None, "status": "ok", "rel": 0.0021,
                 "finite": True}
_GENERATE_SUMMARY = {
    "section": "generate", "model": "transformer", "model_dim": 32, "body": "Transformer",
    "attention": "default", "num_layers": 1, "num_heads": 4, "num_kv_heads": 2,
    "params": 15776, "body_params": 11616, "params_vs_transformer": 1.0, "T": 16, "G": 32,
    "V": 64, "dtype": "bfloat16", "temperature": 1.0, "B": 2, "shape": "transformer_b2",
    "kind": "summary", "status": "ok", "prefill_ms": 0.0632, "generate_ms": 0.6616,
    "per_token_ms": 0.0193, "tokens_per_s": 96735.9, "decode_tokens_per_s": 103607.7,
    "prefill_vs_transformer": 1.0, "per_token_vs_transformer": 1.0}
_ATTENTION_POINT = {"grid": "attention", "point": "h80_l77_gqa", "variant": "gqa",
                    "dtype": "bfloat16", "causal": True, "window": None, "B": 2, "T": 77,
                    "S": 77, "N": 8, "K": 1, "H": 80}
_ATTENTION_TIME = dict(_ATTENTION_POINT, kind="time", mode="fwd", impl="flex", lower_s=0.27,
                       compile_s=0.61, planned_peak_mb=1.81, status="ok", median_ms=2.40,
                       min_ms=2.25, iters=2, calls_per_sample=5, chain=1, tflops=0.0064)
_ATTENTION_SUMMARY = dict(_ATTENTION_POINT, kind="summary", mode="fwd", flex_ms=2.40,
                          xla_ms=0.70, default_impl="flex", best_ours="xla",
                          best_ours_ms=0.70, default_vs_best_ours=3.41)
_MOE_POINT = {"point": "e8_k2_d256_f256", "experts": 8, "top_k": 2, "d_model": 256,
              "d_hidden": 256}
_MOE_OP = dict(_MOE_POINT, section="op", impl="pallas", mode="forward", rows=256,
               status="ok", median_ms=5.128, tflops=0.0065,
               fraction_of_dense_matmul_tflops=0.0505)
_MOE_LAYER = dict(_MOE_POINT, section="moe", impl="auto", mode="forward", tokens=128,
                  status="ok", median_ms=2.634, ratio_vs_dense=0.891, ratio_vs_ragged_dot=1.05)
_CHUNKED_OP = {"kind": "op", "op": "ssd", "implementation": "pallas", "name": "ssd/pallas",
               "mode": "fwd", "chunk_size": None, "B": 1, "T": 100, "N": 2, "K": 32, "V": 32,
               "dtype": "bfloat16", "grid": "chunked", "point": "k32_t100", "status": "ok",
               "median_ms": 0.334, "ratio_vs_xla": 1.47}
_CHUNKED_SUMMARY = {"kind": "summary", "op": "ssd", "point": "k32_t100", "mode": "fwd", "B": 1,
                    "T": 100, "N": 2, "K": 32, "V": 32, "pallas_ms": 0.334, "xla_ms": 0.227,
                    "default_impl": "pallas", "default_ms": 0.334, "default_vs_xla": 1.47,
                    "best": "xla", "default_vs_best": 1.47}
_SCAN_TIME = {"kind": "time", "op": "selective_scan", "shape": [2, 256, 16, 24],
              "impl": "pallas", "mode": "fwd",
              "blocks": "SelectiveScanBlocks(block_d=4, unroll=4, chunk=4, num_warps=1, "
                        "num_stages=1)", "default_blocks": True, "grid": "scan", "point": "s24",
              "status": "ok", "median_ms": 17.59}


def _like(template, **fields):
  """A copy of a smoke row with `fields` changed (a row that did not run loses its time)."""
  row = dict(copy.deepcopy(template), **fields)
  if row.get("status", "ok") != "ok":
    row.pop("median_ms", None)
    row.setdefault("message", "Unsupported: by hand")
  return row


def _benchmarks(tmp_path, **files):
  """docs/benchmarks copied to `tmp_path` without the new suites' files, plus `files`
  (suite file name -> rows) as one run each, as the programs write them."""
  directory = tmp_path / "benchmarks"
  shutil.copytree(BENCHMARKS, directory)
  manifest = benchmark_figures.load_manifest(str(directory))
  for name in NEW_SUITES:
    (directory / manifest["suites"][name]["file"]).unlink(missing_ok=True)
  for file, rows in files.items():
    with open(directory / file, "w") as f:
      json.dump({"environment": _ENVIRONMENT, "rows": rows}, f)
  return str(directory)


def _table_rows(text, first_cell):
  """The cells of the Markdown table lines of `text` whose first cell is `first_cell`."""
  return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
          if line.startswith(f"| {first_cell} |")]


def test_suites_without_a_file_write_no_page_and_are_not_linked(tmp_path, rendered):
  directory = _benchmarks(tmp_path)
  pages = benchmark_figures.render_pages(directory)
  assert set(pages) == {"index.md", "platforms.md", "setup.md", "attention.md", "kernels.md",
                        "models.md"}
  assert "decoding" not in pages["index.md"] and "grid" not in pages["index.md"]
  assert "decode.json" not in pages["setup.md"] and "_grid.json" not in pages["setup.md"]
  assert "benchmark_decode" not in pages["models.md"]
  assert set(benchmark_figures.drawn_figures(directory)) == {
      "attention.png", "kernels.png", "models.png"}
  if not any(name in rendered for name in ("decoding.md", "grid.md")):
    assert pages == rendered  # Today's committed files have none of the new suites.


def test_decoding_page_tables_and_ratios_of_one_run(tmp_path):
  kernel = []
  for s, times in ((4096, (0.020, 0.050, 0.060, 0.030)), (32768, (0.130, 0.400, 0.500, None))):
    floor = 2 * 2 * s * 2 * 32 * 2 / 4.3e9
    for impl, ms in zip(("pallas", "xla", "jax_nn_xla", "cudnn"), times):
      status = "ok" if ms is not None else "unsup"
      kernel.append(_like(_KERNEL_TIME, S=s, impl=impl, floor_ms=floor, status=status,
                          median_ms=ms, tbps=floor * 4.3 / ms if ms else None))
    # A tuning variant of the kernel, faster: not a column.
    kernel.append(_like(_KERNEL_TIME, S=s, impl="pallas_4x64x4x2", floor_ms=floor,
                        median_ms=0.001))
  generate = [_like(_GENERATE_SUMMARY, model=model, B=b, num_layers=layers, params=params,
                    per_token_ms=per_token * (1 + b / 64), prefill_ms=1.0, tokens_per_s=1000.0)
              for b in (1, 32)
              for model, layers, params, per_token in (("transformer", 8, 200_000_000, 2.0),
                                                       ("transformer_xla", 8, 200_000_000, 2.5),
                                                       ("mamba2", 24, 210_000_000, 1.0),
                                                       ("gated_deltanet", 20, 190_000_000, 1.5))]
  directory = _benchmarks(tmp_path, **{"decode.json": kernel + [_KERNEL_CHECK] + generate})
  pages = benchmark_figures.render_pages(directory)
  page = pages["decoding.md"]
  # B, S, K, N, H; pallas, XLA, jax.nn XLA, cuDNN, floor; pallas / floor, XLA / pallas, ...
  rows = {r[1]: r for r in _table_rows(page, "2")}
  floor = 2 * 2 * 4096 * 2 * 32 * 2 / 4.3e9
  assert rows["4096"][5:9] == ["0.02000", "0.05000", "0.06000", "0.03000"]
  assert rows["4096"][10:] == [f"{0.020 / floor:#.3g}", "2.50", "1.50"]
  assert rows["32768"][8] == "unsup" and rows["32768"][11:] == ["3.08", ""]
  assert "at 4.30 TB/s" in page
  assert _table_rows(page, "4, 1, 4096, 32, 8, 128") == [
      ["4, 1, 4096, 32, 8, 128", "bfloat16", "", "ok", "yes", "0.0021"]]
  mamba = [r for r in _table_rows(page, "SSMModel, Mamba2Cell")]
  assert [r[1:4] for r in mamba] == [["24", "210,000,000", "1"], ["24", "210,000,000", "32"]]
  assert [r[7] for r in mamba] == ["0.500", "0.500"]  # per token over the Transformer's
  assert "Transformer, XLA attention 1.25 x; SSMModel, Mamba2Cell 0.500 x" in page
  assert "- Generation at batch 32" in pages["index.md"]
  assert "decoding" in pages["index.md"].split("```{toctree}")[1]
  assert "[decoding](decoding.md)" in pages["setup.md"]
  assert "grid.md" not in pages


def test_count_target_counts_failures_against_the_target():
  count = benchmark_figures.count_target([0.9, 1.0, 1.05, "OOM", None], share=0.5, limit=1.1)
  assert (count.points, count.at_or_below, count.above_limit, count.failed, count.not_judged,
          count.worst, count.held) == (4, 2, 1, 1, 1, 1.05, False)
  assert benchmark_figures.count_target([0.9, 1.0, 1.05], share=0.6, limit=1.1).held
  assert not benchmark_figures.count_target([0.9, 1.0, 1.05], share=0.7, limit=1.1).held
  assert not benchmark_figures.count_target([0.9, 1.2], share=0.5, limit=1.1).held
  assert not benchmark_figures.count_target([None], share=0.5, limit=1.1).held


def _attention_rows(point, mode, default, times, *, itself=None, default_status="ok"):
  """Time rows at one attention point and its summary: `times` per implementation
  (None: unsup), `default` what the default picks (or `itself`: a 'default' row)."""
  h, l, variant = point
  fields = dict(point=f"h{h}_l{l}_{variant}", H=h, S=l, T=l, variant=variant, mode=mode)
  rows = []
  for impl, ms in times.items():
    status = default_status if impl == default and itself is None else "ok"
    rows.append(_like(_ATTENTION_TIME, impl=impl, median_ms=ms, **fields,
                      status=status if ms is not None else "unsup"))
  if itself is not None:
    rows.append(_like(_ATTENTION_TIME, impl="default", median_ms=itself, **fields))
  return rows + [_like(_ATTENTION_SUMMARY, default_impl=default, **fields)]


def test_grid_page_counts_the_targets_on_a_hand_made_grid(tmp_path):
  attention = []
  # fwd+bwd: at 10 points, the default (flex) over the best peer: 7 at or below 1,
  # 1.04, 1.2 and one OOM; an 11th point where no peer ran is not judged.
  ratios = [0.5, 0.8, 0.9, 1.0, 0.95, 0.7, 0.99, 1.04, 1.2, None]
  for i, ratio in enumerate(ratios):
    point = ((32, 64, 128)[i % 3], (512, 1000, 4096, 8192)[i // 3], "causal")
    attention += _attention_rows(point, "fwd+bwd", "flex", {
        "flex": ratio or 1.0, "cudnn": 1.0, "xla": 3.0, "tokamax_mosaic": 1.5,
        "tokamax_triton": None}, default_status="ok" if ratio else "OOM")
  attention += _attention_rows((256, 77, "full"), "fwd+bwd", "flex", {
      "flex": 1.0, "cudnn": None, "xla": 3.0, "tokamax_mosaic": None, "tokamax_triton": None})
  # forward: the 'default' row is the default's time (1.08 x tokamax) where flex is faster.
  attention += _attention_rows((64, 512, "gqa"), "fwd", "flex", {
      "flex": 0.5, "cudnn": 2.0, "xla": 3.0, "tokamax_mosaic": 1.0, "tokamax_triton": 1.2},
      itself=1.08)
  moe = []
  for d, ratio in ((256, 0.9), (512, 1.01)):  # grouped matmul over tokamax
    for impl, ms in (("pallas", ratio), ("tokamax_ragged_dot", 1.0), ("ragged_dot", 4.0)):
      moe.append(_like(_MOE_OP, impl=impl, median_ms=ms, d_model=d, point=f"e8_k2_d{d}_f256"))
    for impl, ms in (("auto", 2.0), ("dense", 4.0), ("gmm", 2.5)):
      moe.append(_like(_MOE_LAYER, impl=impl, median_ms=ms, d_model=d,
                       point=f"e8_k2_d{d}_f256"))
  chunked = []
  for op, ratio in (("ssd", 0.5), ("gated_delta_rule", 0.8)):
    chunked += [_like(_CHUNKED_OP, op=op, name=f"{op}/pallas", median_ms=ratio),
                _like(_CHUNKED_OP, op=op, name=f"{op}/pallas_chunk128", chunk_size=128,
                      median_ms=0.1),
                _like(_CHUNKED_OP, op=op, name=f"{op}/xla", implementation="xla",
                      chunk_size=128, median_ms=1.0),
                _like(_CHUNKED_SUMMARY, op=op)]
  scans = [_like(_SCAN_TIME, median_ms=0.3), _like(_SCAN_TIME, impl="xla", median_ms=1.0)]
  directory = _benchmarks(tmp_path, **{
      "attention_grid.json": attention, "moe_grid.json": moe, "chunked_grid.json": chunked,
      "scan_grid.json": scans})
  pages = benchmark_figures.render_pages(directory)
  page = pages["grid.md"]
  ops = ("attention", "`ops.grouped_matmul`", "`ops.ssd`", "`ops.gated_delta_rule`",
         "`ops.selective_scan`")
  targets = {(r[0], r[2]): r[4:] for op in ops for r in _table_rows(page, op)}
  # points, default <= peer, above the limit, default did not run, worst, met
  assert targets[("attention", "fwd+bwd")] == ["10", "7 of 10 (70 %)", "2", "1", "1.20", "no"]
  assert targets[("attention", "forward")] == ["1", "0 of 1 (0 %)", "0", "0", "1.08", "no"]
  assert targets[("`ops.grouped_matmul`", "forward")] == [
      "2", "1 of 2 (50 %)", "1", "0", "1.01", "no"]
  assert targets[("`ops.ssd`", "forward")] == ["1", "1 of 1 (100 %)", "0", "0", "0.500", "yes"]
  assert targets[("`ops.gated_delta_rule`", "forward")][-2:] == ["0.800", "yes"]
  assert targets[("`ops.selective_scan`", "forward")][-2:] == ["0.300", "yes"]
  assert "attention fwd+bwd: 1" in page  # the point where no peer ran
  # The losses: 1.2 and the OOM (not 1.04), and the forward point at 1.08 with the
  # default's own row, tokamax the peer, flex the fastest of ours.
  losses = page.split("### Where the default takes more")[1].split("## MoE")[0]
  assert [r[8] for r in _table_rows(losses, "H 128, L 4096, causal")] == ["1.20"]
  assert [r[5] for r in _table_rows(losses, "H 32, L 8192, causal")] == ["OOM"]
  assert _table_rows(losses, "H 64, L 4096, causal") == []  # 1.04
  assert len([l for l in losses.splitlines() if l.startswith("| H ")]) == 3
  gqa = _table_rows(losses, "H 64, L 512, gqa")
  assert [r[4:10] for r in gqa] == [["flex", "1.080", "tokamax Mosaic", "1.000", "1.08",
                                     "flex (0.5000 ms)"]]
  assert "grid" in pages["index.md"].split("```{toctree}")[1]
  assert "- Shape grid, `ops.ssd`: the default at or below its chunked XLA form" in (
      pages["index.md"])
  drawn = benchmark_figures.drawn_figures(directory)
  assert set(drawn) == {"attention.png", "kernels.png", "models.png", "attention_grid.png"}
  assert "](../benchmarks/attention_grid.png)" in page
  heat_map = drawn["attention_grid.png"]
  cells = {(panel, h, l): (value, text) for panel, h, l, value, text in heat_map.cells}
  assert cells[("causal", 128, 4096)] == (pytest.approx(1.2), "1.20")
  assert cells[("causal", 32, 8192)] == (None, "OOM")
  assert ("full", 256, 77) not in cells and len(cells) == 10  # bf16 fwd+bwd, a peer ran
  for name in ("1.png", "2.png"):
    benchmark_figures.draw(heat_map, str(tmp_path / name))
  first = (tmp_path / "1.png").read_bytes()
  assert first.startswith(b"\x89PNG") and first == (tmp_path / "2.png").read_bytes()


def test_grid_page_lists_the_checks_at_the_grid_points(tmp_path):
  check = dict(_ATTENTION_POINT, kind="check", status="ok", fwd_rel=0.002, dq_rel=0.004,
               dk_rel=0.003, dv_rel=0.001)
  attention = [_like(check, impl="flex"), _like(check, impl="cudnn", dq_rel=0.02),
               _like(check, impl="tokamax_triton", status="unsup", message="no tokamax"),
               _like(check, impl="flex", point="h32_l512_full", fwd_rel=0.001),
               _like(_ATTENTION_TIME)]
  chunked_check = {"kind": "check", "op": "ssd", "grid": "chunked", "point": "k32_t100",
                   "dtype": "bfloat16"}
  chunked = [_like(_CHUNKED_OP), dict(chunked_check, implementation="pallas", status="ok",
                                      y_err=1e-3, final_err=2e-3, grad_err=5e-3),
             dict(chunked_check, implementation="pallas", name="ssd/pallas_chunk128",
                  status="ok", y_err=1e-3, final_err=2e-3, grad_err=9e-3),
             dict(chunked_check, implementation="xla", status="error",
                  message="ValueError: bad | thing\nsecond line")]
  pages = benchmark_figures.render_pages(_benchmarks(
      tmp_path, **{"attention_grid.json": attention, "chunked_grid.json": chunked}))
  checks = pages["grid.md"].split("## Checks")[1].split("## How to reproduce")[0]
  assert _table_rows(checks, "`attention`") == [
      ["`attention`", "flex", "2", "0", "0", "0.0040"],
      ["`attention`", "cudnn", "1", "0", "0", "0.020"],
      ["`attention`", "tokamax_triton", "0", "1", "0", ""]]
  assert _table_rows(checks, "`ssd`") == [
      ["`ssd`", "pallas", "1", "0", "0", "0.0050"],
      ["`ssd`", "pallas_chunk128", "1", "0", "0", "0.0090"], ["`ssd`", "xla", "0", "0", "1", ""],
      ["`ssd`", "xla", "k32_t100", "error", "ValueError: bad / thing second line"]]
  empty = benchmark_figures.render_pages(_benchmarks(
      tmp_path / "none", **{"attention_grid.json": [_like(_ATTENTION_TIME)]}))
  assert "The grid check: not measured" in empty["grid.md"]


# ---------------------------------------------------------------------------
# The platforms page: from the committed dispatch tables and gpu_check's runs.


def test_platforms_page_has_a_row_per_default_and_device_kind_of_the_tables(rendered):
  text = rendered["platforms.md"]
  rows = [line for line in text.splitlines() if line.startswith("| `")]
  expected = [(benchmark_figures.DEFAULTS[name][0], data["device"], data["jax"])
              for name in dispatch_tables.TABLES if _measured.load(name)
              for data in _measured.load(name)["devices"]]
  assert expected and len(rows) == len(expected)
  for row, (default, device, jax) in zip(rows, expected):
    assert row.startswith(f"| {default} | {device} | {jax} |"), row
  assert "| every default | any other GPU kind or JAX release |" in text
  if not os.path.exists(os.path.join(BENCHMARKS, "gpu_check.json")):
    assert "No `gpu_check` run is committed yet." in text


def test_a_default_runs_a_kernel_only_where_it_was_checked():
  table = dict(table="ssd", kernels=["pallas"])
  data = dict(checked={}, points=[dict(length=1, ms=dict(pallas=1.0, xla=2.0)),
                                  dict(length=2, ms=dict(pallas=3.0, xla=2.0))])
  assert platforms._default_paths(table, data) == ("XLA at 2 of 2 points", "1 of 2")
  data["checked"] = {"pallas": "2026-12-07T00:00:00"}
  assert platforms._default_paths(table, data) == (
      "the kernel at 1, XLA at 1 of 2 points", "1 of 2")


def test_platforms_page_lists_the_newest_gpu_check_run_of_each_device_kind(tmp_path):
  check = dict(kind="check", op="ssd", backend="triton", case="odd_a", status="ok")
  rows = [check, dict(check, case="odd_b", status="fail", message="dq 0.2 > 0.05"),
          dict(check, backend="mosaic", status="unsup"),
          dict(kind="time", op="ssd", impl="pallas", status="ok", median_ms=1.0),
          dict(kind="model", model="transformer", status="ok", loss=1.0)]
  directory = _benchmarks(tmp_path, **{"gpu_check.json": rows})
  pages = benchmark_figures.render_pages(directory)
  text = pages["platforms.md"]
  assert _table_rows(text, "NVIDIA H200") == [
      ["NVIDIA H200", "0.11.2", "2026-12-06 13:27", "`ssd`", "1", "1", "1", "1"],
      ["NVIDIA H200", "0.11.2", "2026-12-06 13:27", "models, generate, sharded step", "1", "",
       "0", ""]]
  assert "gpu_check.json" in pages["setup.md"]


def test_setup_page_shows_each_runs_gpu_stack_or_not_recorded(tmp_path):
  directory = tmp_path / "benchmarks"
  shutil.copytree(BENCHMARKS, directory)
  suite = benchmark_figures.load_suite(str(directory), "fit", "fit.json")
  source = next(iter(suite.sources))
  rows = [{k: v for k, v in r.items() if k != "source"} for r in suite.rows]
  # As harness.environment now writes it on a GPU.
  environment = dict(suite.environment(source), jaxlib="0.11.2", gpu="NVIDIA H200",
                     driver="580.95.05", cuda=13000, cuda_driver=13000, cudnn=91002)
  with open(directory / "fit.json", "w") as f:
    json.dump({"environment": environment, "rows": rows}, f)
  setup = benchmark_figures.render_pages(str(directory))["setup.md"]
  header = _table_rows(setup, "file")[0]
  fit = dict(zip(header, _table_rows(setup, "`fit.json`")[0]))
  assert (fit["driver"], fit["CUDA"], fit["cuDNN"], fit["jaxlib"]) == (
      "580.95.05", "13.0", "9.10.2", "0.11.2")
  older = dict(zip(header, _table_rows(setup, "`unet.json`")[0]))
  assert {older[c] for c in ("driver", "CUDA", "cuDNN", "jaxlib")} == {
      benchmark_figures.NOT_RECORDED}


def test_version_numbers_read_as_their_libraries_encode_them():
  assert benchmark_figures.cuda_version_text(12080) == "12.8"  # 1000 * major + 10 * minor
  assert benchmark_figures.cudnn_version_text(8907) == "8.9.7"  # 8.x: 1000 * major + ...
  assert benchmark_figures.cudnn_version_text(91002) == "9.10.2"  # 9.x: 10000 * major + ...


def _newest(suite_file, case_field):
  manifest = benchmark_figures.load_manifest(BENCHMARKS)
  name = next(n for n, e in manifest["suites"].items() if e["file"] == suite_file)
  suite = benchmark_figures.load_suite(BENCHMARKS, name, suite_file)
  return benchmark_figures.newest_rows(suite, lambda r: case_field in r)[1]


def test_fit_headline_sets_fit_against_the_bare_loop_of_as_many_steps_per_call(rendered):
  by_case = {r["case"]: r["bare_loop_time_ratio"] for r in _newest("fit.json", "case")}
  text = benchmark_figures.ratio_text
  k = next(r["steps_per_call"] for r in _newest("fit.json", "case")
           if r["case"] == "bare_loop_calls")
  like = next(l for l in rendered["models.md"].splitlines() if l.startswith("- Like for like"))
  assert (f"at {k} steps per call `fit()` takes "
          f"{text(by_case['fit_memory_calls'] / by_case['bare_loop_calls'])} x") in like
  assert f"{text(by_case['fit_stream_calls'] / by_case['bare_loop_calls'])} x on a stream" in like
  assert (f"at one step per call `fit()` takes "
          f"{text(by_case['fit_memory_one_step'] / by_case['bare_loop'])} x") in like


def test_unet_bfloat16_table_is_bf16_over_f32_of_the_same_resolution(rendered):
  rows = [r for r in _newest("unet.json", "resolution") if r.get("variant") == "plain"]
  step = {(r["resolution"], r["dtype"]): r["median_ms"] for r in rows
          if r["mode"] == "train_step"}
  table_rows = {}
  for resolution in {res for res, _ in step}:
    for cells in _table_rows(rendered["models.md"], str(resolution)):
      if len(cells) == 4:  # resolution, train step time, peak, forward
        table_rows[resolution] = cells
  assert table_rows
  for resolution, cells in table_rows.items():
    want = step[(resolution, "bfloat16")] / step[(resolution, "float32")]
    assert cells[1] == benchmark_figures.ratio_text(want), (resolution, cells)
