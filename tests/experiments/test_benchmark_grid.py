"""The kernel benchmarks' smoke paths on the CPU: tokamax as an optional peer
and `--grid` over experiments/shape_grid.py.

Each program runs as a subprocess (they define absl flags at import, some
with the same names). tokamax is made absent with a package on PYTHONPATH
whose import fails, or present as a stand-in on JAX's own ops that declines
the 'triton' implementation, so the rows say what the benchmark does with a
missing, a working and a declining peer whatever this environment has.
"""

import json
import os
import subprocess
import sys

import pytest

from experiments import harness
from experiments import shape_grid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MISSING = "tokamax blocked for this test"
_BLOCKER = f"raise ImportError({MISSING!r})\n"
# The calls the benchmarks make, on JAX's XLA paths.
_STAND_IN = '''
import jax

def dot_product_attention(q, k, v, *, implementation, **options):
  if implementation != "mosaic":
    raise NotImplementedError("the stand-in runs 'mosaic' only")
  return jax.nn.dot_product_attention(q, k, v, implementation="xla", **options)

def ragged_dot(lhs, rhs, group_sizes, *, implementation):
  return jax.lax.ragged_dot(lhs, rhs, group_sizes)
'''


def _run(tmp_path, module, *flags, tokamax=_BLOCKER, ok=True):
  """Runs `python -m module --output=... *flags` on the CPU with `tokamax`
  as the tokamax package's source; returns (JSON rows, stdout + stderr)."""
  package = tmp_path / "site" / "tokamax"
  package.mkdir(parents=True, exist_ok=True)
  (package / "__init__.py").write_text(tokamax)
  output = tmp_path / "rows.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), ROOT]))
  proc = subprocess.run([sys.executable, "-m", module, f"--output={output}", *flags],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  text = proc.stdout + proc.stderr
  if not ok:
    assert proc.returncode != 0, text[-3000:]
    return None, text
  assert proc.returncode == 0, text[-3000:]
  with open(output) as f:
    rows = json.load(f)["rows"]
  assert all(r["status"] in harness.STATUSES for r in rows if "status" in r)
  return rows, text


def _status(rows, **match):
  """{impl: status} of the rows with these fields."""
  return {r["impl"]: r["status"] for r in rows
          if all(r.get(k) == v for k, v in match.items())}


def test_attention_smoke_gives_unsup_rows_where_tokamax_is_missing(tmp_path):
  rows, _ = _run(tmp_path, "experiments.benchmark_kernel_attention", "--smoke", "--check",
                 "--causal=false", "--impls=flex,xla,tokamax_mosaic,tokamax_triton")
  for mode in ("fwd", "fwd+bwd"):
    assert _status(rows, kind="time", mode=mode) == {
        "flex": "ok", "xla": "ok", "tokamax_mosaic": "unsup", "tokamax_triton": "unsup"}
  for r in rows:
    if r.get("impl", "").startswith("tokamax") or r.get("variant", "").startswith("tokamax"):
      assert MISSING in r["message"]
  checks = {r["variant"]: r for r in rows if r["kind"] == "check"}
  assert checks["table"]["status"] == "ok" and checks["table"]["fwd_rel"] < 1e-5
  assert checks["tokamax_mosaic"]["status"] == checks["tokamax_triton"]["status"] == "unsup"
  summary = [r for r in rows if r["kind"] == "summary"]
  assert len(summary) == 2 and "tokamax_best_ms" not in summary[0]


def test_attention_grid_times_and_checks_every_implementation_at_a_point(tmp_path):
  rows, text = _run(
      tmp_path, "experiments.benchmark_kernel_attention", "--grid", "--smoke",
      "--grid_stride=3", "--grid_check",
      "--grid_impls=flex,cudnn,xla,tokamax_mosaic,tokamax_triton", tokamax=_STAND_IN)
  point = shape_grid.attention_grid("smoke")[0]
  assert {r["point"] for r in rows} == {point.name}
  want = {"flex": "ok", "cudnn": "unsup", "xla": "ok", "tokamax_mosaic": "ok",
          "tokamax_triton": "unsup"}
  for mode in ("fwd", "fwd+bwd"):
    assert _status(rows, kind="time", mode=mode) == want
  assert _status(rows, kind="check") == want
  by_impl = {r["impl"]: r for r in rows if r["kind"] == "check"}
  for name in ("flex", "xla", "tokamax_mosaic"):  # bf16 against the f32 reference
    assert 0 < by_impl[name]["fwd_rel"] < 1e-2 and by_impl[name]["dk_rel"] < 1e-2
  assert "NVIDIA GPU" in by_impl["cudnn"]["message"]
  assert "runs 'mosaic' only" in by_impl["tokamax_triton"]["message"]
  time_row = next(r for r in rows if r["kind"] == "time" and r["impl"] == "flex")
  assert (time_row["B"], time_row["T"], time_row["N"], time_row["K"], time_row["H"]) == (
      point.batch, 77, 8, 1, 80)
  assert time_row["causal"] and time_row["tflops"] > 0
  for s in (r for r in rows if r["kind"] == "summary"):
    assert s["default_impl"] == "xla"  # the CPU's default
    assert s["best_peer"] == "tokamax_mosaic"  # cuDNN did not run
    assert s["default_vs_best_ours"] == s["xla_ms"] / min(s["flex_ms"], s["xla_ms"])
  assert "default_vs_best_peer" in text


# The MoE grid's smoke run, with the stand-in tokamax, is
# tests/experiments/test_grid_check_moe.py's (with --grid_check).


# The chunked and scan grids' smoke runs are tests/experiments/test_grid_check_chunked.py's
# (with --grid_check).


def test_tuner_sweeps_at_grid_points(tmp_path):
  rows, text = _run(tmp_path, "experiments.tune_flex_attention", "--grid",
                    "--grid_subset=smoke", "--grid_stride=3", "--small", "--kernels=fwd",
                    "--interpret", "--iters=1", "--budget_s=3")
  point = shape_grid.attention_grid("smoke")[0]
  assert rows and {r["point"] for r in rows} == {point.name}
  assert rows[0]["table"] and rows[0]["status"] == "ok"  # the table's own tiles first
  assert (rows[0]["T"], rows[0]["K"], rows[0]["H"]) == (77, 1, 80)
  assert f"| {point.name} | 80 | True | fwd |" in text


@pytest.mark.parametrize("module, flags, message", [
    ("experiments.benchmark_kernel_ssd", ["--grid", "--grid_stride=2", "--grid_offset=2"],
     "--grid_offset must be less than --grid_stride"),
    ("experiments.benchmark_kernel_attention", ["--grid", "--grid_impls=flex,fa3"],
     "--grid_impls: unknown ['fa3']"),
    ("experiments.benchmark_kernel_moe", ["--grid", "--sections=op,tiles"],
     "--grid runs the sections"),
])
def test_bad_grid_flags_are_refused_naming_them(tmp_path, module, flags, message):
  _, text = _run(tmp_path, module, *flags, ok=False)
  assert message in text
