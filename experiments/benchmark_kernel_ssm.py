"""SSM scan kernels (and SSMModel) on a GPU: Pallas vs `lax.associative_scan`.

    python -m experiments.benchmark_kernel_ssm --models    # docs/benchmarks/ssm_scans.json
    JAX_PLATFORMS=cpu python -m experiments.benchmark_kernel_ssm --small \\
        --output /tmp/kernel_ssm_cpu.json
    python -m experiments.benchmark_kernel_ssm --grid --ops selective_scan \\
        --output /tmp/ssm_grid.json

Shapes, the kernels performance page's: the selective scan at B 8, T 4096,
D 256, S 16 and 128 (float32), the complex64 linear scan at B 8, T 4096 and
16384, D 256; `lax.scan` (the reference) only at a small T. Every case times
the forward and the gradient of a scalar sum w.r.t. every input ("fwd+bwd").
After the timings, each kernel is checked against the reference on this device
(`check` rows: y, final state and the gradient w.r.t. each input, forward and
reverse).
Rows are printed and the JSON rewritten as each case completes.
`--sweep` adds a few block-size variants of the Pallas kernels; `--models`
times SSMModel(16, 128, 16, 4) forward and Adam train step per cell.

`--ops` also takes `ssd` and `gated_delta_rule`, the chunked ops: they run as
experiments/benchmark_kernel_ssd.py (their shapes, their chunked XLA peer and
their cells' train steps with `--models`) in a process of their own, writing
their suite's file, `chunked_ops.json`, beside `--output`.

`--grid` times the selective scan (Pallas and XLA, fwd and fwd+bwd) at the
scan points of `shape_grid` (state sizes {16, 24, 64, 128} at B 4, T 4096,
D 512; with --small its 'smoke' subset) instead of the headline cases, without
the memory case, the models and the sweep; the chunked ops in `--ops` run
`benchmark_kernel_ssd --grid` with the same grid flags, writing
`chunked_grid.json` beside `--output` (default /tmp/ssm_grid.json).

`--grid --grid_check` also checks, at every point before timing it, the
selective scan's implementations timed there (Pallas, XLA) against
`selective_scan_reference` on this device (float32: y, final state and the
gradient w.r.t. each input), one `check` row per (point, implementation) with
`grid` and `point`; the flag goes on to `benchmark_kernel_ssd --grid`, which
does the same for the chunked ops:

    python -m experiments.benchmark_kernel_ssm --grid --grid_check \\
        --ops selective_scan,ssd,gated_delta_rule --output /tmp/ssm_grid.json
"""

import functools
import json
import os

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from experiments import shape_grid
from experiments import workloads
from ops.linear_scan import configs as linear_scan_configs
from ops.linear_scan import linear_scan_pallas
from ops.linear_scan import linear_scan_reference
from ops.linear_scan import linear_scan_xla
from ops.selective_scan import configs as selective_scan_configs
from ops.selective_scan import selective_scan_pallas
from ops.selective_scan import selective_scan_reference
from ops.selective_scan import selective_scan_xla

_OUTPUT = flags.DEFINE_string("output", "docs/benchmarks/ssm_scans.json",
                              "JSON output path (the curated suite file; another for trial runs).")
_SMALL = flags.DEFINE_bool("small", False, "Tiny shapes (CPU smoke test).")
_SWEEP = flags.DEFINE_bool("sweep", False, "Also time block-size variants.")
_KERNELS = flags.DEFINE_bool("kernels", True, "Time the scan ops.")
_MODELS = flags.DEFINE_bool("models", False, "Time SSMModel per cell.")
_MEMORY = flags.DEFINE_bool("memory", True, "Selective scan at T 16384, S 128: memory.")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls per case.")
_CELLS = flags.DEFINE_list("cells", ["lru", "mamba"], "SSMModel cells timed with --models.")
_OPS = flags.DEFINE_list("ops", ["selective_scan", "linear_scan", "ssd", "gated_delta_rule"],
                         "Which ops to time and check.")
