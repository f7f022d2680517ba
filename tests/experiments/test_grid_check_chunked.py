"""`--grid --grid_check` of benchmark_kernel_ssm and benchmark_kernel_ssd on the CPU
(their only `--grid` smoke runs: the timings and the summary rows too).

At every grid point each implementation the programs time there is first
checked against its op's float32 reference: the selective scan's Pallas and
XLA tiers by benchmark_kernel_ssm, and, in the benchmark_kernel_ssd process it
launches with the flag passed on, ssd's (after its fixed `--check` of both
tiers of ssd and the gated delta rule). The programs run as subprocesses
(they define absl flags at import, some with the same names).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from experiments import harness
from experiments import shape_grid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)


def _rows(path):
  with open(path) as f:
    rows = json.load(f)["rows"]
  assert all(r["status"] in harness.STATUSES for r in rows if "status" in r)
  return rows


def _python(*args):
  """Runs `python *args` in the repository on the CPU; returns (returncode, output)."""
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=_ENV, capture_output=True,
                        text=True, timeout=600)
  return proc.returncode, proc.stdout + proc.stderr


def _checked_before_timed(rows, point, check_kind, time_kind):
  """Whether every check row of `point` precedes its first timed row."""
  kinds = [r["kind"] for r in rows if r.get("point") == point]
  return check_kind in kinds and time_kind in kinds and (
      max(i for i, k in enumerate(kinds) if k == check_kind)
      < kinds.index(time_kind))


# Runs benchmark_kernel_ssm with the given flags, its launch of
# benchmark_kernel_ssd recorded rather than run; prints what it would launch.
_LAUNCH_SCRIPT = textwrap.dedent("""
    import json
    import sys
    from absl import app
    from experiments import benchmark_kernel_ssm
    from experiments import harness

    launched = []
    harness.run_program = lambda *call: launched.append(call)
    sys.argv = ["benchmark_kernel_ssm", *sys.argv[1:]]
    try:
      app.run(benchmark_kernel_ssm.main)
    except SystemExit as e:
      assert not e.code, e.code
    print("LAUNCHED", json.dumps(launched))
