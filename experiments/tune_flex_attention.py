"""Sweeps the flex-attention kernels' tiles, warps and stages; prints the best.

Each of the three kernels (forward, dK/dV, dQ) is timed on its own, so the
sweep is additive rather than a product. The winners are printed as
`FlexConfig` entries of `ops/flex_attention/tuned.json` (one per point, keyed
by GPU generation, padded head size and dtype, the kernels not swept as tuned
before); they go there by hand, one per key, above the defaults.

  python3 -m experiments.tune_flex_attention --head_sizes 32,64,128 \
      --output /tmp/tune_flex.json
  python3 -m experiments.tune_flex_attention --head_sizes 32 --causal 0 \
      --kernels fwd --seq_len 1024 --output /tmp/tune_flex_t1024.json
  python3 -m experiments.tune_flex_attention --grid --grid_subset quick --small \
      --output /tmp/tune_flex_grid.json

By default each head size is swept at its headline shape
(`benchmark_kernel_attention`'s); `--grid` sweeps at the attention points of
`shape_grid` instead (their masks, GQA and cross-attention lengths; dtype as
the point says), `--head_sizes`, when given, keeping the points of those head
sizes. The best tiles are reported per point and kernel, beside the time of
the table's own tiles there (`table_ms`).
"""

import dataclasses
import itertools
import json
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments import harness
from experiments import shape_grid
from ops.flex_attention import configs
from ops.flex_attention import pallas
from ops.flex_attention import triton_backward

_HEAD_SIZES = flags.DEFINE_list("head_sizes", ["32", "64", "128"], "Head sizes.")
_CAUSAL = flags.DEFINE_list("causal", ["0", "1"], "Causal values (0/1).")
_OUTPUT = flags.DEFINE_string("output", "/tmp/tune_flex_attention.json", "JSON path.")
_BUDGET_S = flags.DEFINE_float("budget_s", 1e9, "Stop starting new cases after this.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls per case.")
_SMALL = flags.DEFINE_bool("small", False, "A short sweep (fewer candidates).")
_KERNELS = flags.DEFINE_list("kernels", ["fwd", "dkdv", "dq"],
                             "Kernels to sweep (fwd = the Triton forward).")
_SEQ_LEN = flags.DEFINE_integer(
    "seq_len", None, "T instead of the head size's shape's (B and N kept), e.g. 1024 "
    "for the short head-size-32 headline shape, where the T 4096 winners meet "
    "fewer programs than two full waves.")
_INTERPRET = flags.DEFINE_bool(
    "interpret", False, "Run the kernels in Pallas interpret mode: the sweep on a CPU "
    "(a test of its plumbing; the times mean nothing).")
_GRID = shape_grid.define_flags()

KERNELS = ("fwd", "dkdv", "dq")
# Head size -> (B, N, T): the headline shapes of benchmark_kernel_attention.
_SHAPES = {32: (8, 8, 4096), 64: (4, 16, 4096), 128: (2, 16, 8192), 256: (2, 16, 4096)}


def padded_head_dim(head_dim: int) -> int:
  """The head size the kernels run at (a power of two >= 16), which keys the table."""
  return max(16, 1 << (head_dim - 1).bit_length())


def _candidates(kernel: str, head_dim: int, small: bool):
  """(block_q, block_k, num_warps, num_stages) candidates for one kernel at
  a padded head size."""
  if kernel == "fwd":
    bqs, bks = (128, 64), (32, 64, 128)
  elif kernel == "dkdv":  # block_k is the program's key tile, block_q the loop tile.
    bqs, bks = (32, 64, 128), (64, 128)
  else:
    bqs, bks = (64, 128), (32, 64, 128)
  warps = (4, 8)
  stages = (2, 3) if head_dim <= 64 else (1, 2, 3)
  out = []
  for bq, bk, w, s in itertools.product(bqs, bks, warps, stages):
    if head_dim >= 128 and bq * bk > 128 * 64:
      continue  # Register budget: skip the largest tiles at big heads.
    if small and (w == 8 and head_dim < 64 or s == 1):
      continue
    out.append((bq, bk, w, s))
  return out


def headline_points() -> list[shape_grid.AttentionPoint]:
  """Each --head_sizes' headline shape (T from --seq_len if given) for each
  --causal value, as grid points."""
  points = []
  for head_dim in map(int, _HEAD_SIZES.value):
    if head_dim not in _SHAPES:
      raise app.UsageError(f"--head_sizes: no headline shape for {head_dim}; known: "
                           f"{sorted(_SHAPES)} (--grid sweeps the grid's head sizes)")
    b, n, t = _SHAPES[head_dim]
    t = _SEQ_LEN.value or t
    for causal in _CAUSAL.value:
      points.append(shape_grid.AttentionPoint(
          head_dim, t, "causal" if causal == "1" else "full", tokens=b * t, heads=n))
  return points


