"""Stack-level benchmarks: scan_layers x remat_policy (compile, step, peak memory).

    python -m experiments.benchmark_kernel_nn --device gpu --peak  # docs/benchmarks/scan_remat.json
    JAX_PLATFORMS=cpu python -m experiments.benchmark_kernel_nn --device cpu \
        --output /tmp/scan_remat_cpu.json

A 24-layer, width-512 Transformer (8 heads of 64), batch 2, Adam, at 4096
tokens in bf16 on the GPU and 512 tokens in float32 on the CPU. Rows: remat_policy in None /
'full' / 'dots_saveable' / 'nothing_saveable' x scan_layers off/on with the
default attention, plus einsum attention (`implementation='xla'`) unrolled
without remat and scanned with 'nothing_saveable', and on the GPU cuDNN's attention
unrolled without remat and scanned with 'full'. `compile_s` runs from the Python
function to the executable, `lower_s` is its tracing and lowering part (rows in
`harness.run_case`). With `--peak` every case
runs in its own process so that its device memory peak
(`memory_stats()['peak_bytes_in_use']`) is its own.

`--sections` adds the other benchmark programs, each run in its own process
and writing its suite's file beside `--output` (`SECTION_PROGRAMS`): unet
(plain / remat / donated train steps), training_loop (fit() against a bare
jitted step; `--part` is an alias of `--sections`), attention, ssm, ssd and
moe (the kernel benchmarks of their issues). On `--device cpu` they get their
small smoke-test flags.
"""

import functools
import json
import os
import time

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import optax

from experiments import harness
import probjax_hk as pk

_DEVICE = flags.DEFINE_enum("device", "gpu", ["gpu", "cpu"], "Which profile to run.")
_OUTPUT = flags.DEFINE_string("output", "docs/benchmarks/scan_remat.json",
                              "JSON output path (the curated suite file; another for trial runs).")
_PEAK = flags.DEFINE_bool("peak", False, "Run each case in a fresh process and record its peak.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed steps per case.")
_SINGLE_CASE = flags.DEFINE_string("single_case", None, "Internal: run one JSON config, print its row.")
_SECTIONS = flags.DEFINE_list("sections", ["scan_remat"],
                              "scan_remat and any of: " + ", ".join(
                                  ["unet", "training_loop", "attention", "ssm", "ssd",
                                   "moe"]))
flags.DEFINE_alias("part", "sections")

# section -> (program, its suite's file, extra flags per device).
SECTION_PROGRAMS = {
    "unet": ("experiments.benchmark_unet", "unet.json", {"cpu": ["--quick"]}),
    "training_loop": ("experiments.benchmark_fit", "fit.json",
                      {"cpu": ["--steps=20", "--calls_steps=5", "--seq_len=64",
                               "--model_dim=64"]}),
    "attention": ("experiments.benchmark_kernel_attention", "attention.json",
                  {"gpu": ["--check"]}),
    "ssm": ("experiments.benchmark_kernel_ssm", "ssm_scans.json",
            {"cpu": ["--small"], "gpu": ["--models"]}),
    "ssd": ("experiments.benchmark_kernel_ssd", "chunked_ops.json", {"cpu": ["--quick"]}),
    "moe": ("experiments.benchmark_kernel_moe", "moe.json",
            {"cpu": ["--tokens=256", "--gmm_rows=512"]}),
}

NUM_LAYERS, MODEL_DIM, NUM_HEADS, BATCH = 24, 512, 8, 2
TOKENS = {"gpu": 4096, "cpu": 512}
# XLA:CPU emulates bf16 matrix products (about 60 x slower than f32 there), so
# the CPU profile runs in float32.
DTYPES = {"gpu": "bfloat16", "cpu": "float32"}

# (attention, remat_policy, scan_layers)
CASES = [("default", policy, scan)
         for policy in (None, "full", "dots_saveable", "nothing_saveable")
         for scan in (False, True)] + [("xla", None, False), ("xla", "nothing_saveable", True)]
# cuDNN's attention has no Pallas kernel to lower or compile: its pair shows what
# scan does to the compile time of the rest of the program.
GPU_CASES = CASES + [("cudnn", None, False), ("cudnn", "full", True)]


