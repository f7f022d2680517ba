"""The setup page: the machines and runs behind every number, how the harness
times a case, and which suite feeds which page."""

import inspect
from typing import Callable

from experiments import harness
from experiments.figures.common import Suite, run_label, table

NOT_RECORDED = "not recorded"


def _range(values: list) -> str:
  values = sorted(set(values))
  if not values:
    return ""
  return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def cuda_version_text(version) -> str:
  """A CUDA version as the CUDA runtime reports it (13000) -> '13.0'."""
  if not isinstance(version, int):
    return str(version)
  return f"{version // 1000}.{version % 1000 // 10}"


def cudnn_version_text(version) -> str:
  """A cuDNN version as cudnnGetVersion reports it -> 'major.minor.patch'
  (9.x: major * 10000 + minor * 100 + patch; 8.x: major * 1000 + ...)."""
  if not isinstance(version, int):
    return str(version)
  major = 10000 if version >= 90000 else 1000
  return f"{version // major}.{version % major // 100}.{version % 100}"


def environment_cell(env: dict, field: str, text: Callable = str) -> str:
  """`env[field]` as text: 'not recorded' for a run that predates the field,
  'none' where the machine had none (no GPU)."""
  if field not in env:
    return NOT_RECORDED
  return "none" if env[field] is None else text(env[field])


def setup_page(manifest: dict, suites: dict[str, Suite]) -> str:
  warmup = inspect.signature(harness.run_case).parameters["warmup"].default
  out = ["# Setup", "",
         "Where and how the numbers on these pages were measured, from what the benchmark "
         "JSON records and how `experiments/harness.py` times.", "", "## Machines", "",
         "Every run records its device, JAX and Python versions and when it was written, "
         "and, since `harness.environment` records them, the NVIDIA driver's version, the "
         f"CUDA runtime's, cuDNN's and jaxlib's: \"{NOT_RECORDED}\" marks a run from before "
         "then (the headlines compare against cuDNN, whose version is then unknown).", ""]
  machines, runs = [], []
  for name, suite in suites.items():
    for source in suite.sources:
      env = suite.environment(source)
      rows = [r for r in suite.rows if r["source"] == source]
      iters = [r["iters"] for r in rows if isinstance(r.get("iters"), int)]
      calls = [r["calls_per_sample"] for r in rows if isinstance(r.get("calls_per_sample"), int)]
      commit = suite.sources[source].get("commit", "")
      machines.append([f"`{suite.file}`", run_label(source), str(env.get("device_kind", "")),
                       str(env.get("device_count", "")), environment_cell(env, "driver"),
                       environment_cell(env, "cuda", cuda_version_text),
                       environment_cell(env, "cudnn", cudnn_version_text),
                       str(env.get("jax", "")), environment_cell(env, "jaxlib"),
                       str(env.get("python", ""))])
      runs.append([f"`{suite.file}`", run_label(source), str(len(rows)), _range(iters),
                   _range(calls), commit[:7]])
  out += [table(["file", "run", "device", "devices", "driver", "CUDA", "cuDNN", "JAX",
                 "jaxlib", "Python"], machines), "", "## Runs", "",
          table(["file", "run", "rows", "samples", "calls per sample", "commit"], runs), "",
          "`samples` is how many samples each row's median is taken over and `calls per "
          "sample` how many calls a sample held (below); a blank means the run recorded "
          "none and timed one call per sample, host dispatch and sync included. The "
          "sample's length is the harness's at the time of the run and is not recorded. "
          "`commit` is the last commit of the run's original file; the `blob` beside it in "
          "the JSON reads that file back with `git cat-file -p`.", ""]
  out += ["## How a case is timed", "",
          f"`harness.run_case` builds a case, compiles it with `jax.jit(...).lower(...)"
          ".compile()` (`compile_s`: tracing, lowering, which runs the Pallas kernels' "
          "Python lowering, and XLA's compile; `lower_s`: the first two) and records XLA's "
          "buffer plan (`planned_peak_mb`: arguments + outputs + temporaries - aliased "
          f"buffers). It then runs {warmup} warm-up calls and one call to size the samples, "
          "and times `iters` samples (the `samples` column above). Each sample dispatches "
          f"calls back to back for about {harness.SAMPLE_MS:g} ms (at least "
          f"{harness.MIN_CALLS_PER_SAMPLE}, at most 50; one when a call takes over 50 ms) and "
          "blocks once with `jax.block_until_ready`, so a call of tens of microseconds is "
          "timed on the device rather than as host dispatch plus a sync. `median_ms` is the "
          "median over samples of the time per call, `min_ms` the fastest sample.", "",
          "- Train steps donate their parameter and optimizer buffers and feed each call's "
          "outputs to the next, as in training.",
          "- Peers (cuDNN, XLA, JAX's Pallas `mha`, `lax.associative_scan`, "
          "`jax.lax.ragged_dot`, a dense matmul) run in the same process as this library's "
          "kernels, on the same inputs; every ratio on these pages is between rows of one "
          "run. Runs on different machines of the same kind differ by a few percent, so "
          "compare ratios, not times, across runs.",
          "- Attention calls of up to `CHAINED_MAX_SCORES` scores run several calls in one "
          "executable (the rows' `chain`), each on the previous call's inputs through an "
          "optimization barrier; the time is per call.",
          "- `peak_mb` is the device's `peak_bytes_in_use` in a fresh process per case "
          "(scan x remat, UNet), so that each peak is its own.",
          "- The training-loop suite times whole loops of `fit()` and of a bare jitted "
          "loop, interleaved in rounds, and reports the median of the per-round ratios.", ""]
  out += ["## Suites", "", "Which file feeds which page, and the program that writes it:", ""]
  body = [[name, f"`{entry['file']}`", ", ".join(f"[{p}]({p}.md)" for p in entry["pages"]),
           f"`{entry['command']}`"] for name, entry in manifest["suites"].items()]
  out += [table(["suite", "file", "pages", "command"], body), ""]
  return "\n".join(out)
