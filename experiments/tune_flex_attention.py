"""Sweeps the flex-attention kernels' tiles, warps and stages; prints the best.

Each of the three kernels (forward, dK/dV, dQ) is timed on its own, so the
sweep is additive rather than a product. The winners go, by hand, into
`ops/flex_attention/configs.py` (keyed by head size, dtype, GPU generation).

  python3 -m experiments.tune_flex_attention --head_sizes 32,64,128 \
      --output /tmp/tune_flex.json
  python3 -m experiments.tune_flex_attention --head_sizes 32 --causal 0 \
      --kernels fwd --seq_len 1024 --output /tmp/tune_flex_t1024.json
"""

import itertools
import json
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments import harness
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

# Head size -> (B, N, T): the headline shapes of benchmark_kernel_attention.
_SHAPES = {32: (8, 8, 4096), 64: (4, 16, 4096), 128: (2, 16, 8192), 256: (2, 16, 4096)}


def _candidates(kernel: str, head_dim: int, small: bool):
  """(block_q, block_k, num_warps, num_stages) candidates for one kernel."""
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


def _time(kernel, head_dim, causal, cand, base):
  b, n, t = _SHAPES[head_dim]
  t = _SEQ_LEN.value or t
  cfg = configs.KernelConfig(*cand)
  flex_cfg = configs.FlexConfig(**{**{k: getattr(base, k) for k in ("fwd", "dkdv", "dq")},
                                   kernel: cfg})
  def build():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(key, (b, t, n, head_dim), jnp.bfloat16) for key in keys)
    st, args = pallas.prepare(q, k, v, scale=head_dim ** -0.5, is_causal=causal,
                              window=None, q_segment_ids=None, kv_segment_ids=None,
                              key_value_seq_lengths=None, interpret=False, config=flex_cfg)
    if kernel == "fwd":
      return jax.jit(lambda *a: pallas._forward(st, *a)), args
    out, lse = jax.jit(lambda *a: pallas._forward(st, *a))(*args)
    delta = triton_backward.compute_delta(out, do)
    call = triton_backward.dkdv_call if kernel == "dkdv" else triton_backward.dq_call
    return jax.jit(lambda *a: call(st, *a)), (*args[:6], lse, delta, do)
  row = harness.run_case(dict(kernel=kernel, H=head_dim, causal=causal, B=b, N=n, T=t,
                              block_q=cand[0], block_k=cand[1], num_warps=cand[2],
                              num_stages=cand[3]), build, warmup=1, iters=_ITERS.value)
  return row


def main(argv):
  del argv
  start = time.time()
  rows, best = [], {}
  for head_dim in map(int, _HEAD_SIZES.value):
    base = configs.get_config(head_dim, jnp.bfloat16, interpret=False)
    for causal in (c == "1" for c in _CAUSAL.value):
      for kernel in _KERNELS.value:
        for cand in _candidates(kernel, head_dim, _SMALL.value):
          if time.time() - start > _BUDGET_S.value:
            break
          row = _time(kernel, head_dim, causal, cand, base)
          rows.append(row)
          print(json.dumps({k: row.get(k) for k in ("kernel", "H", "causal", "block_q",
                                                     "block_k", "num_warps", "num_stages",
                                                     "status", "median_ms")}), flush=True)
          key = (head_dim, causal, kernel)
          if row.get("status") == "ok" and (key not in best or
                                            row["median_ms"] < best[key]["median_ms"]):
            best[key] = row
  harness.write_rows(rows, _OUTPUT.value)
  table = [dict(H=h, causal=c, kernel=k, block_q=r["block_q"], block_k=r["block_k"],
                num_warps=r["num_warps"], num_stages=r["num_stages"], ms=r["median_ms"])
           for (h, c, k), r in sorted(best.items())]
  print(harness.format_table(table, ["H", "causal", "kernel", "block_q", "block_k",
                                     "num_warps", "num_stages", "ms"]))


if __name__ == "__main__":
  app.run(main)
