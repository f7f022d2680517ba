"""Device kernel times from a `jax.profiler` trace (no flags: any program may
import it).

`traced(thunk)` runs a Python callable under the profiler and returns its
result with the device events; `kernel_rows` groups them by kernel name. On a
GPU the events are the kernels and copies on the device's streams; on the CPU
the XLA ops the runtime reports stand in for kernels.
"""

import collections
import glob
import os
import tempfile
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
