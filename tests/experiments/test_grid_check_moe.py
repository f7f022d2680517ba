"""benchmark_kernel_moe --grid --grid_check on the CPU: every implementation
timed at a MoE grid point is first checked there against float32.

The program defines absl flags at import, so it runs in a subprocess: once
from its command line (the MoE grid's one smoke run, with a tokamax that
imports but cannot run off an NVIDIA GPU), once as a module whose check
functions a script calls with implementations that fail, give wrong values,
need a tokamax that is not installed, or a reference that fails.
"""

import json
import os
import subprocess
import sys

from experiments import shape_grid
from tests.experiments.test_benchmark_grid import _STAND_IN
from tests.experiments.test_benchmark_grid import ROOT
from tests.experiments.test_benchmark_grid import _run
from tests.experiments.test_benchmark_grid import _status

# bf16 against float32 at the smoke point: about 2e-3 to 8e-3 on the CPU.
_BF16_ERR = 3e-2
# The MoE layer's paths the grid run times (--grid_moe_impls).
_LAYER = "dense,gmm,auto"


def _errors(row: dict) -> dict:
  """A check row's `rel_err_*` fields."""
  return {k: v for k, v in row.items() if k.startswith("rel_err_")}


def test_grid_check_rows_at_every_point_for_every_timed_implementation(tmp_path):
  # The layer's paths: the reference ('dense'), the kernel's ('gmm') and what the
  # summary rates ('auto'); tests/models/test_moe.py checks every path against 'dense'.
  rows, text = _run(tmp_path, "experiments.benchmark_kernel_moe", "--smoke", "--grid",
                    "--grid_check", "--sections=check,op,moe", f"--grid_moe_impls={_LAYER}",
                    tokamax=_STAND_IN)
  checks = [r for r in rows if r["section"] == "check" and r.get("grid") == "moe"]
  for point in shape_grid.moe_grid("smoke"):
    for case, names in (("op", ("out", "dlhs", "drhs")), ("moe", ("out", "dparams", "dx"))):
      timed = {r["impl"] for r in rows if r["section"] == case and r["point"] == point.name}
      timed.discard("dense_matmul_same_flops")  # the op's yardstick: another product
      mine = [r for r in checks if r["case"] == case and r["point"] == point.name]
      assert sorted(r["impl"] for r in mine) == sorted(timed)  # one row each
      for r in mine:
        assert (r["experts"], r["top_k"], r["d_model"], r["d_hidden"], r["tokens"],
                r["rows"]) == (point.experts, point.top_k, point.d_model, point.d_hidden,
                               point.tokens, point.tokens * point.top_k)
        assert f'"case": "{case}", "impl": "{r["impl"]}", "status": ' in text  # its line
        if r["impl"] == "tokamax_ragged_dot":  # installed, but no NVIDIA GPU here
          assert r["status"] == "unsup" and "NVIDIA GPU" in r["message"]
          continue
        assert r["status"] == "ok", r.get("message")
        assert sorted(_errors(r)) == sorted(f"rel_err_{n}" for n in names)
        assert all(0 < e < _BF16_ERR for e in _errors(r).values()), r  # bf16 vs float32
  assert {r["impl"] for r in checks if r["case"] == "moe"} == set(_LAYER.split(","))
  assert {r["impl"] for r in checks if r["case"] == "op"} == {
      "pallas", "pallas_triton", "ragged_dot", "tokamax_ragged_dot"}
  # Checked before timed; the check section still runs once.
  order = [(r["section"], r.get("case")) for r in rows]
  assert order.index(("check", "op")) < order.index(("op", None))
  assert order.index(("check", "moe")) < order.index(("moe", None))
  assert order.count(("check", "grouped_matmul_vs_reference")) == 2  # f32, bf16
  # The grid's timings: every implementation at the point's sizes, tokamax 'unsup'.
  point = shape_grid.moe_grid("smoke")[0]
  for mode in ("forward", "fwd+bwd"):
    assert _status(rows, section="op", mode=mode) == {
        "pallas": "ok", "pallas_triton": "ok", "ragged_dot": "ok",
        "tokamax_ragged_dot": "unsup", "dense_matmul_same_flops": "ok"}
    assert _status(rows, section="moe", mode=mode) == {i: "ok" for i in _LAYER.split(",")}
  op = [r for r in rows if r["section"] == "op"]
  assert {r["rows"] for r in op} == {point.rows} and {r["point"] for r in op} == {point.name}
  checks = {(r["case"], r["dtype"]): r for r in rows if r["section"] == "check"}
  assert checks[("grouped_matmul_vs_reference", "float32")]["rel_err_out"] < 1e-5
  tokamax = [r for r in rows if r.get("impl") == "tokamax_ragged_dot"
             or r.get("case", "").startswith("tokamax")]
  assert len(tokamax) == 2 + 1 + 2  # the check section's, the grid check's, the timings'
  assert all(r["status"] == "unsup" and "NVIDIA GPU" in r["message"] for r in tokamax)
  summary = [r for r in rows if r["section"] == "grid_summary"]
  assert [r["mode"] for r in summary] == ["forward", "fwd+bwd"]
  assert all(r["best_layer_impl"] in ("dense", "gmm") and r["auto_vs_best"] > 0
             for r in summary)


_SCRIPT = '''
import json
import sys

import jax
from experiments import benchmark_kernel_moe as bench
from experiments import shape_grid
from ops.grouped_matmul import reference

point = shape_grid.MoePoint(4, 2, 32, 16, tokens=24)

def broken(a, b, s):
  raise RuntimeError("broken on purpose")

sys.modules["tokamax"] = None  # its import fails, as where it is not installed
impls = {"ragged_dot": bench.op_impls(grid=True)["ragged_dot"], "broken": broken,
         "doubled": lambda a, b, s: 2 * jax.lax.ragged_dot(a, b, s),
         "tokamax_ragged_dot": bench.op_impls(grid=True)["tokamax_ragged_dot"]}
rows = bench.op_check_rows(point, impls) + bench.moe_check_rows(point, ("sort", "no_such_path"))
reference.grouped_matmul_reference = broken
rows += bench.op_check_rows(point, {"ragged_dot": impls["ragged_dot"]})
print(json.dumps(rows))
'''


def test_a_failing_or_wrong_implementation_is_a_result():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  rows = json.loads(proc.stdout.strip().splitlines()[-1])
  (ok, broken, doubled, missing, moe_ok, moe_bad, no_reference) = rows
  assert ok["status"] == "ok" and all(0 < e < _BF16_ERR for e in _errors(ok).values())
  assert (ok["point"], ok["rows"], ok["grid"]) == ("e4_k2_d32_f16", 48, "moe")
  assert broken["status"] == "error" and "RuntimeError: broken on purpose" in broken["message"]
  assert doubled["status"] == "ok"  # the errors say it is wrong: 2x is 100 % off
  assert 0.9 < doubled["rel_err_out"] < 1.1 and 0.9 < doubled["rel_err_dlhs"] < 1.1
  assert missing["status"] == "unsup" and "tokamax is not installed" in missing["message"]
  assert moe_ok["status"] == "ok" and all(0 < e < _BF16_ERR for e in _errors(moe_ok).values())
  assert moe_bad["status"] == "error" and "dropless_impl" in moe_bad["message"]
  assert no_reference["status"] == "error"
  assert "the float32 reference failed: RuntimeError: broken on purpose" in (
      no_reference["message"])
