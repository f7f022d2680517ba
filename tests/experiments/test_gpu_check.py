"""experiments.gpu_check on the CPU (`--smoke`: every section, kernels in
interpret mode) and the judgements it makes: the tests' bounds, greedy decoding
against the forward pass.

The program runs as a subprocess: it defines absl flags at import ('output'
among them, which other benchmark programs define too).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import checks
from experiments import harness
from experiments import tolerances

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = ("flex_attention", "ssd", "gated_delta_rule", "grouped_mlp", "grouped_matmul",
       "selective_scan", "linear_scan", "decode_attention")
# gpu_check.SMOKE_MODELS: each model case once, the SSD cell for the five SSM
# cells (tests/models/test_sharding.py differentiates a model of each other cell).
MODELS = ("transformer", "dit", "ssm_ssd", "moe", "unet")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  """(process, the JSON) of one smoke run whose output file already holds a
  run of another device kind (kept) and an earlier run of this one (replaced)."""
  output = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
  earlier = {"sources": {
      "2026-01-01T00:00:00": {"environment": dict(device_kind="NVIDIA A100", jax="0.11.2")},
      "2026-01-02T00:00:00": {"environment": dict(device_kind="cpu", jax="0.11.0")}},
      "rows": [dict(kind="check", op="ssd", status="ok", source="2026-01-01T00:00:00"),
               dict(kind="check", op="ssd", status="fail", source="2026-01-02T00:00:00")]}
  output.write_text(json.dumps(earlier))
  env = dict(os.environ, JAX_PLATFORMS="cpu")  # XLA_FLAGS and the cache: tests/conftest.py
  proc = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "--smoke",
                         f"--output={output}"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=900)
  return proc, json.loads(output.read_text()) if output.exists() else None


def _rows(data, kind):
  mine = max(data["sources"])
  return [r for r in data["rows"] if r["kind"] == kind and r["source"] == mine]


def test_smoke_runs_every_section_and_passes(smoke):
  proc, data = smoke
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
  assert all(r["status"] in harness.STATUSES for r in data["rows"])
  checked = {r["op"]: r for r in _rows(data, "check")}
  assert set(checked) == set(OPS)
  for op, row in checked.items():  # the Triton kernels in interpret mode
    assert row["status"] == "ok" and row["backend"] == "triton", (op, row)
    assert 0 < row["worst"] <= 1 and row["errors"], (op, row)
  timed = {(r["op"], r["impl"]): r for r in _rows(data, "time")}
  for op in OPS:
    for impl in ("pallas", "xla"):
      assert timed[op, impl]["status"] == "ok" and timed[op, impl]["median_ms"] > 0, (op, impl)
      assert timed[op, impl]["points"], (op, impl)
  assert timed["flex_attention", "cudnn"]["status"] == "unsup"  # no NVIDIA GPU here
  assert timed["flex_attention", "pallas"]["points"]["attention"]["impl"] == "flex"
  assert {timed["grouped_mlp", f"moe_{impl}"]["points"]["moe"]["impl"]
          for impl in ("gmm", "ragged_dot")} == {"gmm", "ragged_dot"}
  models = {r["model"]: r for r in _rows(data, "model")}
  assert set(models) == set(MODELS)
  assert all(r["status"] == "ok" and np.isfinite(r["loss"]) for r in models.values()), models
  generated = {r["model"]: r for r in _rows(data, "generate")}
  assert set(generated) == {"transformer", "mamba2"}
  assert all(r["status"] == "ok" for r in generated.values()), generated
  (sharded,) = _rows(data, "sharded")
  assert sharded["status"] == "ok" and sharded["num_devices"] == 8 and sharded["all_gathers"] == 0
  assert "| kind | what |" in proc.stdout  # the table


def test_the_run_records_its_environment_and_keeps_other_device_kinds(smoke):
  _, data = smoke
  runs = sorted(data["sources"])
  assert runs[0] == "2026-01-01T00:00:00" and len(runs) == 2  # the cpu run of 0.11.0 replaced
  environment = data["sources"][runs[1]]["environment"]
  assert environment["device_kind"] == "cpu" and environment["jax"]
  for field in ("jaxlib", "commit", "gpu", "compute_capability", "driver", "cuda", "cudnn"):
    assert field in environment, field
  assert [r["status"] for r in data["rows"] if r["source"] == runs[0]] == ["ok"]


def test_bounds_are_the_tests_and_over_names_what_broke_them():
  ssd = tolerances.OPS["ssd"]
  assert ssd.bound("bfloat16") == tolerances.SSD["bfloat16"][0]
  assert ssd.bound("bfloat16", "q") == tolerances.SSD["bfloat16"][1]
  assert ssd.bound("bfloat16", "log_decay") == tolerances.SSD_LOG_DECAY_GRAD["bfloat16"]
  assert ssd.over("bfloat16", dict(y=0.01, final=0.0), dict(q=0.04, log_decay=0.09)) == []
  over = ssd.over("bfloat16", dict(y=0.05, final=float("nan")), dict(q=0.06, log_decay=0.09))
  assert [o.split()[0] for o in over] == ["y", "final", "dq"]


def test_greedy_agreement_takes_near_ties_and_refuses_the_rest():
  logits = np.zeros((1, 3, 4), np.float32)
  logits[0, :, 2] = 5.0
  logits[0, 1, 1] = 5.0 - 1e-3  # a near tie: either token is the argmax within rounding
  agree = checks.greedy_agreement(np.array([[2, 1, 2]]), logits)
  assert agree["mismatches"] == 1 and "status" not in agree
  assert checks.greedy_agreement(np.array([[2, 2, 0]]), logits)["status"] == "fail"
  assert checks.greedy_agreement(np.array([[2, -1, 2]]), logits)["status"] == "fail"
