"""The shape grid's records and the targets they are judged by: at every point,
the default path (`implementation=None`) against the best peer timed there in the
same run (suites `attention_grid`, `moe_grid`, `chunked_grid` and `scan_grid`)."""

import dataclasses
from typing import Callable, Iterable

from experiments.figures.common import (Record, Suite, compare, mode_key, ratio_text,
                                        suite_or_empty)

# The targets the grid is judged by: the default's time over the peer's.
ATTENTION_SHARE = 0.8    # attention: at or below the best peer at this share of points,
ATTENTION_LIMIT = 1.10   # and never above this ratio

_PEERS = ("cudnn", "tokamax_mosaic", "tokamax_triton")


def _with_default(rows: Iterable[dict], choice: dict[tuple, str], key: Callable[[dict], tuple],
                  label: Callable[[dict], tuple[str, ...]]) -> list[dict]:
  """Rows with a `_label` each (a row under several labels is repeated): the labels
  `label` gives, and 'default' for the row of what the default ran. A row timing
  the default itself (impl 'default') is that row; otherwise it is the row of the
  implementation the run's summary says the default picks (`choice[key(row)]`)."""
  rows = list(rows)
  timed_itself = {key(r) for r in rows if r.get("impl") == "default"}
  out = []
  for r in rows:
    names = set(label(r))
    if r.get("impl") == "default" or (key(r) not in timed_itself
                                      and _impl_of(r) == choice.get(key(r))):
      names.add("default")
    out += [dict(r, _label=name) for name in sorted(names)]
  return out


def _impl_of(row: dict) -> str | None:
  if "impl" in row:
    return row["impl"]
  # benchmark_kernel_ssd: `implementation`, and the default chunk where `chunk_size` is None.
  if row.get("implementation") == "pallas" and row.get("chunk_size") is not None:
    return None
  return row.get("implementation")


def _labelled(row: dict) -> str:
  return row["_label"]


def attention_grid_records(suite: Suite) -> list[Record]:
  """Per (point, mode): 'default', 'peer' (the fastest of cuDNN and tokamax) and
  each implementation timed, from one run."""
  summaries = [r for r in suite.rows if r.get("grid") == "attention"
               and r.get("kind") == "summary"]
  key = lambda r: (r["source"], r.get("point"), r.get("mode"))
  choice = {key(r): r.get("default_impl") for r in summaries}
  rows = [r for r in suite.rows if r.get("grid") == "attention" and r.get("kind") == "time"]
  labelled = _with_default(rows, choice, key, lambda r: (r.get("impl"),) + (
      ("peer",) if r.get("impl") in _PEERS else ()))
  records = compare(labelled, config=("point", "variant", "dtype", "causal", "window", "H",
                                      "B", "T", "S", "N", "K", "mode"),
                    label=_labelled, ours="default")
  for r in records:  # What the default ran: the summary's choice, or the row's own impl.
    impl = r.cells["default"].get("impl")
    r.config["default_impl"] = (choice.get((r.source, r.config["point"], r.config["mode"]))
                                if impl == "default" else impl)
  variants = {v: i for i, v in enumerate(("full", "causal", "sliding_window", "gqa", "cross"))}
  records.sort(key=lambda r: (r.config["dtype"] != "bfloat16", mode_key(r.config["mode"]),
                              variants.get(r.config["variant"], 9), r.config["H"],
                              r.config["S"]))
  return records


def judge(record: Record, ours: str, peer: str) -> float | str | None:
  """`ours`'s time over `peer`'s at one point; the default's status where it did
  not run and the peer did; None where there is nothing to compare (no peer ran)."""
  if record.ms(peer) is None:
    return None
  row = record.cells.get(ours)
  if row is not None and row.get("status", "ok") != "ok":
    return row["status"]
  return record.ratio(ours, peer)


@dataclasses.dataclass(frozen=True)
class TargetCount:
  """How the default fares against a target over the points where it was judged."""
  points: int               # points judged (a peer ran there)
  at_or_below: int          # the default's time <= the peer's
  above_limit: int          # above the limit, or the default did not run
  failed: int               # the default did not run where the peer did
  worst: float | None       # the largest ratio
  held: bool                # at_or_below >= share * points and above_limit == 0
  not_judged: int           # points where no peer ran


def count_target(outcomes: Iterable[float | str | None], *, share: float,
                 limit: float) -> TargetCount:
  """Counts `judge`'s outcomes against "<= 1 at `share` of the points, never above `limit`".

  Args:
    outcomes: per point, a ratio (the default's time over the peer's), the
      default's status where it did not run, or None where nothing was compared.
    share: the fraction of judged points at which the ratio must be <= 1.
    limit: the ratio no point may exceed (1: at or below the peer everywhere).

  Returns:
    The counts; `held` is False when no point was judged.
  """
  outcomes = list(outcomes)
  ratios = [v for v in outcomes if v is not None and not isinstance(v, str)]
  failed = sum(isinstance(v, str) for v in outcomes)
  points = len(ratios) + failed
  at_or_below = sum(v <= 1.0 for v in ratios)
  above = failed + sum(v > limit for v in ratios)
  return TargetCount(points=points, at_or_below=at_or_below, above_limit=above, failed=failed,
                     worst=max(ratios, default=None),
                     held=points > 0 and at_or_below >= share * points - 1e-9 and above == 0,
                     not_judged=sum(v is None for v in outcomes))