def stack_case(config: dict):
  """Builds the train step of one configuration: returns (step, args)."""
  implementation = None if config["attention"] == "default" else config["attention"]
  attention_fn = functools.partial(pk.dot_product_attention, implementation=implementation)
  model = hk.transform(lambda x: pk.Transformer(
      MODEL_DIM, NUM_HEADS, NUM_LAYERS, attention_fn=attention_fn, is_causal=True,
      remat_policy=config["remat_policy"], scan_layers=config["scan_layers"])(x))
  x = jax.random.normal(jax.random.key(1), (BATCH, config["tokens"], MODEL_DIM),
                        jnp.dtype(config["dtype"]))
  params = model.init(jax.random.key(0), x)
  optimizer = optax.adam(1e-4)
  opt_state = optimizer.init(params)

  def loss_fn(p, x):
    return jnp.mean(jnp.square(model.apply(p, None, x).astype(jnp.float32)))

  # Donated like a real training step: the plan then counts one copy of the
  # parameters and optimizer state, not an input and an output copy.
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(p, s, x):
    loss, grads = jax.value_and_grad(loss_fn)(p, x)
    updates, s = optimizer.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss

  return step, (params, opt_state, x)


def run_stack_case(config: dict) -> dict:
  row = harness.run_case(config, lambda: stack_case(config), iters=_ITERS.value,
                         carry_outputs=2)
  row["peak_mb"] = harness.peak_memory_mb()
  return row


def main(argv):
  del argv
  if _SINGLE_CASE.value:
    print(json.dumps(run_stack_case(json.loads(_SINGLE_CASE.value))))
    return
  unknown = set(_SECTIONS.value) - {"scan_remat", *SECTION_PROGRAMS}
  if unknown:
    raise ValueError(f"--sections: unknown {sorted(unknown)}; choose from "
                     f"{['scan_remat', *SECTION_PROGRAMS]}")
  for section in _SECTIONS.value:
    if section in SECTION_PROGRAMS:
      _run_section_program(section)
  if "scan_remat" in _SECTIONS.value:
    _run_scan_remat()


def _run_section_program(section: str) -> None:
  """Runs another benchmark program in its own process, next to --output."""
  program, file, extra = SECTION_PROGRAMS[section]
  directory = os.path.dirname(os.path.abspath(_OUTPUT.value))
  os.makedirs(directory, exist_ok=True)
  harness.run_program(program, os.path.join(directory, file), extra.get(_DEVICE.value, []))


def _run_scan_remat() -> None:
  tokens = TOKENS[_DEVICE.value]
  rows = []
  for attention, policy, scan in GPU_CASES if _DEVICE.value == "gpu" else CASES:
    config = dict(section="scan_remat", attention=attention, remat_policy=policy,
                  scan_layers=scan, tokens=tokens, num_layers=NUM_LAYERS,
                  model_dim=MODEL_DIM, batch=BATCH, dtype=DTYPES[_DEVICE.value])
    start = time.perf_counter()
    if _PEAK.value:
      row = harness.run_in_fresh_process(
          "experiments.benchmark_kernel_nn",
          [f"--single_case={json.dumps(config)}", f"--iters={_ITERS.value}"])
      row = {**config, **row}
    else:
      row = run_stack_case(config)
    row["wall_s"] = time.perf_counter() - start
    print(json.dumps(row), flush=True)
    rows.append(row)
    if _OUTPUT.value:
      harness.write_rows(rows, _OUTPUT.value)  # A killed run keeps its rows.
  _summarize(rows)
  if _OUTPUT.value:
    harness.write_rows(rows, _OUTPUT.value)
  print(harness.format_table(rows, ["attention", "remat_policy", "scan_layers", "status",
                                    "lower_s", "compile_s", "compile_vs_unrolled",
                                    "median_ms", "planned_peak_mb", "peak_mb"]))


def _summarize(rows):
  """Adds each row's ratios to the unrolled, no-remat, default-attention row;
  the compile time's to the unrolled, no-remat row of its own attention."""
  unrolled = {r["attention"]: r for r in rows if r["remat_policy"] is None
              and not r["scan_layers"] and r.get("status") == "ok"}
  base = unrolled.get("default")
  if base is None:
    return
  for r in rows:
    if r.get("status") != "ok":
      continue
    r["compile_vs_unrolled"] = unrolled.get(r["attention"], base)["compile_s"] / r["compile_s"]
    r["step_vs_unrolled"] = r["median_ms"] / base["median_ms"]
    if r.get("peak_mb") and base.get("peak_mb"):
      r["peak_vs_unrolled"] = r["peak_mb"] / base["peak_mb"]


if __name__ == "__main__":
  app.run(main)
