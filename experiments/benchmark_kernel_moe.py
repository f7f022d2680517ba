"""Grouped matmul and dropless MoE on one GPU: correctness, kernel tiles, timings.

    python -m experiments.benchmark_kernel_moe --output docs/benchmarks/kernel_moe.json
    JAX_PLATFORMS=cpu python -m experiments.benchmark_kernel_moe --tokens 256 \
        --gmm_rows 1024 --iters 2 --output /tmp/kernel_moe_cpu.json

"fwd+bwd" is one `jax.vjp` with a fixed random cotangent (with a sum-of-outputs
loss XLA rewrites a dense matmul's gradient into a reduction). Sections (one
JSON row each, `section` says which):
- check: on the device, `ops.grouped_matmul` (Pallas) against the fp32
  reference on values and both gradients (f32 and bf16, empty groups, M not a
  tile multiple), and MoELayer 'gmm' against 'dense' (bf16).
- tiles: a few tile configurations of the forward (`gmm`) and weight-gradient
  (`tgmm`) kernels at M = `gmm_rows`.
- op: grouped matmul [M, 512] x [8, 512, 1024] forward and fwd+bwd: the Pallas
  kernel, `jax.lax.ragged_dot`, every expert on every row (a dense per-expert
  einsum, 8x the arithmetic) and one dense `jnp.matmul` of the same work
  (the TFLOP/s yardstick).
- parts: the router and the two sorts of the sorted paths, alone.
- moe: MoELayer(8 experts, top-2, d_model 512, d_hidden 1024, GELU), bf16,
  forward and fwd+bwd, one row per `dropless_impl`; ratios vs 'dense' and
  'ragged_dot' from the same run.
"""

import time

from absl import app
from absl import flags
from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from experiments import workloads
import ops
from ops.grouped_matmul import pallas as gmm_pallas
from ops.grouped_matmul import reference as gmm_reference
from probjax_hk import moe

_OUTPUT = flags.DEFINE_string("output", "docs/benchmarks/kernel_moe.json", "JSON output.")
_TOKENS = flags.DEFINE_list("tokens", ["8192", "65536"], "MoE token counts.")
_GMM_ROWS = flags.DEFINE_integer("gmm_rows", 131072, "M of the grouped-matmul op cases.")
_SECTIONS = flags.DEFINE_list("sections", ["check", "tiles", "op", "parts", "moe"],
                              "What to run.")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls per case.")
_BUDGET = flags.DEFINE_float("time_budget_s", 250.0, "Skip cases started after this.")

IMPLS = ("dense", "ragged_dot", "sort", "gmm", "auto")
_B = gmm_pallas.BlockSizes
TILES = {
    "default": _B(),
    "rows_fastest": _B(columns_fastest=False),
    "stages4": _B(num_stages=4, tgmm_num_stages=4),
    "m256_n128__tgmm_k256_n128": _B(block_m=256, block_n=128, tgmm_block_k=256,
                                    tgmm_block_n=128),
    "k32__tgmm_m32": _B(block_k=32, num_stages=4, tgmm_block_m=32, tgmm_num_stages=4),
    "m128_k64_n128__tgmm_n128": _B(block_n=128, num_stages=4, tgmm_block_n=128),
}
_START = time.perf_counter()


def _over_budget() -> bool:
  return time.perf_counter() - _START > _BUDGET.value


def _rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.abs(a - b).max() / max(1e-6, np.abs(b).max()))


