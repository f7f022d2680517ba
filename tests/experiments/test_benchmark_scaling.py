"""experiments.benchmark_scaling --smoke on the CPU: dp and multiprocess, 2 devices.

The program runs as a subprocess: it defines absl flags at import ('output'
among them, which other benchmark programs define too), and it starts its
own worker processes (one per configuration; two that join through
`jax.distributed.initialize` for the multiprocess case) with their own
simulated device counts. The dp case runs the Transformer only: each
configuration is a fresh process, and the Mamba-2 model adds nothing the
driver does differently.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3


def _run(*flags: str, timeout: float = 600) -> subprocess.CompletedProcess:
  # The environment carries the run's compilation cache (tests/conftest.py)
  # to the program's workers too.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "experiments.benchmark_scaling", *flags],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  output = tmp_path_factory.mktemp("scaling") / "scaling.json"
  # A row of a case this run does not measure stays; the run's cases' old rows go.
  with open(output, "w") as f:
    json.dump({"environment": {}, "rows": [
        {"case": "fsdp", "variant": "kept", "status": "ok"},
        {"case": "dp", "variant": "stale", "status": "ok"}]}, f)
  proc = _run("--smoke", "--cases=dp,multiprocess", "--dp_models=transformer",
              "--num_devices=2", f"--steps={STEPS}", f"--output={output}")
  assert proc.returncode == 0, proc.stderr[-5000:]
  with open(output) as f:
    return json.load(f)


def _rows(result, case):
  return [r for r in result["rows"] if r["case"] == case]


def test_dp_rows_scale_from_one_device(result):
  assert result["environment"]["device_count"] == 2
  rows = _rows(result, "dp")
  assert [(r["variant"], r["num_gpus"]) for r in rows] == [
      ("data_parallel", 1), ("data_parallel", 2)], rows
  for row in rows:
    assert row["status"] == "ok", row.get("message")
    assert row["global_batch"] == 2 * row["num_gpus"]  # the same per-device batch
    assert row["tokens_per_s"] > 0 and row["step_ms"] > 0
    assert len(row["losses"]) == STEPS and np.all(np.isfinite(row["losses"]))
    assert row["state_bytes_per_device"] > 0
    assert "peak_bytes_per_device" in row  # null: the CPU reports no peak
  one, two = rows
  assert one["scaling_efficiency"] == 1.0
  assert two["scaling_efficiency"] == pytest.approx(
      two["tokens_per_s"] / (2 * one["tokens_per_s"]))


def test_one_process_per_device_trains_as_one_process(result):
  single, many = _rows(result, "multiprocess")
  for row in (single, many):
    assert row["status"] == "ok", row.get("message")
    assert row["num_gpus"] == 2
  assert (single["num_processes"], many["num_processes"]) == (1, 2)
  assert many["processes_agree"]
  # Two devices: each all-reduce adds the same two numbers in either process
  # layout, so the losses agree to the bit.
  np.testing.assert_array_equal(many["losses"], single["losses"])
  assert len(many["losses"]) == STEPS
  assert many["same_losses"] and many["max_abs_loss_diff"] == 0.0
  assert many["throughput_ratio"] == pytest.approx(
      many["tokens_per_s"] / single["tokens_per_s"])
  assert len(many["tokens_per_s_by_process"]) == 2


def test_rows_of_other_cases_are_kept(result):
  assert [r["variant"] for r in _rows(result, "fsdp")] == ["kept"]
  assert "stale" not in [r["variant"] for r in _rows(result, "dp")]


def test_unknown_case_is_refused():
  proc = _run("--cases=dp,pipeline", "--output=/tmp/unused_scaling.json", timeout=120)
  assert proc.returncode != 0
  assert "--cases" in proc.stderr and "pipeline" in proc.stderr
