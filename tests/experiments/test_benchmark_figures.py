"""The performance pages: rendered from the curated JSON that the manifest names."""

import ast
import json
import os
import shutil

import pytest

from experiments import benchmark_figures

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


def test_manifest_files_exist_and_name_their_runs():
  manifest = benchmark_figures.load_manifest(BENCHMARKS)
  files = {entry["file"] for entry in manifest["suites"].values()}
  assert len(files) == len(manifest["suites"])
  for name, entry in manifest["suites"].items():
    assert set(entry["pages"]) <= set(benchmark_figures.PAGES), name
    suite = benchmark_figures.load_suite(BENCHMARKS, name, entry["file"])
    assert suite.rows, name
    for source in suite.sources:
      environment = suite.environment(source)
      assert environment.get("device_kind") and environment.get("jax"), (name, source)
  # Nothing but the manifest, its files and the figures the pages show.
  figures = set(manifest["figures"].values())
  assert set(os.listdir(BENCHMARKS)) == {"manifest.json"} | files | figures


def test_every_figure_is_drawn_and_shown(rendered):
  manifest, suites = benchmark_figures.load_suites(BENCHMARKS)
  assert set(benchmark_figures.figures(suites)) == set(manifest["figures"])
  for page, file in manifest["figures"].items():
    assert f"](../benchmarks/{file})" in rendered[f"{page}.md"], page
  linked = {line.split("](../benchmarks/")[1].rstrip(")") for text in rendered.values()
            for line in text.splitlines() if line.startswith("![")}
  assert linked == set(manifest["figures"].values())


def test_a_figure_is_the_same_file_when_drawn_again(tmp_path):
  figure = benchmark_figures.Figure("t", "ratio", [("a", "x", 0.5), ("a", "y", 2.0),
                                                   ("b", "x", 1.0)])
  benchmark_figures.draw(figure, str(tmp_path / "1.png"))
  benchmark_figures.draw(figure, str(tmp_path / "2.png"))
  first = (tmp_path / "1.png").read_bytes()
  assert first.startswith(b"\x89PNG") and first == (tmp_path / "2.png").read_bytes()


def test_programs_write_their_suite_file_by_default():
  manifest = benchmark_figures.load_manifest(BENCHMARKS)
  for entry in manifest["suites"].values():
    assert entry["command"].startswith(f"python -m {entry['program']}")
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
  line = next(l for l in pages["setup.md"].splitlines() if l.startswith("| `fit.json` |"))
  assert benchmark_figures.run_label(source) in line and line.endswith("|  |")
  unchanged = ("index.md", "attention.md", "kernels.md")
  assert [pages[k] for k in unchanged] == [rendered[k] for k in unchanged]


def test_a_row_of_an_undescribed_run_is_refused(tmp_path):
  with open(tmp_path / "x.json", "w") as f:
    json.dump({"sources": {"2026-01-01": {"environment": {}}},
               "rows": [{"source": "2026-02-01"}]}, f)
  with pytest.raises(ValueError, match="2026-02-01"):
    benchmark_figures.load_suite(str(tmp_path), "x", "x.json")
