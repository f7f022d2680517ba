"""experiments.benchmark_decode on the CPU: both sections' smoke run, the
generate section's parameter counts at the benchmark's sizes, a bad flag.

The program runs as a subprocess: it defines absl flags at import ('output'
among them, which other benchmark programs define too), so importing it here
would clash with other tests of the same pytest process.
"""

import json
import os
import subprocess
import sys

from experiments import harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ("transformer", "transformer_xla", "mamba2", "gated_deltanet")
# The smoke run's: both Transformer attentions and one SSM (the two share
# `_cell`; tests/models/test_decoding.py decodes the gated delta net).
SMOKE_MODELS = ("transformer", "transformer_xla", "mamba2")


def _run(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, list[dict] | None]:
  """Runs the program with `flags` on the CPU; returns (process, JSON rows)."""
  output = tmp_path / "decode.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")  # XLA_FLAGS and the cache: tests/conftest.py
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.benchmark_decode", f"--output={output}", *flags],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  if not output.exists():
    return proc, None
  with open(output) as f:
    return proc, json.load(f)["rows"]


def test_smoke_runs_both_sections(tmp_path):
  proc, rows = _run(tmp_path, "--smoke", f"--models={','.join(SMOKE_MODELS)}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert all(r["status"] in harness.STATUSES for r in rows)

  kernel = [r for r in rows if r["section"] == "kernel"]
  timed = {r["impl"]: r for r in kernel if r["kind"] == "time"}
  assert sorted(timed) == ["cudnn", "jax_nn_xla", "pallas", "xla"]
  for impl in ("pallas", "xla", "jax_nn_xla"):
    assert timed[impl]["status"] == "ok", timed[impl].get("message")
    assert timed[impl]["median_ms"] > 0
  assert timed["cudnn"]["status"] == "unsup"  # no NVIDIA GPU here
  (summary,) = [r for r in kernel if r["kind"] == "summary"]
  assert summary["xla_over_pallas"] == timed["xla"]["median_ms"] / timed["pallas"]["median_ms"]

  generate = [r for r in rows if r["section"] == "generate"]
  summaries = {r["model"]: r for r in generate if r["kind"] == "summary"}
  assert sorted(summaries) == sorted(SMOKE_MODELS)
  for model in SMOKE_MODELS:
    by_kind = {r["kind"]: r for r in generate if r["model"] == model}
    for kind in ("prefill", "generate", "summary"):
      assert by_kind[kind]["status"] == "ok", (model, kind, by_kind[kind].get("message"))
    s = by_kind["summary"]
    assert s["prefill_ms"] == by_kind["prefill"]["median_ms"] > 0
    assert s["generate_ms"] == by_kind["generate"]["median_ms"] > s["prefill_ms"]
    assert s["per_token_ms"] == (s["generate_ms"] - s["prefill_ms"]) / (s["G"] - 1) > 0
    assert s["tokens_per_s"] == s["B"] * s["G"] / (s["generate_ms"] / 1e3)
    assert 0 < s["body_params"] < s["params"]
  assert summaries["transformer_xla"]["params"] == summaries["transformer"]["params"]
  assert summaries["transformer"]["per_token_vs_transformer"] == 1
  assert summaries["mamba2"]["cell"] == "Mamba2Cell"
  assert summaries["mamba2"]["cell_kwargs"] == {"expand": 2, "head_dim": 16, "state_dim": 16}
  assert "| model | B | num_layers |" in proc.stdout


def test_ssm_parameter_counts_match_the_transformer(tmp_path):
  proc, rows = _run(tmp_path, "--sections=generate", "--counts_only")
  assert proc.returncode == 0, proc.stderr[-3000:]
  counts = {r["model"]: r for r in rows}
  assert sorted(counts) == sorted(MODELS)
  transformer = counts["transformer"]
  assert (transformer["model_dim"], transformer["num_layers"]) == (1024, 8)
  assert transformer["num_kv_heads"] == 4 and transformer["params_vs_transformer"] == 1
  for model in ("mamba2", "gated_deltanet"):
    r = counts[model]
    assert r["model_dim"] == 1024 and r["status"] == "ok"
    assert 0.85 <= r["params_vs_transformer"] <= 1.15, r
    assert r["body_params"] / transformer["body_params"] == r["params_vs_transformer"]
  assert counts["gated_deltanet"]["cell_kwargs"] == {"num_heads": 8}
  assert not any("median_ms" in r for r in rows)  # nothing was timed


def test_a_bad_flag_fails_before_running(tmp_path):
  proc, rows = _run(tmp_path, "--gen_tokens=1")
  assert proc.returncode != 0 and rows is None
  assert "--gen_tokens must be >= 2" in proc.stderr