_CHUNKED_OPS = ("ssd", "gated_delta_rule")  # both timed by benchmark_kernel_ssd.py
_GRID = shape_grid.define_flags()

_SELECTIVE = {"pallas": selective_scan_pallas, "xla": selective_scan_xla,
              "lax.scan": selective_scan_reference}
_LINEAR = {"pallas": linear_scan_pallas, "xla": linear_scan_xla,
           "lax.scan": linear_scan_reference}
# op -> (implementations by name, the inputs' builder, the inputs' names).
_SCANS = {"selective_scan": (_SELECTIVE, workloads.selective_inputs,
                             ("u", "delta", "A", "B", "C")),
          "linear_scan": (_LINEAR, workloads.linear_inputs, ("a", "b"))}


def _case_fns(fn, num_args):
  fwd = jax.jit(fn)
  grad = jax.jit(jax.grad(workloads.scan_loss(fn), argnums=tuple(range(num_args))))
  return {"fwd": fwd, "fwd+bwd": grad}


def _lru_case_fns(scan):
  """The LRU's use of the scan: one decay [D] for every step, `b` built from
  real planes and `h` read as planes (as `LRUCell` does), so neither tier pays
  for complex arrays crossing the jit boundary."""
  def fn(lam, b_re, b_im):
    h, final = scan(lam, jax.lax.complex(b_re, b_im))
    return h.real, h.imag, final

  def loss(*args):
    h_re, h_im, final = fn(*args)
    return jnp.sum(h_re) + jnp.sum(h_im) + jnp.sum(jnp.real(final))
  return {"fwd": jax.jit(fn), "fwd+bwd": jax.jit(jax.grad(loss, argnums=(0, 1, 2)))}


def _relerr(x, y):
  x, y = np.asarray(x, np.complex128), np.asarray(y, np.complex128)
  return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def _outputs_and_grads(fn, num_args):
  """jit of `args -> (y, final_state, grads)`: `fn(*args)` and the gradients of
  `workloads.scan_loss(fn)` w.r.t. every arg."""
  def run(*args):
    grads = jax.grad(workloads.scan_loss(fn), argnums=tuple(range(num_args)))(*args)
    return (*fn(*args), grads)
  return jax.jit(run)


def check_scan(op, shape, reverse=False, impls=("pallas", "xla"), fields=None):
  """`impls` of `op` at `shape` against its step-by-step reference ('lax.scan',
  float32; complex64 for the linear scan) on this device.

  Args:
    op: 'selective_scan' (shape (B, T, D, S)) or 'linear_scan' (shape (B, T, D)).
    shape: the inputs' sizes (`workloads.selective_inputs` or `linear_inputs`,
      seed 1).
    reverse: scan from the last step to the first.
    impls: names in `_SELECTIVE` / `_LINEAR`.
    fields: more fields for every row (a grid point's).

  Returns:
    A row per implementation, kind 'check': relative L2 errors of y (`err_y`),
    of the final state (`err_final`) and of the gradient of
    `workloads.scan_loss` w.r.t. each input (`err_du`, ...; `err_grads` is
    their largest), status 'ok'; 'unsup' where the implementation declines
    the shape, 'error' with the message where it (or the reference) fails.
  """
  fns, inputs, names = _SCANS[op]
  args = inputs(*shape, seed=1)
  # Once for every implementation; a failure is each one's row.
  want = harness.computed_once(lambda: _outputs_and_grads(
      functools.partial(fns["lax.scan"], reverse=reverse), len(args))(*args), "the reference")

  def errors(impl):
    fn = functools.partial(fns[impl], reverse=reverse)
    harness.require_supported(fn, *args)
    want_y, want_final, want_grads = want()
    y, final, grads = _outputs_and_grads(fn, len(args))(*args)
    grad_errors = {f"err_d{n}": _relerr(g, w) for n, g, w in zip(names, grads, want_grads)}
    return dict(err_y=_relerr(y, want_y), err_final=_relerr(final, want_final),
                err_grads=max(grad_errors.values()), **grad_errors)

  return [harness.check_row({"kind": "check", "op": op, "impl": impl, "shape": shape,
                             "reverse": reverse, **(fields or {})},
                            lambda impl=impl: errors(impl)) for impl in impls]