""")


def test_grid_check_checks_every_timed_implementation_at_every_point(tmp_path):
  output = tmp_path / "ssm_grid.json"
  code, text = _python("-c", _LAUNCH_SCRIPT, "--small", "--grid", "--grid_check",
                       "--ops=selective_scan,ssd", "--iters=2", f"--output={output}")
  assert code == 0, text[-3000:]

  # The selective scan: Pallas and XLA at each scan point, float32.
  rows = _rows(output)
  points = [p.name for p in shape_grid.scan_grid("smoke")]
  timed = {(r["point"], r["impl"]) for r in rows if r["kind"] == "time"}
  checks = [r for r in rows if r["kind"] == "check" and r.get("grid") == "scan"]
  assert timed == {(p, i) for p in points for i in ("pallas", "xla")}
  shapes = {p.name: p.shape for p in shape_grid.scan_grid("smoke")}
  times = [r for r in rows if r["kind"] == "time"]
  assert {(r["impl"], r["mode"]) for r in times} == {
      (i, m) for i in ("pallas", "xla") for m in ("fwd", "fwd+bwd")}
  assert all(r["status"] == "ok" and tuple(r["shape"]) == shapes[r["point"]] for r in times)
  assert not [r for r in rows if r["kind"] in ("memory", "model")]  # the grid alone
  assert sorted((r["point"], r["impl"]) for r in checks) == sorted(timed)
  for r in checks:
    assert r["status"] == "ok", r
    errors = [r[f"err_d{n}"] for n in ("u", "delta", "A", "B", "C")]
    assert max(r["err_y"], r["err_final"], *errors) < 1e-5, r
    assert r["err_grads"] == max(errors)
  assert all(_checked_before_timed(rows, p, "check", "time") for p in points)
  # Then the fixed check, forward and reverse.
  fixed = [r for r in rows if r["kind"] == "check" and "grid" not in r]
  assert sorted((r["impl"], r["reverse"]) for r in fixed) == [
      (i, reverse) for i in ("pallas", "xla") for reverse in (False, True)]
  assert all(r["status"] == "ok" and r["err_y"] < 1e-5 for r in fixed), fixed

  # The chunked ops, in the benchmark_kernel_ssd process it launches with the
  # flag passed on: first --check (on by default; bfloat16 under --quick, at the
  # grid's point), both tiers of both ops; then at the point every
  # implementation timed there (ssd's kernel and XLA here), bfloat16 against
  # the float32 reference.
  [(module, chunked_output, flags)] = json.loads(text.split("LAUNCHED ", 1)[1].splitlines()[0])
  assert module == "experiments.benchmark_kernel_ssd" and "--grid_check" in flags
  assert chunked_output == str(tmp_path / "chunked_grid.json")
  code, text = _python("-m", module, f"--output={chunked_output}", *flags,
                       "--impls=ssd/pallas,ssd/xla")
  assert code == 0, text[-3000:]
  rows = _rows(chunked_output)
  points = {p.name: p.shape for p in shape_grid.chunked_grid("smoke")}
  fixed = [r for r in rows if r["kind"] == "check" and "grid" not in r]
  assert sorted(r["name"] for r in fixed) == sorted(
      f"{op}/{impl}_chunk64" for op in ("ssd", "gated_delta_rule") for impl in ("pallas", "xla"))
  ops = [r for r in rows if r["kind"] == "op"]
  assert {(r["name"], r["mode"]) for r in ops} == {
      (n, m) for n in ("ssd/pallas", "ssd/xla") for m in ("fwd", "fwd+bwd")}
  for r in ops:
    assert r["status"] == "ok" and (r["B"], r["T"], r["N"], r["K"], r["V"]) == points[r["point"]]
  timed = {(r["point"], r["name"]) for r in ops}
  assert timed == {(p, n) for p in points for n in ("ssd/pallas", "ssd/xla")}
  checks = [r for r in rows if r["kind"] == "check" and r.get("grid") == "chunked"]
  assert sorted((r["point"], r["name"]) for r in checks) == sorted(timed)
  for r in fixed + checks:
    assert r["status"] == "ok" and r["dtype"] == "bfloat16", r
    assert (r["B"], r["T"], r["N"], r["K"], r["V"]) == next(iter(points.values()))
    inputs = ["q", "k", "v", "log_decay"] + (["beta"] if r["op"] == "gated_delta_rule" else [])
    assert sorted(k for k in r if k.startswith("d") and k.endswith("_err")) == sorted(
        f"d{n}_err" for n in inputs)
    errors = [r[f"d{n}_err"] for n in inputs]
    # bfloat16 rounding, not zero: the reference ran in float32.
    assert 1e-4 < max(r["y_err"], r["final_err"], *errors) < 2e-2, r
    assert r["grad_err"] == max(errors)
  assert all(_checked_before_timed(rows, p, "check", "op") for p in points)
  assert f'"point": "{next(iter(points))}", "name": "ssd/pallas"' in text  # a line a row
  # A summary row per (point, mode): the CPU's default is XLA; the kernel's
  # rows carry their ratio to it.
  summary = [r for r in rows if r["kind"] == "summary"]
  assert sorted((r["op"], r["point"], r["mode"]) for r in summary) == sorted(
      ("ssd", p, mode) for p in points for mode in ("fwd", "fwd+bwd"))
  assert all(r["default_impl"] == "xla" and r["default_vs_xla"] == 1.0 for r in summary)
  assert all(r["ratio_vs_xla"] > 0 for r in ops if r["name"] == "ssd/pallas")


_CHECK_SCRIPT = textwrap.dedent("""
    import json
    import jax
    import jax.numpy as jnp
    import numpy as np
    from experiments import benchmark_kernel_ssd as b
    from experiments import workloads

    shape = (2, 24, 2, 8, 8)
    args = workloads.ssd_inputs(*shape, jnp.float32, seed=1)
    for op, inputs in b.INPUTS.items():
      # Three (sequence, head) pairs a slice: slices of 3 and 1 of the 4 pairs.
      got = b.reference_outputs(op, args, state_bytes=3 * 24 * 8 * 8 * 4)
      ref = b.REFERENCES[op]
      want = (*ref(*args), jax.grad(workloads.chunked_loss(ref),
                                    argnums=tuple(range(len(inputs))))(*args))
      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == jnp.float32 and g.shape == w.shape, (op, g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)

    real = workloads.chunked_op

    def chunked_op(op, impl, chunk):
      fn = real(op, "xla", chunk)
      if impl == "wrong":
        return lambda *a: (lambda y, final: (y * 1.05, final))(*fn(*a))
      if impl in ("broken", "declines"):
        def fail(*a):
          raise (RuntimeError("the kernel broke") if impl == "broken"
                 else ValueError("the kernel declines K 8"))
        return fail
      return fn

    workloads.chunked_op = chunked_op
    b.REFERENCES["gated_delta_rule"] = lambda *a: 1 / 0
    cases = {n: ("ssd", n, 8) for n in ("xla", "wrong", "broken", "declines")}
    cases["gdr"] = ("gated_delta_rule", "xla", 8)
    rows = b.check_shape(shape, jnp.float32, cases, dict(grid="chunked", point="p"))
    print("ROWS", json.dumps(rows))
""")


def test_check_reports_wrong_failing_and_declining_implementations():
  code, text = _python("-c", _CHECK_SCRIPT)
  assert code == 0, text[-3000:]
  rows = {r["name"]: r for r in json.loads(text.split("ROWS ", 1)[1].splitlines()[0])}
  assert all(r["kind"] == "check" and r["point"] == "p" for r in rows.values())
  assert rows["xla"]["status"] == "ok" and rows["xla"]["y_err"] < 1e-5
  assert rows["wrong"]["status"] == "ok" and rows["wrong"]["y_err"] > 1e-2
  assert rows["wrong"]["final_err"] < 1e-5
  assert rows["broken"]["status"] == "error"
  assert "RuntimeError: the kernel broke" in rows["broken"]["message"]
  assert rows["declines"]["status"] == "unsup"
  assert "declines K 8" in rows["declines"]["message"]
  assert rows["gdr"]["status"] == "error"
  assert "the float32 reference failed: ZeroDivisionError" in rows["gdr"]["message"]


@pytest.mark.parametrize("module", ["experiments.benchmark_kernel_ssd",
                                    "experiments.benchmark_kernel_ssm"])
def test_grid_check_without_grid_is_refused(tmp_path, module):
  code, text = _python("-m", module, "--grid_check", f"--output={tmp_path / 'rows.json'}")
  assert code != 0 and "--grid_check checks the grid's points: give --grid too" in text
