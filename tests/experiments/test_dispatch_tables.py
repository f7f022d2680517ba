"""experiments/dispatch_tables.py: the committed tables are what the committed
benchmark JSON gives, and a grid run joins its headline rows."""

import json
import os
import pathlib

from experiments import dispatch_tables

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(ROOT, "docs", "benchmarks")
TABLES = os.path.join(ROOT, "ops", "dispatch_tables")


def test_committed_tables_are_current():
  for name in dispatch_tables.TABLES:
    table = dispatch_tables.build(name, pathlib.Path(BENCHMARKS))
    path = os.path.join(TABLES, f"{name}.json")
    if table is None:
      assert not os.path.exists(path), name
      continue
    with open(path) as f:
      assert f.read() == dispatch_tables.render(table), (
          f"ops/dispatch_tables/{name}.json is stale: rerun `python -m experiments.dispatch_tables`")


def _write(folder, name, rows):
  """A merge of runs (the committed form), or one run's file for a grid."""
  environment = dict(device_kind="NVIDIA H200", jax="0.11.2")
  data = (dict(environment=environment) if "grid" in name
          else dict(sources={"t": dict(environment=environment)}))
  with open(folder / name, "w") as f:
    json.dump(dict(data, rows=rows), f)


def test_grid_rows_join_the_headline_rows_and_only_the_default_configuration_counts(tmp_path):
  def row(impl, ms, **fields):
    return dict(kind="op", op="ssd", implementation=impl, name=f"ssd/{impl}", mode="fwd+bwd",
                status="ok", median_ms=ms, B=8, T=4096, N=4, K=64, V=64, **fields)
  _write(tmp_path, "chunked_ops.json", [
      row("pallas", 1.0), row("xla", 2.0), row("pallas", 3.0),  # two runs: the median
      dict(row("pallas", 0.1), name="ssd/pallas_chunk128"),      # a chunk size by hand
      dict(row("xla", 0.1), mode="fwd"), dict(row("xla", 0.1), status="error")])
  _write(tmp_path, "chunked_grid.json", [  # one run, as the program writes it
      dict(row("pallas", 5.0), T=100, K=32, grid="chunked"),
      dict(row("xla", 4.0), T=100, K=32, grid="chunked"),
      dict(row("xla", 4.0), T=1000, K=32, grid="chunked")])  # one implementation: no point
  table = dispatch_tables.build("ssd", tmp_path)
  assert table["sources"] == ["chunked_ops.json", "chunked_grid.json"]
  assert table["device"] == "NVIDIA H200" and table["axes"] == ["key_dim", "length"]
  assert table["points"] == [dict(key_dim=32, length=100, ms=dict(pallas=5.0, xla=4.0)),
                             dict(key_dim=64, length=4096, ms=dict(pallas=2.0, xla=2.0))]
  assert dispatch_tables.build("gated_delta_rule", tmp_path) is None


def test_attention_headline_and_grid_rows(tmp_path):
  common = dict(kind="time", mode="fwd+bwd", status="ok")
  _write(tmp_path, "attention.json", [
      dict(common, shape="b8_n8_t4096_h32", causal=True, impl="flex", median_ms=1.0),
      dict(common, shape="b8_n8_t4096_h32", causal=True, impl="cudnn", median_ms=2.0),
      dict(common, shape="b8_n8_t4096_h32", causal=True, impl="mha_default", median_ms=0.5)])
  grid = dict(common, grid="attention", variant="gqa", dtype="bfloat16", H=80, S=3000, T=3000)
  _write(tmp_path, "attention_grid.json", [
      dict(grid, impl="flex", median_ms=3.0), dict(grid, impl="cudnn", median_ms=2.5),
      dict(grid, impl="tokamax_mosaic", median_ms=2.0)])  # a peer: not ours to choose
  points = dispatch_tables.build("attention", tmp_path)["points"]
  assert points == [
      dict(dtype="bfloat16", variant="causal", head_dim=32, length=4096,
           ms=dict(cudnn=2.0, flex=1.0)),
      dict(dtype="bfloat16", variant="gqa", head_dim=80, length=3000,
           ms=dict(cudnn=2.5, flex=3.0))]
