"""SSD and the gated delta rule on a GPU: Pallas kernels vs the chunked XLA tier.

    python -m experiments.benchmark_kernel_ssd    # docs/benchmarks/chunked_ops.json
    JAX_PLATFORMS=cpu python -m experiments.benchmark_kernel_ssd --quick \\
        --output /tmp/kernel_ssd_cpu.json
    python -m experiments.benchmark_kernel_ssd --grid --output /tmp/chunked_grid.json

Shapes (`workloads.SSD_SHAPES`), the kernels performance page's:
(B, T, N, K, V) = (8, 4096, 4, 64, 64), (8, 4096, 16, 128, 128) and
(8, 16384, 4, 64, 64), bfloat16. Each case times the forward and the gradient
of a scalar sum of the outputs w.r.t. every input ("fwd+bwd"). `ops.ssd` runs
as 'pallas' (default chunk 64, and chunk 128) and 'xla' (the pure-JAX chunked
SSD, chunk 128); `ops.gated_delta_rule` as 'pallas' (default chunk 32, and
chunk 64) and 'xla' (the chunked WY form, chunk 64). The Pallas rows carry
`ratio_vs_xla`, from this same run; the Triton peers (flash-linear-attention)
are not run here. Before timing, both tiers are checked against the
step-by-step reference on this device (`check` rows: y, the final state and
the gradient w.r.t. each input, float32 and bfloat16 inputs, the reference run
in float32). `--models` adds SSMModel(16, 128, 16, 4) train steps (SGD) with
each of the three cells, default implementation vs 'xla'. `--quick`: tiny
shapes, two timed calls, the check in bfloat16 only (a CPU smoke test; the
kernels run in Pallas interpret mode there).

`--grid` times every implementation at the chunked-op points of `shape_grid`
(K = V in {32, 64, 96, 128, 256} x T in {100, 1000, 5000}, about 16,384
tokens a point, 8 heads; with --quick its 'smoke' subset) instead of the
headline shapes, without the models; each (op, point, mode) gets a summary
row with what the default (`implementation=None`) runs there (on an NVIDIA GPU
the kernel where it takes the shape and the committed dispatch table has it
checked and faster on this device kind, else XLA) and its time over XLA's
(`default_vs_xla`) and over the fastest row (`default_vs_best`).

`--grid --grid_check` also checks, at every point before timing it, every
implementation timed there against the op's float32 reference on this device
(bfloat16 inputs, as timed; y, final state and the gradient w.r.t. each
input): one `check` row per (point, implementation) with `grid` and `point`.
The reference is a step per token; it runs in slices of the (sequence, head)
pairs so its saved states stay within `REFERENCE_STATE_BYTES`.

    python -m experiments.benchmark_kernel_ssd --grid --grid_check \\
        --output /tmp/chunked_grid.json
"""

import json

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from experiments import shape_grid
from experiments import workloads
from ops import _backend
from ops import _measured
from ops.gated_delta_rule import gated_delta_rule_reference
from ops.ssd import ssd_reference

_OUTPUT = flags.DEFINE_string("output", "docs/benchmarks/chunked_ops.json",
                              "JSON output path (the curated suite file; another for trial runs).")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny shapes, few calls (CPU smoke test).")
_MODELS = flags.DEFINE_bool("models", True, "Also time SSMModel train steps per cell.")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls per case.")
_CHECK = flags.DEFINE_bool("check", True, "Check the kernels against the reference first.")
_SHAPES = flags.DEFINE_list("shapes", None, "Indices into workloads.SSD_SHAPES to time (default: all).")
_GRID = shape_grid.define_flags()
_IMPLS = flags.DEFINE_list(
    "impls", None, "The implementations to time, by name (`IMPLEMENTATIONS`: "
    "ssd/pallas, ssd/pallas_chunk128, ssd/xla, gated_delta_rule/pallas, "
    "gated_delta_rule/pallas_chunk64, gated_delta_rule/xla); default: all.")

