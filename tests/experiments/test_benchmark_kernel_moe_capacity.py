"""experiments.benchmark_kernel_moe --sections capacity on the CPU, tiny sizes.

The program runs as a subprocess: it defines absl flags at import ('output'
among them, which other benchmark programs define too), so importing it here
would clash with other tests of the same pytest process.
"""

import json
import os
import subprocess
import sys

from experiments import harness

# One of the four paths: each case is a fresh process (JAX's import and a
# compile, seconds on CI's CPU), and the sweep's logic is the same per path.
IMPLS = ("dense",)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_capacity(tmp_path, *flags: str) -> tuple[list[dict], str]:
  """Runs the capacity section with `flags`; returns (JSON rows, stdout)."""
  output = tmp_path / "capacity.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.benchmark_kernel_moe", "--sections=capacity",
       f"--output={output}", *flags],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(output) as f:
    return json.load(f)["rows"], proc.stdout


def test_capacity_rows_double_per_path_and_summarize(tmp_path):
  rows, stdout = _run_capacity(tmp_path, "--capacity_start=64", "--capacity_max=128",
                               "--capacity_iters=1", f"--capacity_impls={','.join(IMPLS)}")
  cases = [r for r in rows if r["section"] == "capacity"]
  for impl in IMPLS:
    mine = [r for r in cases if r["impl"] == impl]
    assert [r["tokens"] for r in mine] == [64, 128], impl
    for r in mine:
      assert r["mode"] == "fwd+bwd"
      assert r["status"] in harness.STATUSES
      assert r["status"] == "ok", r.get("message")
      assert r["median_ms"] > 0 and r["planned_peak_mb"] > 0
      assert "peak_mb" in r  # None on the CPU: it reports no device peak
  summary = {r["impl"]: r for r in rows if r["section"] == "capacity_max"}
  assert sorted(summary) == sorted(IMPLS)
  for impl, r in summary.items():
    assert r["mode"] == "fwd+bwd"
    assert r["max_ok_tokens"] == 128
    assert r["first_failed_tokens"] is None
    assert r["stopped_by"] == "capacity_max"
  assert "| mode | tokens | dense |" in stdout


def test_a_case_whose_process_dies_still_gives_a_row(tmp_path):
  # The harness turns a process that exits without a row into an error row ...
  died = harness.run_in_fresh_process("experiments.no_such_module", [])
  assert died["status"] == "error" and "no_such_module" in died["message"]
  # ... and the sweep turns a killed one (here: past its time limit) into a
  # row too, then stops doubling that path.
  rows, stdout = _run_capacity(tmp_path, "--capacity_start=64", "--capacity_max=256",
                               "--capacity_impls=dense,gmm",
                               "--capacity_case_timeout_s=0.01")
  cases = [r for r in rows if r["section"] == "capacity"]
  assert [(r["impl"], r["tokens"]) for r in cases] == [("dense", 64), ("gmm", 64)]
  for r in cases:
    assert r["status"] == "error" and "timed out" in r["message"]
  summary = [r for r in rows if r["section"] == "capacity_max"]
  assert [r["impl"] for r in summary] == ["dense", "gmm"]
  for r in summary:
    assert r["max_ok_tokens"] is None
    assert (r["first_failed_tokens"], r["first_failed_status"]) == (64, "error")
    assert r["stopped_by"] == "error"
  assert "| fwd+bwd | dense | 64 | error |" in stdout