def grid_points() -> list[shape_grid.AttentionPoint]:
  """The --grid points, those of --head_sizes only when it is given."""
  points = _GRID.points("attention")
  if flags.FLAGS["head_sizes"].present:
    keep = set(map(int, _HEAD_SIZES.value))
    points = [p for p in points if p.head_dim in keep]
  return list(points)


def _time(kernel: str, point: shape_grid.AttentionPoint, cand, base: configs.FlexConfig,
          table: bool = False) -> dict:
  """One kernel of flex's Triton path at `point` on tiles `cand` (the other
  two kernels keep `base`'s)."""
  size = point.shape
  cfg = configs.TritonConfig(*cand)
  flex_cfg = configs.FlexConfig(**{**{k: getattr(base, k) for k in KERNELS}, kernel: cfg})
  dtype = jnp.dtype(point.dtype)

  def build():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (size["B"], size["T"], size["N"], size["H"]), dtype)
    k, v = (jax.random.normal(key, (size["B"], size["S"], size["K"], size["H"]), dtype)
            for key in keys[1:3])
    st, args = pallas.prepare(q, k, v, scale=point.head_dim ** -0.5,
                              is_causal=point.is_causal, window=point.window,
                              q_segment_ids=None, kv_segment_ids=None,
                              key_value_seq_lengths=None, interpret=_INTERPRET.value,
                              config=flex_cfg)
    if kernel == "fwd":
      return jax.jit(lambda *a: pallas._forward(st, *a)), args
    out, lse = jax.jit(lambda *a: pallas._forward(st, *a))(*args)
    do = jax.random.normal(keys[3], out.shape, dtype)  # padded like q
    delta = triton_backward.compute_delta(out, do)
    call = triton_backward.dkdv_call if kernel == "dkdv" else triton_backward.dq_call
    return jax.jit(lambda *a: call(st, *a)), (*args[:6], lse, delta, do)
  config = dict(kernel=kernel, point=point.name, variant=point.variant, dtype=point.dtype,
                causal=point.is_causal, **size, block_q=cand[0], block_k=cand[1],
                num_warps=cand[2], num_stages=cand[3], table=table)
  return harness.run_case(config, build, warmup=1, iters=_ITERS.value)


def tuned_entries(points, best) -> list[dict]:
  """tuned.json entries: each point's tuned config with its winning Triton
  launches (`best`: (point name, kernel) -> row)."""
  entries = []
  for point in points:
    rows = {k: best[(point.name, k)] for k in KERNELS if (point.name, k) in best}
    if not rows:
      continue
    hp = padded_head_dim(point.head_dim)
    base = configs.get_config(hp, jnp.dtype(point.dtype), interpret=False)
    winners = {k: configs.TritonConfig(r["block_q"], r["block_k"], r["num_warps"],
                                       r["num_stages"]) for k, r in rows.items()}
    entries.append(dict(
        generation=configs.gpu_generation(), head_dim=hp, dtype=configs.dtype_key(point.dtype),
        source=f"tune_flex_attention at {point.name}: {', '.join(rows)} swept",
        fields=dataclasses.asdict(dataclasses.replace(base, **winners))))
  return entries


def main(argv):
  del argv
  unknown = set(_KERNELS.value) - set(KERNELS)
  if unknown:
    raise app.UsageError(f"--kernels: unknown {sorted(unknown)}; known: {list(KERNELS)}")
  points = grid_points() if _GRID.grid.value else headline_points()
  start = time.time()
  rows, best, table_ms = [], {}, {}
  for point in points:
    hp = padded_head_dim(point.head_dim)
    base = configs.get_config(hp, jnp.dtype(point.dtype), interpret=False)
    for kernel in _KERNELS.value:
      own = getattr(base, kernel)
      own = (own.block_q, own.block_k, own.num_warps, own.num_stages)
      cands = _candidates(kernel, hp, _SMALL.value)
      for cand in [own] + [c for c in cands if c != own]:
        if time.time() - start > _BUDGET_S.value:
          break
        row = _time(kernel, point, cand, base, table=cand == own)
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("kernel", "point", "block_q", "block_k",
                                                   "num_warps", "num_stages", "table",
                                                   "status", "median_ms")}), flush=True)
        key = (point.name, kernel)
        if row.get("status") != "ok":
          continue
        if cand == own:
          table_ms[key] = row["median_ms"]
        if key not in best or row["median_ms"] < best[key]["median_ms"]:
          best[key] = row
  harness.write_rows(rows, _OUTPUT.value)
  summary = [dict(point=p, H=r["H"], causal=r["causal"], kernel=k, block_q=r["block_q"],
                  block_k=r["block_k"], num_warps=r["num_warps"], num_stages=r["num_stages"],
                  ms=r["median_ms"], table_ms=table_ms.get((p, k)))
             for (p, k), r in best.items()]
  print(harness.format_table(summary, ["point", "H", "causal", "kernel", "block_q", "block_k",
                                       "num_warps", "num_stages", "ms", "table_ms"]))
  print("tuned.json FlexConfig entries:")
  print(json.dumps(tuned_entries(points, best), indent=1))


if __name__ == "__main__":
  app.run(main)