# (B, T, N, K, V)
QUICK_SHAPES = ((1, 64, 2, 16, 16),)
# name -> (op, implementation, chunk_size)
IMPLEMENTATIONS = {
    "ssd/pallas": ("ssd", "pallas", None),
    "ssd/pallas_chunk128": ("ssd", "pallas", 128),
    "ssd/xla": ("ssd", "xla", 128),
    "gated_delta_rule/pallas": ("gated_delta_rule", "pallas", None),
    "gated_delta_rule/pallas_chunk64": ("gated_delta_rule", "pallas", 64),
    "gated_delta_rule/xla": ("gated_delta_rule", "xla", 64),
}
# The --check cases: both tiers of both ops at one chunk size.
CHECK_CASES = {f"{op}/{impl}_chunk64": (op, impl, 64)
               for op in ("ssd", "gated_delta_rule") for impl in ("pallas", "xla")}
# The inputs each op reads (ssd takes no beta), and its float32 reference.
INPUTS = {"ssd": ("q", "k", "v", "log_decay"),
          "gated_delta_rule": ("q", "k", "v", "log_decay", "beta")}
REFERENCES = {"ssd": lambda q, k, v, g, beta: ssd_reference(q, k, v, g),
              "gated_delta_rule": gated_delta_rule_reference}
# The reference's gradient keeps every step's [K, V] state of every (sequence,
# head): 34 GB at a grid point with K = V = 256. It runs in slices of at most this.
REFERENCE_STATE_BYTES = 2**32


def _rel(x, ref):
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  return float(np.abs(x - ref).max() / max(1.0, np.abs(ref).max()))


def _outputs_and_grads(fn, num_inputs):
  """jit of `args -> (y, final_state, grads)`: `fn(*args)` and the gradients of
  `workloads.chunked_loss(fn)` w.r.t. the first `num_inputs` args."""
  def run(*args):
    grads = jax.grad(workloads.chunked_loss(fn), argnums=tuple(range(num_inputs)))(*args)
    return (*fn(*args), grads)
  return jax.jit(run)


