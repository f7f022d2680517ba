"""Measured dispatch tables: which implementation was fastest where it was timed.

An op whose default (`implementation=None`) chooses between implementations
that all take the inputs decides by measurement, not by thresholds in code:
`ops/dispatch_tables/<table>.json` holds the fwd+bwd time of each
implementation at the points it was timed on an NVIDIA GPU, and `fastest`
reads off the winner for a call. `experiments/dispatch_tables.py` writes the
tables from the committed benchmark JSON (the shape grid's where it was run,
else the headline shapes); BUILD_NOTES.md, "Dispatch tables", says how.

A table (JSON):

  {"table": "attention", "device": "NVIDIA H200", "jax": "0.11.2",
   "mode": "fwd+bwd", "sources": [...],
   "keys": ["dtype", "variant"],      # matched exactly, the last dropped first
   "axes": ["head_dim", "length"],    # sizes, compared on a log2 scale
   "points": [{"dtype": "bfloat16", "variant": "causal", "head_dim": 64,
               "length": 4096, "ms": {"flex": 1.23, "cudnn": 1.40}}, ...]}

A call is judged by the smallest measured point that covers it: on each axis
the smallest measured size at least the call's (the largest measured where
none is), among the points whose keys match the call's. Sizes past a measured
point cost at least as much per element, so a kernel's lead at the covering
point is the one that carries over (a head size of 80 runs like 128 in a
kernel that pads to 128); where the grid lacks that exact point, the nearest
matching point on the log2 scale stands in.
"""

import functools
import importlib.resources
import json
import math
from typing import Mapping, Sequence

_DIRECTORY = "dispatch_tables"


@functools.cache
def load(table: str) -> dict | None:
  """The table named `table`, or None when none was measured."""
  path = importlib.resources.files("ops").joinpath(_DIRECTORY, f"{table}.json")
  if not path.is_file():
    return None
  return json.loads(path.read_text())


def _covering(points: list[dict], axes: Sequence[str], call: Mapping) -> dict:
  """The point covering `call` (module docstring), else the nearest one."""
  target = {}
  for axis in axes:
    sizes = sorted({p[axis] for p in points})
    target[axis] = next((s for s in sizes if s >= call[axis]), sizes[-1])
  distance = lambda p: sum(abs(math.log2(p[a] / target[a])) for a in axes)
  return min(points, key=distance)  # distance 0: the covering point itself


def fastest(table: str, candidates: Sequence[str], **call) -> str | None:
  """The fastest of `candidates` at the measured point that judges `call`.

  Args:
    table: the table's name ('attention', 'moe', 'ssd', ...).
    candidates: the implementations that take the call's inputs.
    **call: the call's value for every key and axis of the table.

  Returns:
    The candidate with the least time at that point, or None when the table
    is absent, no point shares the call's first key, or no candidate was
    timed there (the caller's fixed preference decides then).
  """
  measured = load(table)
  if measured is None or not candidates:
    return None
  keys, axes = measured["keys"], measured["axes"]
  for used in range(len(keys), min(1, len(keys)) - 1, -1):  # drop the last key first
    points = [p for p in measured["points"] if all(p[k] == call[k] for k in keys[:used])]
    if points:
      break
  else:
    return None
  times = _covering(points, axes, call)["ms"]
  timed = [c for c in candidates if c in times]
  return min(timed, key=times.get) if timed else None
