"""Measured dispatch tables: what was checked and fastest where it was timed.

A default (`implementation=None`) that chooses between implementations decides
by measurement, not by thresholds in code: `ops/dispatch_tables/<table>.json`
holds, per device kind and JAX minor release, the time of each implementation
at the points it was timed and which of this library's kernels passed
`experiments/gpu_check` there; `fastest` reads off the winner for a call.
A kernel is a candidate only on a device kind whose data holds a passing
check for it and a measurement with a JAX of this process's minor release;
elsewhere `fastest` leaves it out, and the caller's established path (cuDNN
where it takes the call, else XLA) runs. `experiments/dispatch_tables.py`
writes the tables from the committed benchmark JSON (BUILD_NOTES.md,
"Dispatch tables").

A table (JSON):

  {"table": "attention", "mode": "fwd+bwd",
   "keys": ["dtype", "variant"],      # matched exactly, the last dropped first
   "axes": ["head_dim", "length"],    # sizes, compared on a log2 scale
   "kernels": ["flex"],               # implementations that need a passing check
   "devices": [{"device": "NVIDIA H200", "jax": "0.11.2", "sources": [...],
                "checked": {"flex": "2026-12-07T10:00:00"},  # when it last passed
                "points": [{"dtype": "bfloat16", "variant": "causal",
                            "head_dim": 64, "length": 4096,
                            "ms": {"flex": 1.23, "cudnn": 1.40}}, ...]}]}

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

from absl import logging
import jax

_DIRECTORY = "dispatch_tables"
# What measures a GPU for the defaults (BUILD_NOTES.md, "Dispatch tables").
COMMANDS = "python -m experiments.gpu_check, then python -m experiments.dispatch_tables"


@functools.cache
def load(table: str) -> dict | None:
  """The table named `table`, or None when none was measured."""
  path = importlib.resources.files("ops").joinpath(_DIRECTORY, f"{table}.json")
  if not path.is_file():
    return None
  return json.loads(path.read_text())


def minor(version: str) -> str:
  """'0.11.2' -> '0.11'."""
  return ".".join(str(version).split(".")[:2])


@functools.cache
def platform() -> tuple[str, str]:
  """(device kind, JAX minor release) of this process: what a table's data
  must have been measured on to count."""
  return jax.devices()[0].device_kind, minor(jax.__version__)


def section(measured: dict, kind: str, jax_minor: str) -> dict | None:
  """`measured`'s data of device kind `kind` measured with a JAX of release
  `jax_minor`, or None."""
  for data in measured.get("devices", ()):
    if data["device"] == kind and jax_minor in {minor(v) for v in data["jax"].split(", ")}:
      return data
  return None


@functools.cache
def _say_once(kind: str, jax_minor: str, reason: str) -> None:
  logging.warning(
      "probjax_hk: %s for %s with JAX %s, so the defaults run cuDNN where it takes the call "
      "and XLA otherwise, not this library's kernels. To measure this GPU: %s.",
      reason, kind, jax_minor, COMMANDS)


def _covering(points: list[dict], axes: Sequence[str], call: Mapping) -> dict:
  """The point covering `call` (module docstring), else the nearest one."""
  target = {}
  for axis in axes:
    sizes = sorted({p[axis] for p in points})
    target[axis] = next((s for s in sizes if s >= call[axis]), sizes[-1])
  distance = lambda p: sum(abs(math.log2(p[a] / target[a])) for a in axes)
  return min(points, key=distance)  # distance 0: the covering point itself


def fastest(table: str, candidates: Sequence[str], **call) -> str | None:
  """The fastest of `candidates` at the measured point that judges `call`,
  on this device kind and JAX minor release (`platform`).

  A kernel of the table (`kernels`) is left out unless it passed its check
  on this device kind. Where the device kind has no data, or a kernel among
  `candidates` no passing check, this logs once what runs instead and the
  commands that would measure it.

  Args:
    table: the table's name ('attention', 'moe', 'ssd', ...).
    candidates: the implementations that take the call's inputs.
    **call: the call's value for every key and axis of the table.

  Returns:
    The candidate with the least time at that point, or None when the table
    is absent, holds no data of this device kind and JAX release, no point
    shares the call's first key, or no eligible candidate was timed there
    (the caller's established path decides then).
  """
  measured = load(table)
  if measured is None or not candidates:
    return None
  kind, jax_minor = platform()
  data = section(measured, kind, jax_minor)
  if data is None:
    _say_once(kind, jax_minor, "no dispatch measurements")
    return None
  unchecked = set(measured.get("kernels", ())) - set(data.get("checked", {}))
  if unchecked & set(candidates):
    _say_once(kind, jax_minor, "no passing gpu_check of this library's kernels")
  candidates = [c for c in candidates if c not in unchecked]
  keys, axes = measured["keys"], measured["axes"]
  for used in range(len(keys), min(1, len(keys)) - 1, -1):  # drop the last key first
    points = [p for p in data["points"] if all(p[k] == call[k] for k in keys[:used])]
    if points:
      break
  else:
    return None
  times = _covering(points, axes, call)["ms"]
  timed = [c for c in candidates if c in times]
  return min(timed, key=times.get) if timed else None
