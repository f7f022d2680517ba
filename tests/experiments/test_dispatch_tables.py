"""experiments/dispatch_tables.py: the committed tables are what the committed
benchmark JSON gives, a grid run joins its headline rows, gpu_check's rows
give points and say which kernels passed, per device kind and JAX release."""

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


def _write(folder, name, rows, device="NVIDIA H200", jax="0.11.2"):
  """A merge of runs (the committed form), or one run's file for a grid."""
  environment = dict(device_kind=device, jax=jax)
  data = (dict(environment=environment) if "grid" in name
          else dict(sources={"t": dict(environment=environment)}))
  rows = rows if "grid" in name else [dict(r, source="t") for r in rows]
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
  assert table["axes"] == ["key_dim", "length"] and table["kernels"] == ["pallas"]
  (data,) = table["devices"]
  assert data["sources"] == ["chunked_ops.json", "chunked_grid.json"]
  assert data["device"] == "NVIDIA H200" and data["jax"] == "0.11.2"
  assert data["checked"] == {}  # no gpu_check run
  assert data["points"] == [dict(key_dim=32, length=100, ms=dict(pallas=5.0, xla=4.0)),
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
  points = dispatch_tables.build("attention", tmp_path)["devices"][0]["points"]
  assert points == [
      dict(dtype="bfloat16", variant="causal", head_dim=32, length=4096,
           ms=dict(cudnn=2.0, flex=1.0)),
      dict(dtype="bfloat16", variant="gqa", head_dim=80, length=3000,
           ms=dict(cudnn=2.5, flex=3.0))]


def _gpu_check(folder, runs):
  """gpu_check.json of `runs`: run id -> (device kind, JAX, rows)."""
  sources = {run: dict(environment=dict(device_kind=device, jax=jax, time=run))
             for run, (device, jax, _) in runs.items()}
  rows = [dict(r, source=run) for run, (_, _, rs) in runs.items() for r in rs]
  with open(folder / "gpu_check.json", "w") as f:
    json.dump(dict(sources=sources, rows=rows), f)


def _timed(impl, ms, table="ssd", **point):
  return dict(kind="time", op="ssd", mode="fwd+bwd", status="ok", median_ms=ms,
              points={table: dict(point, impl=impl)})


def test_gpu_check_rows_are_points_of_their_device_kind_and_its_passes_check_the_kernels(
    tmp_path):
  _write(tmp_path, "chunked_ops.json", [
      dict(kind="op", op="ssd", implementation=impl, name=f"ssd/{impl}", mode="fwd+bwd",
           status="ok", median_ms=ms, T=4096, K=64) for impl, ms in (("pallas", 1.0), ("xla", 2.0))])
  point = dict(key_dim=64, length=4096)
  check = lambda status, op="ssd": dict(kind="check", op=op, status=status)
  _gpu_check(tmp_path, {
      # An L4 whose kernel checks passed; its timings make a section of its own.
      "2026-12-01T00:00:00": ("NVIDIA L4", "0.11.2", [
          check("ok"), check("unsup"), _timed("pallas", 3.0, **point),
          _timed("xla", 2.5, **point)]),
      # The H200's older run passed, its newer one failed: the newer counts.
      "2026-12-02T00:00:00": ("NVIDIA H200", "0.11.2", [check("ok")]),
      "2026-12-03T00:00:00": ("NVIDIA H200", "0.11.2", [check("ok"), check("fail")]),
      # Another JAX release of the H200: a section of its own.
      "2026-12-04T00:00:00": ("NVIDIA H200", "0.12.0", [
          check("ok"), _timed("pallas", 0.5, **point), _timed("xla", 1.5, **point)]),
  })
  table = dispatch_tables.build("ssd", tmp_path)
  devices = {(d["device"], d["jax"]): d for d in table["devices"]}
  assert set(devices) == {("NVIDIA H200", "0.11.2"), ("NVIDIA H200", "0.12.0"),
                          ("NVIDIA L4", "0.11.2")}
  assert devices["NVIDIA H200", "0.11.2"]["checked"] == {}
  assert devices["NVIDIA H200", "0.11.2"]["points"] == [dict(point, ms=dict(pallas=1.0, xla=2.0))]
  assert devices["NVIDIA H200", "0.12.0"]["checked"] == {"pallas": "2026-12-04T00:00:00"}
  assert devices["NVIDIA H200", "0.12.0"]["sources"] == ["gpu_check.json"]
  assert devices["NVIDIA L4", "0.11.2"]["checked"] == {"pallas": "2026-12-01T00:00:00"}
  assert devices["NVIDIA L4", "0.11.2"]["points"] == [dict(point, ms=dict(pallas=3.0, xla=2.5))]
  # The MoE layer's kernels need both grouped ops' checks.
  _gpu_check(tmp_path, {"2026-12-05T00:00:00": ("NVIDIA L4", "0.11.2", [
      check("ok", "grouped_mlp"), _timed("gmm", 1.0, "moe", experts=8, top_k=2, d_model=512,
                                         d_hidden=1024, tokens=8192),
      _timed("ragged_dot", 2.0, "moe", experts=8, top_k=2, d_model=512, d_hidden=1024,
             tokens=8192)])})
  assert dispatch_tables.build("moe", tmp_path)["devices"][0]["checked"] == {}
  assert dispatch_tables.checked("grouped_mlp", tmp_path) == {
      ("NVIDIA L4", "0.11"): {"pallas": "2026-12-05T00:00:00"}}