def check_numerics(small):
  """Pallas and XLA vs the step reference on this device: forward and
  gradients, forward and reverse, of each scan in --ops."""
  # small: the selective scan at the 'smoke' grid point, whose forward programs
  # a grid check there compiles too.
  shapes = {"selective_scan": shape_grid.scan_grid("smoke")[0].shape if small
                              else (2, 1000, 64, 16),
            "linear_scan": (2, 64, 16) if small else (2, 1000, 64)}
  return [row for op, shape in shapes.items() if op in _OPS.value
          for reverse in (False, True) for row in check_scan(op, shape, reverse)]


def _time(config, fn, args, iters):
  return harness.run_case(config, lambda: (fn, args), warmup=2, iters=iters)


def kernel_cases(small, sweep):
  """(op, shape, impl, blocks) of the main grid, or of the block-size sweep."""
  b, d = (2, 16) if small else (8, 256)
  t = 256 if small else 4096
  cases = []
  if sweep:
    for v in [(8, 16, 512, 4, 1), (8, 16, 512, 4, 2), (8, 16, 512, 4, 3),
              (4, 16, 256, 2, 2), (16, 8, 512, 4, 2), (8, 16, 4096, 4, 2),
              (4, 16, 4096, 2, 2), (2, 16, 4096, 1, 2), (8, 16, 1024, 4, 2)]:
      cases.append(("selective_scan", (b, t, d, 16), "pallas",
                    selective_scan_configs.TritonConfig(*v)))
    # S 128: the dB/dC partials are [B, D / block_d, T, S], so block_d sets memory.
    for v in [(1, 8, 4096, 2), (2, 4, 4096, 2), (4, 2, 4096, 2), (4, 4, 4096, 4),
              (8, 2, 4096, 4), (4, 2, 1024, 2), (8, 1, 4096, 2), (4, 4, 1024, 4)]:
      cases.append(("selective_scan", (b, t, d, 128), "pallas",
                    selective_scan_configs.TritonConfig(*v)))
    for v in [(32, 32, 256, 4, 2), (32, 32, 256, 4, 3), (64, 32, 256, 4, 2),
              (32, 16, 256, 2, 2)]:
      cases.append(("linear_scan", (b, t, d), "pallas", linear_scan_configs.TritonConfig(*v)))
    return [c for c in cases if c[0] in _OPS.value]
  for state in (16, 128):
    cases.append(("selective_scan", (b, t, d, state), "pallas", None))
    cases.append(("selective_scan", (b, t, d, state), "xla", None))
  for time in ((256, 1024) if small else (4096, 16384)):
    cases.append(("linear_scan", (b, time, d), "pallas", None))
    cases.append(("linear_scan", (b, time, d), "xla", None))
    cases.append(("linear_scan_lru", (b, time, d), "pallas", None))
    cases.append(("linear_scan_lru", (b, time, d), "xla", None))
  cases.append(("selective_scan", (b, 64 if small else 512, d, 16), "lax.scan", None))
  cases.append(("linear_scan", (b, 64 if small else 512, d), "lax.scan", None))
  return [c for c in cases if c[0].removesuffix("_lru") in _OPS.value]


def grid_cases(points) -> list:
  """(op, shape, impl, blocks) of the selective scan at the grid's points."""
  if "selective_scan" not in _OPS.value:
    return []
  return [("selective_scan", p.shape, impl, None) for p in points for impl in ("pallas", "xla")]