def reference_outputs(op, args, state_bytes=REFERENCE_STATE_BYTES):
  """The op's step-by-step reference on float32 copies of `args`, with float32
  matmuls: `_outputs_and_grads` of it, gradients w.r.t. each of `INPUTS[op]`.

  Sequences and heads are independent, so the B x N (sequence, head) pairs run
  in slices whose saved states (T x K x V float32 a pair) take at most
  `state_bytes`: the gradient of the scan keeps every step's state.

  Args:
    op: 'ssd' or 'gated_delta_rule'.
    args: q, k [B, T, N, K], v [B, T, N, V], log_decay, beta [B, T, N].
    state_bytes: the saved states' bytes a slice may take.

  Returns:
    y [B, T, N, V], final_state [B, N, K, V] and the gradients (the inputs'
    shapes), float32.
  """
  batch, time, heads, key = args[0].shape
  value = args[2].shape[-1]
  pairs = batch * heads
  rows = max(1, min(pairs, state_bytes // (time * key * value * 4)))

  def fold(x):  # [B, T, N, ...] -> [B * N, T, 1, ...]: a (sequence, head) pair a row
    x = jnp.swapaxes(x.astype(jnp.float32), 1, 2)
    return x.reshape(pairs, time, 1, *x.shape[3:])

  def unfold(x):  # [B * N, T, 1, ...] -> [B, T, N, ...]
    return jnp.swapaxes(x.reshape(batch, heads, time, *x.shape[3:]), 1, 2)

  run = _outputs_and_grads(REFERENCES[op], len(INPUTS[op]))
  folded = [fold(x) for x in args]
  parts = []
  with jax.default_matmul_precision("highest"):
    for start in range(0, pairs, rows):
      parts.append(run(*(x[start:start + rows] for x in folded)))
  y = unfold(jnp.concatenate([p[0] for p in parts]))
  final = jnp.concatenate([p[1] for p in parts]).reshape(batch, heads, key, value)
  grads = tuple(unfold(jnp.concatenate([p[2][i] for p in parts]))
                for i in range(len(INPUTS[op])))
  return y, final, grads


def check_shape(shape, dtype, cases, fields=None):
  """Each case at `shape` against its op's float32 reference on this device.

  Args:
    shape: (B, T, N, K, V).
    dtype: the inputs' dtype (`workloads.ssd_inputs`, seed 1).
    cases: name -> (op, implementation, chunk_size), as `IMPLEMENTATIONS`.
    fields: more fields for every row (a grid point's).

  Returns:
    A row per case, kind 'check': the relative errors (`_rel`) of y
    (`y_err`), of the final state (`final_err`) and of the gradient of
    `workloads.chunked_loss` w.r.t. each input the op reads (`dq_err`, ...;
    `grad_err` is their largest), status 'ok'; 'unsup' where the op declines
    the shape, 'error' with the message where it (or the reference) fails.
  """
  args = workloads.ssd_inputs(*shape, dtype, seed=1)
  # Each op's reference, computed once; a failure is each of its rows'.
  references = {op: harness.computed_once(lambda op=op: reference_outputs(op, args),
                                          "the float32 reference") for op in INPUTS}

  def errors(op, impl, chunk):
    fn = workloads.chunked_op(op, impl, chunk)
    harness.require_supported(fn, *args)
    want_y, want_final, want_grads = references[op]()
    y, final, grads = _outputs_and_grads(fn, len(INPUTS[op]))(*args)
    grad_errors = {f"d{n}_err": _rel(g, w) for n, g, w in zip(INPUTS[op], grads, want_grads)}
    return dict(y_err=_rel(y, want_y), final_err=_rel(final, want_final),
                grad_err=max(grad_errors.values()), **grad_errors)

  rows = []
  for name, (op, impl, chunk) in cases.items():
    row = harness.check_row(
        dict(kind="check", op=op, implementation=impl, name=name, chunk_size=chunk,
             dtype=jnp.dtype(dtype).name, shape=shape, **dict(zip("BTNKV", shape)),
             **(fields or {})),
        lambda op=op, impl=impl, chunk=chunk: errors(op, impl, chunk))
    print(json.dumps({k: row.get(k) for k in ("point", "name", "dtype", "shape", "status",
                                               "y_err", "final_err", "grad_err", "message")}),
          flush=True)
    rows.append(row)
  return rows


def check_rows(quick):
  """`CHECK_CASES` against the float32 reference on this device, float32 and
  bfloat16 inputs; `quick`: bfloat16 at the 'smoke' grid point."""
  if quick:  # a grid check there compiles the same references
    shape, dtypes = shape_grid.chunked_grid("smoke")[0].shape, (jnp.bfloat16,)
  else:
    shape, dtypes = (2, 300, 4, 64, 64), (jnp.float32, jnp.bfloat16)
  return [row for dtype in dtypes for row in check_shape(shape, dtype, CHECK_CASES)]


def kernel_rows(shapes, iters, warmup, sink, points=None, check=False):
  """Times every implementation at every shape; `sink` takes each row. With
  `points` (grid points, one per shape) the rows carry the point's name, and
  with `check` too every implementation is first checked at each point
  (`check_shape`, bfloat16 as timed)."""
  rows = []
  names = _IMPLS.value or list(IMPLEMENTATIONS)
  for i, shape in enumerate(shapes):
    batch, time, heads, key, value = shape
    if check:
      for row in check_shape(shape, jnp.bfloat16, {n: IMPLEMENTATIONS[n] for n in names},
                             dict(grid="chunked", point=points[i].name)):
        sink(row)
    for name in names:
      op, impl, chunk = IMPLEMENTATIONS[name]
      for mode in ("fwd", "fwd+bwd"):
        config = dict(kind="op", op=op, implementation=impl, name=name, mode=mode,
                      chunk_size=chunk, B=batch, T=time, N=heads, K=key, V=value,
                      dtype="bfloat16")
        if points is not None:
          config.update(grid="chunked", point=points[i].name)

        def build(op=op, impl=impl, chunk=chunk, mode=mode):
          args = workloads.ssd_inputs(*shape, jnp.bfloat16)
          fn = workloads.chunked_op(op, impl, chunk)
          harness.require_supported(fn, *args)
          if mode == "fwd":
            return jax.jit(fn), args
          return jax.jit(jax.grad(workloads.chunked_loss(fn), argnums=(0, 1, 2, 3, 4))), args
        row = harness.run_case(config, build, warmup=warmup, iters=iters)
        logging.info("%s %s %s: %s %s", name, mode, shape, row["status"],
                     row.get("median_ms"))
        rows.append(row)
        sink(row)
  add_ratios(rows)
  return rows


def add_ratios(rows):
  """Pallas rows get `ratio_vs_xla` (median over the same op's XLA median)."""
  xla = {(r["op"], r["mode"], r["B"], r["T"], r["N"], r["K"]): r.get("median_ms")
         for r in rows if r.get("kind") == "op" and r["implementation"] == "xla"}
  for r in rows:
    if r.get("kind") == "op" and r["implementation"] == "pallas" and r.get("median_ms"):
      peer = xla.get((r["op"], r["mode"], r["B"], r["T"], r["N"], r["K"]))
      if peer:
        r["ratio_vs_xla"] = r["median_ms"] / peer


def grid_summary(rows):
  """One row per (op, point, mode) of the grid's rows: what the default runs
  (on an NVIDIA GPU the kernel where it takes the shape and this device
  kind's committed table picks it, `_measured.fastest`, else XLA; None when
  the default-chunk kernel was not timed), its time over XLA's and over the
  fastest implementation's."""
  timed = {}
  for r in rows:
    if r.get("kind") == "op" and r.get("point") is not None:
      timed.setdefault((r["op"], r["point"], r["mode"]), []).append(r)
  out = []
  for (op, point, mode), group in timed.items():
    ms = {r["name"].split("/", 1)[1]: r["median_ms"] for r in group if r["status"] == "ok"}
    kernel = [r for r in group if r["implementation"] == "pallas" and r["chunk_size"] is None]
    default = "xla"  # off NVIDIA GPUs, and where the kernel declines the shape
    if _backend.on_nvidia_gpu() and kernel and kernel[0]["status"] != "unsup":
      default = _measured.fastest(op, ("pallas", "xla"), key_dim=group[0]["K"],
                                  length=group[0]["T"]) or "xla"
    elif _backend.on_nvidia_gpu() and not kernel:
      default = None
    s = dict(kind="summary", op=op, point=point, mode=mode,
             **{k: group[0][k] for k in ("B", "T", "N", "K", "V")},
             **{f"{name}_ms": t for name, t in ms.items()}, default_impl=default)
    if default in ms:
      s["default_ms"] = ms[default]
      if "xla" in ms:
        s["default_vs_xla"] = ms[default] / ms["xla"]
      s["best"] = min(ms, key=ms.get)
      s["default_vs_best"] = ms[default] / ms[s["best"]]
    out.append(s)
  return out


def model_rows(quick, iters, warmup, sink):
  """SSMModel(16, 128, 16, 4) SGD train step per cell: default vs 'xla'."""
  import haiku as hk
  from probjax_hk.ssm import GatedDeltaNetCell
  from probjax_hk.ssm import Mamba2Cell
  from probjax_hk.ssm import SSDCell
  from probjax_hk.ssm import SSMModel
  batch, time = (1, 32) if quick else (8, 4096)
  cells = {"SSDCell": (SSDCell, dict(num_heads=2, state_dim=64)),
           "Mamba2Cell": (Mamba2Cell, dict()),
           "GatedDeltaNetCell": (GatedDeltaNetCell, dict(num_heads=2))}
  rows = []
  for cell_name, (cell, kwargs) in cells.items():
    for impl in (None, "xla"):
      config = dict(kind="model", cell=cell_name, implementation=str(impl), B=batch,
                    T=time, dtype="bfloat16", step="sgd")

      def build(cell=cell, kwargs=kwargs, impl=impl):
        model = hk.transform(lambda x: SSMModel(
            16, 128, 16, 4, cell=cell,
            cell_kwargs=dict(kwargs, implementation=impl))(x))
        x = jax.random.normal(jax.random.key(0), (batch, time, 16), jnp.bfloat16)
        params = model.init(jax.random.key(1), x)

        def train_step(params, x):
          loss = lambda p: jnp.mean(jnp.square(model.apply(p, None, x).astype(jnp.float32)))
          value, grads = jax.value_and_grad(loss)(params)
          return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value
        return jax.jit(train_step), (params, x)
      row = harness.run_case(config, build, warmup=warmup, iters=iters)
      logging.info("%s %s: %s %s", cell_name, impl, row["status"], row.get("median_ms"))
      rows.append(row)
      sink(row)
  default = {r["cell"]: r.get("median_ms") for r in rows if r["implementation"] == "None"}
  for r in rows:
    if r["implementation"] == "xla" and r.get("median_ms") and default.get(r["cell"]):
      r["default_over_xla"] = default[r["cell"]] / r["median_ms"]
  return rows


def main(argv):
  del argv
  quick = _QUICK.value
  iters, warmup = (2, 1) if quick else (_ITERS.value, 2)
  rows = []
  grid = _GRID.grid.value
  unknown = set(_IMPLS.value or ()) - set(IMPLEMENTATIONS)
  if unknown:
    raise app.UsageError(f"--impls: unknown {sorted(unknown)}; known: {list(IMPLEMENTATIONS)}")
  if grid and _SHAPES.value:
    raise app.UsageError("--shapes and --grid name different shapes: give one")
  if _GRID.check.value and not grid:
    raise app.UsageError("--grid_check checks the grid's points: give --grid too")
  output = _OUTPUT.value
  if grid and not flags.FLAGS["output"].present:
    output = "/tmp/chunked_grid.json"

  def sink(row):
    """Rewrites the JSON after every row: a run cut short keeps what it measured."""
    rows.append(row)
    harness.write_rows(rows, output)

  if _CHECK.value:
    for row in check_rows(quick):
      sink(row)
  shapes = QUICK_SHAPES if quick else workloads.SSD_SHAPES
  points = None
  if _SHAPES.value:
    shapes = [workloads.SSD_SHAPES[int(i)] for i in _SHAPES.value]
  if grid:
    points = _GRID.points("chunked", "smoke" if quick else None)
    shapes = [p.shape for p in points]
  # Adds the ratios to the rows in place.
  kernel_rows(shapes, iters, warmup, sink, points, check=grid and _GRID.check.value)
  if grid:
    for row in grid_summary(rows):
      sink(row)
  elif _MODELS.value:
    model_rows(quick, iters, warmup, sink)
  harness.write_rows(rows, output)
  print(harness.format_table([r for r in rows if r["kind"] == "check"],
                             ["point", "name", "dtype", "status", "y_err", "final_err",
                              "grad_err"]))
  print(harness.format_table([r for r in rows if r["kind"] == "op"],
                             ["name", "mode", "B", "T", "N", "K", "status", "median_ms",
                              "ratio_vs_xla", "compile_s"]))
  print(harness.format_table([r for r in rows if r["kind"] == "model"],
                             ["cell", "implementation", "status", "median_ms",
                              "default_over_xla", "compile_s"]))
  print(harness.format_table([r for r in rows if r["kind"] == "summary"],
                             ["op", "point", "mode", "default_impl", "default_ms", "xla_ms",
                              "default_vs_xla", "best", "default_vs_best"]))


if __name__ == "__main__":
  app.run(main)