def check_rows() -> list[dict]:
  rows = []
  m, k, n = 4133, 512, 1024  # not a multiple of any tile
  sizes = jnp.asarray([700, 0, 2048, 13, 0, 1000, 300, 72], jnp.int32)
  for dtype in (jnp.float32, jnp.bfloat16):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dtype)
    rhs = (jax.random.normal(k2, (8, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    cot = jax.random.normal(k3, (m, n), jnp.float32).astype(dtype)

    def vjp(fn):
      out, pullback = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
      return (out, *pullback(cot))
    got = jax.jit(lambda: vjp(lambda a, b, s: ops.grouped_matmul(
        a, b, s, implementation="pallas")))()
    want = jax.jit(lambda: vjp(gmm_reference.grouped_matmul_reference))()
    rows.append(dict(section="check", case="grouped_matmul_vs_reference",
                     dtype=jnp.dtype(dtype).name, shape=[m, k, n],
                     **{f"rel_err_{w}": _rel_err(g, r)
                        for w, g, r in zip(("out", "dlhs", "drhs"), got, want)}))
  x = jax.random.normal(jax.random.key(3), (2048, workloads.D_MODEL), jnp.bfloat16)
  outs = {}
  for impl in ("dense", "gmm"):
    model = _moe_model(impl)
    params, state = model.init(jax.random.key(1), x)
    loss = lambda p, x: jnp.sum(model.apply(p, state, None, x)[0].astype(jnp.float32))
    outs[impl] = jax.jit(jax.value_and_grad(loss))(params, x)
  rows.append(dict(section="check", case="moe_gmm_vs_dense", dtype="bfloat16",
                   rel_err_loss=_rel_err(outs["gmm"][0], outs["dense"][0]),
                   rel_err_grads=max(jax.tree.leaves(jax.tree.map(
                       _rel_err, outs["gmm"][1], outs["dense"][1])))))
  return rows


def tile_rows(rows: int) -> list[dict]:
  out = []
  lhs, rhs, sizes = workloads.gmm_inputs(rows)
  starts, ends = gmm_reference.group_bounds(sizes, rows)
  dout = jnp.ones((rows, workloads.D_HIDDEN), jnp.bfloat16)
  flops = 2 * rows * workloads.D_MODEL * workloads.D_HIDDEN
  for name, bs in TILES.items():
    if _over_budget():
      break
    for kernel, fn, args in (
        ("gmm", lambda a, b, s, e, bs=bs: gmm_pallas.gmm(a, b, s, e, block_sizes=bs),
         (lhs, rhs, starts, ends)),
        ("gmm_transposed", lambda a, b, s, e, bs=bs: gmm_pallas.gmm(
            a, b, s, e, transpose_rhs=True, block_sizes=bs), (dout, rhs, starts, ends)),
        ("tgmm", lambda a, b, s, e, bs=bs: gmm_pallas.tgmm(a, b, s, e, block_sizes=bs),
         (lhs, dout, starts, ends))):
      row = harness.run_case(dict(section="tiles", tiles=name, kernel=kernel, rows=rows),
                             lambda fn=fn, args=args: (fn, args), iters=_ITERS.value)
      if row["status"] == "ok":
        row["tflops"] = flops / row["median_ms"] / 1e9
      out.append(row)
      logging.info("%s", {k: row.get(k) for k in ("tiles", "kernel", "median_ms", "tflops")})
  return out


def op_rows(rows: int) -> list[dict]:
  lhs, rhs, sizes = workloads.gmm_inputs(rows)
  # A random cotangent: with ones, XLA rewrites a dense matmul's gradient.
  cotangent = jax.random.normal(jax.random.key(5), (rows, workloads.D_HIDDEN), jnp.bfloat16)
  flops = 2 * rows * workloads.D_MODEL * workloads.D_HIDDEN
  group_of_row = jnp.repeat(jnp.arange(workloads.NUM_EXPERTS), sizes, total_repeat_length=rows)

  def every_expert(a, b, s):
    y = jnp.einsum("mk,gkn->gmn", a, b, preferred_element_type=jnp.float32)
    select = jax.nn.one_hot(group_of_row, workloads.NUM_EXPERTS, dtype=jnp.float32)
    return jnp.einsum("mg,gmn->mn", select, y).astype(a.dtype)

  peers = {
      "pallas": lambda a, b, s: ops.grouped_matmul(a, b, s, implementation="pallas"),
      "ragged_dot": lambda a, b, s: ops.grouped_matmul(a, b, s, implementation="xla"),
      "every_expert_einsum": every_expert,
      "dense_matmul_same_flops": lambda a, b, s: jnp.matmul(a, b[0]),
  }
  out = []
  for mode in ("forward", "fwd+bwd"):
    for name, fn in peers.items():
      if _over_budget():
        break
      if mode == "forward":
        case = lambda fn=fn: (fn, (lhs, rhs, sizes))
      else:
        def case(fn=fn):
          def grad(a, b, s, cot):
            return jax.vjp(lambda a, b: fn(a, b, s), a, b)[1](cot)
          return grad, (lhs, rhs, sizes, cotangent)
      row = harness.run_case(dict(section="op", impl=name, mode=mode, rows=rows), case,
                             iters=_ITERS.value)
      if row["status"] == "ok":
        row["tflops"] = flops * (1 if mode == "forward" else 3) / row["median_ms"] / 1e9
      out.append(row)
      logging.info("%s", {k: row.get(k) for k in ("impl", "mode", "median_ms", "tflops")})
  base = {(r["mode"]): r for r in out if r["impl"] == "dense_matmul_same_flops"}
  for r in out:
    if r.get("status") == "ok" and base.get(r["mode"], {}).get("status") == "ok":
      r["fraction_of_dense_matmul_tflops"] = base[r["mode"]]["median_ms"] / r["median_ms"]
  return out


def _moe_model(impl: str):
  return hk.transform_with_state(lambda x: moe.MoELayer(
      workloads.NUM_EXPERTS, workloads.TOP_K, workloads.D_HIDDEN, activation="gelu", dropless_impl=impl)(x))


def part_rows(tokens: int) -> list[dict]:
  """Pieces of the sorted paths at `tokens`: router, the two sorts."""
  x = jax.random.normal(jax.random.key(0), (tokens, workloads.D_MODEL), jnp.bfloat16)
  w_router = jax.random.normal(jax.random.key(1), (workloads.D_MODEL, workloads.NUM_EXPERTS)) / 20
  ids = moe.route(x, w_router, workloads.TOP_K).expert_ids.reshape(-1)
  cases = {
      "router_top2": (lambda x, w: moe.route(x, w, workloads.TOP_K), (x, w_router)),
      "sort_argsort": (lambda i: moe._sort_by_expert(i, workloads.NUM_EXPERTS, method="argsort"),
                       (ids,)),
      "sort_counting": (lambda i: moe._sort_by_expert(i, workloads.NUM_EXPERTS, method="counting"),
                        (ids,)),
  }
  out = []
  for name, (fn, args) in cases.items():
    out.append(harness.run_case(dict(section="parts", part=name, tokens=tokens),
                                lambda fn=fn, args=args: (fn, args), iters=_ITERS.value))
  return out


def moe_rows(tokens: int) -> list[dict]:
  x = jax.random.normal(jax.random.key(0), (tokens, workloads.D_MODEL), jnp.bfloat16)
  params, state = _moe_model("dense").init(jax.random.key(1), x)
  cotangent = jax.random.normal(jax.random.key(5), x.shape, x.dtype)
  out = []
  for mode in ("forward", "fwd+bwd"):
    for impl in IMPLS:
      if _over_budget():
        break
      model = _moe_model(impl)
      if mode == "forward":
        fn = lambda p, x, model=model: model.apply(p, state, None, x)[0]
        args = (params, x)
      else:
        def fn(p, x, cot, model=model):
          return jax.vjp(lambda p, x: model.apply(p, state, None, x)[0], p, x)[1](cot)
        args = (params, x, cotangent)
      row = harness.run_case(dict(section="moe", impl=impl, mode=mode, tokens=tokens),
                             lambda fn=fn, args=args: (fn, args), iters=_ITERS.value)
      out.append(row)
      logging.info("%s", {k: row.get(k) for k in ("impl", "mode", "tokens", "median_ms")})
  for r in out:
    for peer in ("dense", "ragged_dot"):
      base = [b for b in out if b["impl"] == peer and b["mode"] == r["mode"]]
      if r.get("status") == "ok" and base and base[0].get("status") == "ok":
        r[f"ratio_vs_{peer}"] = r["median_ms"] / base[0]["median_ms"]
  return out


def main(argv):
  del argv
  rows = []
  sections = _SECTIONS.value
  if "check" in sections:
    rows += check_rows()
  if "tiles" in sections:
    rows += tile_rows(_GMM_ROWS.value)
  if "op" in sections:
    rows += op_rows(_GMM_ROWS.value)
  if "parts" in sections:
    rows += part_rows(int(_TOKENS.value[-1]))
  if "moe" in sections:
    for tokens in _TOKENS.value:
      rows += moe_rows(int(tokens))
  harness.write_rows(rows, _OUTPUT.value)
  print(harness.format_table([r for r in rows if r["section"] == "check"],
                             ["case", "dtype", "rel_err_out", "rel_err_dlhs", "rel_err_drhs",
                              "rel_err_loss", "rel_err_grads"]))
  print(harness.format_table([r for r in rows if r["section"] == "tiles"],
                             ["tiles", "kernel", "status", "median_ms", "tflops"]))
  print(harness.format_table([r for r in rows if r["section"] == "op"],
                             ["impl", "mode", "status", "median_ms", "tflops",
                              "fraction_of_dense_matmul_tflops"]))
  print(harness.format_table([r for r in rows if r["section"] == "parts"],
                             ["part", "tokens", "status", "median_ms"]))
  print(harness.format_table([r for r in rows if r["section"] == "moe"],
                             ["tokens", "mode", "impl", "status", "median_ms", "ratio_vs_dense",
                              "ratio_vs_ragged_dot"]))
  print(f"total {time.perf_counter() - _START:.1f} s")


if __name__ == "__main__":
  app.run(main)