def time_kernels(cases, iters, sink, point_names=None):
  """Times each case, fwd and fwd+bwd; `point_names` maps a grid case's shape
  to its point's name (a field of its rows)."""
  rows = []
  for op, shape, impl, blocks in cases:
    if op == "selective_scan":
      args = workloads.selective_inputs(*shape)
      fn = _SELECTIVE[impl]
      default = selective_scan_configs.TritonConfig.get_default(*shape)
    else:
      args = workloads.linear_inputs(*shape)
      fn = _LINEAR[impl]
      default = linear_scan_configs.TritonConfig.get_default(*shape)
    if blocks is not None:
      fn = functools.partial(fn, blocks=blocks)
    used = (blocks or default) if impl == "pallas" else None
    if op == "linear_scan_lru":
      a, b = args
      args = (a[0, 0], jnp.real(b), jnp.imag(b))
      fns = _lru_case_fns(fn)
    else:
      fns = _case_fns(fn, len(args))
    for mode, f in fns.items():
      config = {"kind": "time", "op": op, "shape": shape, "impl": impl, "mode": mode,
                "blocks": None if used is None else str(used),
                "default_blocks": blocks is None}
      if point_names:
        config.update(grid="scan", point=point_names[shape])
      rows.append(sink(_time(config, f, args, iters)))
  return rows


