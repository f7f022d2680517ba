"""The benchmark harness every experiments/benchmark_*.py program shares.

A case is a thunk that builds its inputs and returns a function to time. The
harness compiles it (timed separately), warms it up, times `iters` calls with
`jax.block_until_ready`, and records one JSON row with `status` in
ok | OOM | fail | unsup | error. A case that runs out of memory or fails to
compile records its row and the run moves on.
"""

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

import jax

STATUSES = ("ok", "OOM", "fail", "unsup", "error")


class Unsupported(Exception):
  """Raised by a case whose configuration this platform cannot run."""


def require_supported(fn: Callable, *args) -> None:
  """Traces `fn(*args)` abstractly (nothing compiles or runs): a ValueError,
  an op refusing these shapes, becomes `Unsupported`."""
  try:
    jax.eval_shape(fn, *args)
  except ValueError as exc:
    raise Unsupported(str(exc)) from exc


def check_row(row: dict, errors: Callable[[], dict]) -> dict:
  """`row` with status 'ok' and the fields `errors()` returns (a check's
  errors against its reference, and a status of its own where it judged
  them: 'fail'); where that raises, status 'unsup' (`Unsupported`) or
  'error', with the message: a failing implementation is a result, not the
  end of the run."""
  try:
    row.update(dict(dict(status="ok"), **errors()))
  except Unsupported as exc:
    row.update(status="unsup", message=str(exc)[:500])
  except Exception as exc:  # pylint: disable=broad-except
    row.update(status="error", message=f"{type(exc).__name__}: {str(exc)[:2000]}")
  return row


def computed_once(compute: Callable[[], Any], what: str) -> Callable[[], Any]:
  """A thunk returning `compute()`, run at its first call only. Where that
  raised, every call raises a RuntimeError naming `what`: a reference shared
  by several check rows fails each of them (`check_row`), not the run."""
  result = []

  def get():
    if not result:
      try:
        result.append((compute(), None))
      except Exception as exc:  # pylint: disable=broad-except
        result.append((None, f"{what} failed: {type(exc).__name__}: {exc}"))
    value, failure = result[0]
    if failure is not None:
      raise RuntimeError(failure)
    return value
  return get


def looks_like_oom(text: str) -> bool:
  """Whether an error message (or a process's output) reports device OOM."""
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _classify(exc: BaseException, stage: str) -> str:
  text = f"{type(exc).__name__}: {exc}"
  if looks_like_oom(text):
    return "OOM"
  if isinstance(exc, Unsupported):
    return "unsup"
  if stage == "compile":
    return "fail"
  return "error"


MIN_CALLS_PER_SAMPLE = 3
# Back-to-back calls per sample, in ms. A sample ends in one sync, which costs a
# few hundred microseconds on an H200: with 2 ms samples a call whose trace
# says 0.36 ms was timed at 0.55 ms, with 20 ms ones at 0.40 (BUILD_NOTES.md,
# "MoE").
SAMPLE_MS = 20.0


def run_case(config: dict, build: Callable[[], tuple[Callable, tuple]], *,
             warmup: int = 2, iters: int = 20, carry_outputs: int = 0,
             sample_ms: float = SAMPLE_MS) -> dict:
  """Runs one case. `build()` returns (fn, args); any failure becomes a row.

  With `carry_outputs=n`, the first n outputs of each call replace the first n
  arguments of the next one: a train step `(params, opt_state, batch) ->
  (params, opt_state, loss)` with `donate_argnums=(0, 1)` then runs as in
  training, its donated buffers never reused.

  Each of the `iters` samples dispatches enough calls back to back to last
  about `sample_ms` (at most 50) and blocks once at the end, so a call of
  tens of microseconds is timed on the device rather than as host dispatch
  plus a sync; `median_ms` is per call, `calls_per_sample` says how many.
  A sample holds at least `MIN_CALLS_PER_SAMPLE` calls unless one call takes
  over 50 ms: with a single call the host's dispatch and the final sync add to
  every sample (0.4-0.5 ms at a few ms per call on the H200, BUILD_NOTES.md),
  while back to back each dispatch overlaps the previous call, as in training.
  `sample_ms=0` times one call per sample (for programs that measure that).

  `compile_s` is the whole way from the Python function to the executable:
  tracing, lowering to StableHLO (which runs the Pallas kernels' Python
  lowering) and XLA's compile; `lower_s` is the first two.
  """
  row = dict(config)
  stage = "build"
  try:
    fn, args = build()
    stage = "compile"
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    start = time.perf_counter()
    lowered = jitted.lower(*args)
    row["lower_s"] = time.perf_counter() - start
    compiled = lowered.compile()
    row["compile_s"] = time.perf_counter() - start
    row["planned_peak_mb"] = planned_peak_mb(compiled)
    stage = "run"

    def calls(args, n):
      for _ in range(n):
        out = compiled(*args)
        if carry_outputs:
          args = (*out[:carry_outputs], *args[carry_outputs:])
      jax.block_until_ready(out)
      return args

    for _ in range(warmup):
      args = calls(args, 1)
    start = time.perf_counter()
    args = calls(args, 1)
    one_ms = (time.perf_counter() - start) * 1e3
    inner = 1
    if sample_ms > 0:
      least = MIN_CALLS_PER_SAMPLE if one_ms <= 50 else 1
      inner = max(least, min(50, math.ceil(sample_ms / max(one_ms, 1e-3))))
    times = []
    for _ in range(iters):
      start = time.perf_counter()
      args = calls(args, inner)
      times.append((time.perf_counter() - start) * 1e3 / inner)
    row.update(status="ok", median_ms=statistics.median(times), min_ms=min(times),
               iters=iters, calls_per_sample=inner)
  except Exception as exc:  # A benchmark grid records failures and moves on.
    row.update(status=_classify(exc, stage), stage=stage,
               message=f"{type(exc).__name__}: {str(exc)[:2000]}")
    if row["status"] == "error":
      row["traceback"] = traceback.format_exc()[-4000:]
  return row


