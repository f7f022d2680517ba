"""Device kernel times from a `jax.profiler` trace (no flags: any program may
import it).

`traced(thunk)` runs a Python callable under the profiler and returns its
result with the device events; `kernel_rows` groups them by kernel name;
`profile(fn, args)` does both for a compiled call (per-kernel time per call). On a
GPU the events are the kernels and copies on the device's streams; on the CPU
the XLA ops the runtime reports stand in for kernels.
"""

import collections
import glob
import os
import tempfile
import time
from typing import Any, Callable

import jax


def _has_hlo_op(event) -> bool:
  return any(key == "hlo_op" for key, _ in event.stats)


def device_events(xspace_path: str) -> list[tuple[str, int, int]]:
  """(kernel name, start ns, duration ns) of every device event in a trace.

  GPU: the events on the device planes' stream lines (one per kernel or
  copy). CPU: the host events that carry an `hlo_op` stat (the XLA ops).
  """
  data = jax.profiler.ProfileData.from_file(xspace_path)
  events = []
  for plane in data.planes:
    if plane.name.startswith("/device:GPU"):
      for line in plane.lines:
        if line.name.startswith("Stream"):
          events += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
  if events:
    return events
  for plane in data.planes:
    for line in plane.lines:
      events += [(e.name, e.start_ns, e.duration_ns) for e in line.events
                 if _has_hlo_op(e)]
  return events


def busy_ns(events) -> float:
  """Length of the union of the events' intervals."""
  total, end = 0.0, float("-inf")
  for _, start, duration in sorted(events, key=lambda e: e[1]):
    stop = start + duration
    if stop > end:
      total += stop - max(start, end)
      end = stop
  return total


def traced(thunk: Callable[[], Any]) -> tuple[Any, list[tuple[str, int, int]]]:
  """Runs `thunk()` under the profiler: (its result, its device events).
  The thunk must block on its own results."""
  with tempfile.TemporaryDirectory() as directory:
    with jax.profiler.trace(directory):
      result = thunk()
    paths = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
    return result, (device_events(paths[0]) if paths else [])


def kernel_rows(events, per: float = 1.0) -> list[dict]:
  """Events grouped by name, largest total first: {"name", "us", "launches",
  "share"}, times and counts divided by `per` (calls, steps)."""
  per_kernel = collections.defaultdict(lambda: [0.0, 0])
  for name, _, duration in events:
    per_kernel[name][0] += duration
    per_kernel[name][1] += 1
  total = sum(v[0] for v in per_kernel.values()) or 1.0
  return [{"name": name, "us": ns / 1e3 / per, "launches": count / per,
           "share": ns / total}
          for name, (ns, count) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])]


def short_name(name: str, width: int = 70) -> str:
  return name if len(name) <= width else name[:width - 3] + "..."


def profile(fn: Callable, args: tuple, *, calls: int = 20,
            hlo_path: str | None = None) -> dict:
  """Per-kernel device time of `fn(*args)`, per call.

  Returns {"wall_us", "busy_us", "idle_share", "kernels": [{"name", "us",
  "launches", "share"}]} with kernels sorted by time, largest first. With
  `hlo_path`, the optimized HLO (whose fusion names are the kernel names) is
  written there.
  """
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  compiled = jitted.lower(*args).compile()
  if hlo_path:
    with open(hlo_path, "w") as f:
      f.write(compiled.as_text())

  def run():
    for _ in range(calls):
      out = compiled(*args)
    return jax.block_until_ready(out)
  for _ in range(2):  # warm-up
    jax.block_until_ready(compiled(*args))
  start = time.perf_counter()
  run()  # timed without the profiler
  wall_us = (time.perf_counter() - start) * 1e6 / calls
  _, events = traced(run)
  kernels = kernel_rows(events, per=calls)
  busy = busy_ns(events) / 1e3 / calls
  return {"wall_us": wall_us, "busy_us": busy,
          "idle_share": max(0.0, 1.0 - busy / wall_us) if wall_us else None,
          "launches": sum(k["launches"] for k in kernels), "kernels": kernels}