def memory_case(small, iters):
  """T 16384, S 128: compiled temp memory and time, Pallas vs XLA, fwd+bwd."""
  rows = []
  shape = (2, 512, 16, 128) if small else (8, 16384, 256, 128)
  args = workloads.selective_inputs(*shape)
  for impl in ("pallas", "xla"):
    grad = _case_fns(_SELECTIVE[impl], 5)["fwd+bwd"]
    config = {"kind": "memory", "op": "selective_scan", "shape": shape, "impl": impl,
              "mode": "fwd+bwd"}
    try:
      analysis = grad.lower(*args).compile().memory_analysis()
      config["temp_mb"] = analysis.temp_size_in_bytes / 1e6
      config["output_mb"] = analysis.output_size_in_bytes / 1e6
      config["argument_mb"] = analysis.argument_size_in_bytes / 1e6
    except Exception as exc:  # Record a compile-time OOM and move on.
      config["temp_mb"] = None
      config["compile_message"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    rows.append(_time(config, grad, args, min(iters, 5)))
  return rows


def time_models(small, iters):
  import haiku as hk
  import optax
  import probjax_hk as pj
  rows = []
  batch, time = (2, 128) if small else (8, 4096)
  for cell_name in _CELLS.value:
    for impl in ("pallas", "xla"):
      for dtype in (jnp.bfloat16,):
        def forward(x, cell_name=cell_name, impl=impl):
          cell = {"lru": pj.LRUCell, "mamba": pj.MambaCell}[cell_name]
          return pj.SSMModel(16, 128, 16, 4, cell=cell,
                             cell_kwargs={"implementation": impl})(x)
        model = hk.without_apply_rng(hk.transform(forward))
        x = jax.random.normal(jax.random.key(0), (batch, time, 16), dtype)
        params = model.init(jax.random.key(1), x)
        opt = optax.adam(1e-3)
        opt_state = opt.init(params)

        def train_step(params, opt_state, x, model=model, opt=opt):
          def loss(p):
            return jnp.mean(jnp.square(model.apply(p, x).astype(jnp.float32) - 1.0))
          value, grads = jax.value_and_grad(loss)(params)
          updates, opt_state = opt.update(grads, opt_state, params)
          return optax.apply_updates(params, updates), opt_state, value

        base = {"kind": "model", "model": "SSMModel(16,128,16,4)", "cell": cell_name,
                "impl": impl, "dtype": jnp.dtype(dtype).name, "batch": batch, "time": time}
        rows.append(_time({**base, "mode": "fwd"}, jax.jit(model.apply), (params, x), iters))
        rows.append(_time({**base, "mode": "train_step"}, jax.jit(train_step),
                          (params, opt_state, x), iters))
        print(json.dumps(rows[-2:], default=str)[:500], flush=True)
  return rows


def summarize(rows):
  """Ratios XLA / Pallas per (op, shape, mode), from this run."""
  timed = {(r["op"], tuple(r["shape"]), r["impl"], r["mode"]): r.get("median_ms")
           for r in rows if r.get("kind") == "time" and r.get("default_blocks")
           and r.get("status") == "ok"}
  out = []
  for (op, shape, impl, mode), ms in sorted(timed.items()):
    if impl != "pallas":
      continue
    xla = timed.get((op, shape, "xla", mode))
    out.append({"kind": "ratio", "op": op, "shape": shape, "mode": mode,
                "pallas_ms": ms, "xla_ms": xla,
                "xla_over_pallas": None if not xla else xla / ms})
  return out


def main(argv):
  del argv
  small = _SMALL.value
  grid = _GRID.grid.value
  output = _OUTPUT.value
  if grid and not flags.FLAGS["output"].present:
    output = "/tmp/ssm_grid.json"
  rows = []

  def sink(row):
    """Prints each row as it completes and rewrites the JSON (a run cut short
    still leaves every finished row behind)."""
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    harness.write_rows(rows, output)
    return row

  if _GRID.check.value and not grid:
    raise app.UsageError("--grid_check checks the grid's points: give --grid too")
  if grid:
    for point in _GRID.points("scan", "smoke" if small else None):
      cases = grid_cases([point])
      if _GRID.check.value and cases:  # what is timed at the point, before timing it
        for row in check_scan("selective_scan", point.shape,
                              impls=[impl for _, _, impl, _ in cases],
                              fields={"grid": "scan", "point": point.name}):
          sink(row)
      time_kernels(cases, _ITERS.value, sink, {point.shape: point.name})
  elif _KERNELS.value:
    time_kernels(kernel_cases(small, sweep=False), _ITERS.value, sink)
  if _MEMORY.value and "selective_scan" in _OPS.value and not grid:
    for row in memory_case(small, _ITERS.value):
      sink(row)
  for row in check_numerics(small):
    sink(row)
  if _MODELS.value and not grid:
    for row in time_models(small, _ITERS.value):
      sink(row)
  if _SWEEP.value and not grid:
    time_kernels(kernel_cases(small, sweep=True), _ITERS.value, sink)
  for row in summarize(rows):
    sink(row)
  print(harness.format_table([r for r in rows if r["kind"] == "check"],
                             ["op", "point", "impl", "reverse", "status", "err_y", "err_final",
                              "err_grads"]))
  print(harness.format_table([r for r in rows if r["kind"] in ("time", "memory", "model")],
                             ["op", "cell", "shape", "impl", "mode", "blocks", "status",
                              "median_ms", "temp_mb"]))
  print(harness.format_table([r for r in rows if r["kind"] == "ratio"],
                             ["op", "shape", "mode", "pallas_ms", "xla_ms", "xla_over_pallas"]))
  if any(op in _OPS.value for op in _CHUNKED_OPS):
    flags_ = [f"--iters={_ITERS.value}", "--quick" if small else "--noquick",
              "--models" if _MODELS.value else "--nomodels"]
    name = "chunked_ops.json"
    if grid:
      name = "chunked_grid.json"
      flags_ += ["--grid", f"--grid_subset={_GRID.subset.value}",
                 f"--grid_stride={_GRID.stride.value}", f"--grid_offset={_GRID.offset.value}",
                 "--grid_check" if _GRID.check.value else "--nogrid_check"]
    harness.run_program("experiments.benchmark_kernel_ssd",
                        os.path.join(os.path.dirname(output), name), flags_)


if __name__ == "__main__":
  app.run(main)