def planned_peak_mb(compiled) -> float | None:
  """XLA's buffer plan for one call: arguments + outputs + temporaries - aliases.

  Unlike the device's peak counter this needs no fresh process, so every row
  of a grid gets it.
  """
  try:
    m = compiled.memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)
  except Exception:  # Not every backend reports a plan.
    return None
  return total / 1e6


def peak_memory_mb() -> float | None:
  """The default device's peak bytes in use, in MB (None where unreported)."""
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else peak / 1e6


def run_in_fresh_process(module: str, args: list[str], timeout_s: float = 600) -> dict:
  """Runs `python -m module *args` and returns the JSON its last line prints.

  Device memory peaks are only comparable when each case owns a process.
  """
  proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                        text=True, timeout=timeout_s)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode != 0 or not lines:
    return {"status": "error", "message": (proc.stderr or proc.stdout)[-2000:]}
  return json.loads(lines[-1])


def run_program(module: str, output: str, flags: list[str]) -> None:
  """Runs another benchmark program (`python -m module`) with its output
  streamed, writing its JSON to `output`; a failure is printed, not raised,
  so the calling program goes on with its next part."""
  command = [sys.executable, "-m", module, f"--output={output}", *flags]
  print("running", " ".join(command), flush=True)
  if subprocess.run(command).returncode:
    print(f"{module} failed; its rows so far are in {output}", flush=True)


def _version(module: str) -> str | None:
  try:
    return __import__(module).__version__
  except Exception:  # pylint: disable=broad-except
    return None


def _cuda_versions() -> dict:
  """The CUDA runtime's, the driver's CUDA and cuDNN versions as the CUDA
  plugin reports them (integers such as 13000 and 91000; None without one)."""
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=g-import-not-at-top
  except ImportError:
    cuda_versions = None
  found = {}
  for field, name in (("cuda", "cuda_runtime_get_version"),
                      ("cuda_driver", "cuda_driver_get_version"),
                      ("cudnn", "cudnn_get_version")):
    try:
      found[field] = getattr(cuda_versions, name)()
    except Exception:  # pylint: disable=broad-except
      found[field] = None
  return found


def _driver() -> str | None:
  """The NVIDIA driver's version, from nvidia-smi."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
  except Exception:  # pylint: disable=broad-except
    return None


def environment() -> dict:
  """Where the numbers came from: the device, the GPU's name, compute
  capability, driver, CUDA and cuDNN (None off a GPU), JAX, jaxlib, Python."""
  device = jax.devices()[0]
  gpu = device.platform == "gpu"
  return {"jax": jax.__version__, "jaxlib": _version("jaxlib"),
          "backend": jax.default_backend(), "device_kind": device.device_kind,
          "device_count": jax.device_count(), "gpu": device.device_kind if gpu else None,
          "compute_capability": getattr(device, "compute_capability", None),
          "driver": _driver() if gpu else None, **_cuda_versions(),
          "python": platform.python_version(), "host": platform.node(),
          "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_rows(rows: list[dict], path: str) -> None:
  """Writes `{"environment": ..., "rows": rows}` to `path` (dirs created)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump({"environment": environment(), "rows": rows}, f, indent=1)


def format_table(rows: list[dict], columns: list[str]) -> str:
  """A markdown table of `columns` (missing values blank, floats rounded)."""
  def cell(v):
    if isinstance(v, float):
      return f"{v:.4g}"
    return "" if v is None else str(v)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for row in rows:
    lines.append("| " + " | ".join(cell(row.get(c)) for c in columns) + " |")
  return "\n".join(lines)