@dataclasses.dataclass(frozen=True)
class GridTarget:
  """One row of the targets table: an op's comparison in one mode, and its counts."""
  op: str
  peer: str
  mode: str
  target: str
  count: TargetCount


def by_mode(records: list[Record], ours: str, peer: str) -> dict[str, list]:
  """`judge`'s outcomes of `records` per mode, in mode order."""
  out = {}
  for r in records:
    out.setdefault(r.config["mode"], []).append(judge(r, ours, peer))
  return dict(sorted(out.items(), key=lambda item: mode_key(item[0])))


def moe_grid_records(suite: Suite) -> tuple[list[Record], list[Record]]:
  """The grouped matmul's records (ours 'pallas') and the MoE layer's ('auto')."""
  op = compare(suite.rows, config=("point", "experts", "top_k", "d_model", "d_hidden", "rows",
                                   "mode"),
               label=lambda r: (r.get("impl") if r.get("section") == "op"
                                and r.get("point") is not None else None), ours="pallas")
  layer = compare(suite.rows, config=("point", "experts", "top_k", "d_model", "d_hidden",
                                      "tokens", "mode"),
                  label=lambda r: (r.get("impl") if r.get("section") == "moe"
                                   and r.get("point") is not None else None), ours="auto")
  order = lambda r: (mode_key(r.config["mode"]), r.config["experts"], r.config["top_k"],
                     r.config["d_model"], r.config["d_hidden"])
  return sorted(op, key=order), sorted(layer, key=order)


def chunked_grid_records(suite: Suite) -> list[Record]:
  """Per (op, point, mode): 'default' (what the summary says the default ran),
  'pallas' (the default chunk) and 'xla', from one run."""
  key = lambda r: (r["source"], r.get("op"), r.get("point"), r.get("mode"))
  choice = {key(r): r.get("default_impl") for r in suite.rows if r.get("kind") == "summary"
            and r.get("point") is not None}
  rows = [r for r in suite.rows if r.get("kind") == "op" and r.get("point") is not None]
  labelled = _with_default(rows, choice, key,
                           lambda r: tuple(n for n in (_impl_of(r),) if n in ("pallas", "xla")))
  records = compare(labelled, config=("op", "point", "B", "T", "N", "K", "V", "dtype", "mode"),
                    label=_labelled, ours="default")
  for r in records:
    r.config["default_impl"] = _impl_of(r.cells["default"])
  records.sort(key=lambda r: (r.config["op"], mode_key(r.config["mode"]), r.config["K"],
                              r.config["T"]))
  return records


def scan_grid_records(suite: Suite) -> list[Record]:
  records = compare(suite.rows, config=("op", "point", "shape", "mode"),
                    label=lambda r: (r.get("impl") if r.get("kind") == "time"
                                     and r.get("point") is not None
                                     and r.get("default_blocks", True) else None),
                    ours="pallas")
  records.sort(key=lambda r: (r.config["op"], mode_key(r.config["mode"]), r.config["shape"]))
  return records


def _per_op(records: list[Record]) -> dict[str, list[Record]]:
  out = {}
  for r in records:
    out.setdefault(r.config["op"], []).append(r)
  return out


def grid_targets(suites: dict[str, Suite]) -> list[GridTarget]:
  """The targets over the grid suites' rows, per op and mode: attention against the
  fastest of cuDNN and tokamax; the grouped matmul against tokamax.ragged_dot; the
  chunked ops and the selective scan against their XLA tier. An absent suite has none."""
  out = []
  attention = attention_grid_records(suite_or_empty(suites, "attention_grid"))
  share = f"{ATTENTION_SHARE:.0%}".replace("%", " %")
  for mode, outcomes in by_mode(attention, "default", "peer").items():
    out.append(GridTarget(
        "attention", "fastest of cuDNN and tokamax", mode,
        f"<= 1 at >= {share} of points, never > {ratio_text(ATTENTION_LIMIT)}",
        count_target(outcomes, share=ATTENTION_SHARE, limit=ATTENTION_LIMIT)))
  everywhere = dict(share=1.0, limit=1.0)
  comparisons = [
      ("`ops.grouped_matmul`", "`tokamax.ragged_dot`", "pallas", "tokamax_ragged_dot",
       moe_grid_records(suite_or_empty(suites, "moe_grid"))[0]),
      (None, "its chunked XLA form", "default", "xla",
       chunked_grid_records(suite_or_empty(suites, "chunked_grid"))),
      (None, "`lax.associative_scan`", "pallas", "xla",
       scan_grid_records(suite_or_empty(suites, "scan_grid"))),
  ]
  for name, peer_name, ours, peer, records in comparisons:
    groups = {name: records} if name else {f"`ops.{op}`": of_op
                                           for op, of_op in _per_op(records).items()}
    for op, of_op in groups.items():
      for mode, outcomes in by_mode(of_op, ours, peer).items():
        out.append(GridTarget(op, peer_name, mode, "<= 1 at every point",
                              count_target(outcomes, **everywhere)))
  return out
