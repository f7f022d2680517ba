"""UNet benchmark: forward and train step, time and device memory, one process per case.

    python -m experiments.benchmark_unet    # docs/benchmarks/unet.json
    JAX_PLATFORMS=cpu python -m experiments.benchmark_unet --quick \
        --output /tmp/unet_cpu.json

Profile: `UNet(3, (64, 128, 256))` (2 residual blocks per level, attention at
the lowest resolution, 4 heads, GroupNorm 32), batch 8, resolutions 32, 64
and 128, float32 and bfloat16 inputs (parameters float32 throughout),
forward and train step. The train step is `probjax_hk.unet.make_train_step`:
the noise-prediction loss plus an Adam update, jitted. Then the bfloat16 train
step at resolution 64 three ways, side by side: plain, with
`remat_policy='full'` on every block, and with the parameter and
optimizer-state buffers donated.

Every case runs in a fresh process (`--single_case`, which prints one JSON
line), so `peak_mb`, the device allocator's peak, belongs to that case alone.
Each row also carries `planned_peak_mb`, XLA's buffer plan for one call
(arguments + outputs + temporaries - donated aliases). Train steps are called
the way a training loop calls them: each call's parameters and optimizer state
feed the next call (`harness.run_case(carry_outputs=2)`; necessarily so when
they are donated).

`--quick` is a CPU smoke run: a (8, 16) UNet, batch 2, resolution 8.

Cases not started within `--deadline_s` (default 300 s) are recorded as
skipped, the last one started gets at least 60 s, and the JSON is rewritten
after every case, so a run cut short keeps what it measured.
On a CUDA machine, from the repository root, with JAX for CUDA installed
(`pip install -e ".[cuda12]"`, or `.[cuda13]`):

    python -m experiments.benchmark_unet    # docs/benchmarks/unet.json
"""

import json
import math
import os
import subprocess
import time

from absl import app
from absl import flags
from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import harness
import probjax_hk as pk
from probjax_hk import unet as unet_lib

_OUTPUT = flags.DEFINE_string("output", "docs/benchmarks/unet.json",
                              "JSON output path (the curated suite file; another for trial runs).")
_RESOLUTIONS = flags.DEFINE_list("resolutions", ["32", "64", "128"], "Image sizes (square).")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Input dtypes.")
_MODES = flags.DEFINE_list("modes", ["forward", "train_step"], "What to time.")
_VARIANTS = flags.DEFINE_list("variants", ["plain", "remat", "donated"],
                              "Train-step variants compared at --variant_resolution, bf16.")
_VARIANT_RESOLUTION = flags.DEFINE_integer("variant_resolution", 64,
                                           "Resolution of the variant comparison.")
_REMAT_POLICY = flags.DEFINE_string("remat_policy", "full", "Policy of the 'remat' variant.")
_BATCH = flags.DEFINE_integer("batch", 8, "Batch size.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls per case.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls per case after compiling.")
_CASE_TIMEOUT = flags.DEFINE_integer("case_timeout_s", 300, "Time limit of one case's process.")
_DEADLINE = flags.DEFINE_integer("deadline_s", 300,
                                 "Cases not started by then are recorded as skipped.")
_QUICK = flags.DEFINE_bool("quick", False, "CPU smoke run: tiny UNet, batch 2, size 8.")
_SINGLE_CASE = flags.DEFINE_string("single_case", None,
                                   "Internal: run this JSON case here, print one JSON row.")

PROFILE = dict(in_channels=3, channels=[64, 128, 256], norm_groups=32, num_heads=4)
QUICK_PROFILE = dict(in_channels=3, channels=[8, 16], norm_groups=4, num_heads=2)


# --- one case (runs in its own process) ---------------------------------------


def _attention_implementation(config: dict, dtype) -> str:
  """What `dot_product_attention` picks for the lowest level's blocks."""
  channels = config["channels"]
  side = config["resolution"] // 2 ** (len(channels) - 1)
  heads = config["num_heads"]
  q = jax.ShapeDtypeStruct((config["batch"], side * side, heads, channels[-1] // heads), dtype)
  return pk.choose_attention_implementation(q, q, q)


def _host_params(shapes, seed: int = 0):
  """Parameters of the shapes `model.init` would give, drawn with numpy.

  (Haiku's truncated-normal initializers compile once per parameter shape; a
  jitted `model.init` of this UNet compiles for longer than a case does.)
  Weights are uniform with variance 1 / fan-in, norm scales one, vectors zero.
  """
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    if leaf.ndim >= 2:
      bound = math.sqrt(3.0 / math.prod(leaf.shape[:-1]))
      value = rng.uniform(-bound, bound, leaf.shape)
    elif jax.tree_util.keystr(path).endswith("'scale']"):
      value = np.ones(leaf.shape)
    else:
      value = np.zeros(leaf.shape)
    return jnp.asarray(value, leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def run_single_case(config: dict) -> dict:
  """Builds, compiles, times and measures one case in this process."""
  dtype = jnp.dtype(config["dtype"])
  remat_policy = config["remat_policy"] if config["variant"] == "remat" else None
  model = hk.transform(lambda x, t: pk.UNet(
      config["in_channels"], tuple(config["channels"]), norm_groups=config["norm_groups"],
      num_heads=config["num_heads"], remat_policy=remat_policy)(x, t))
  size, batch = config["resolution"], config["batch"]
  holder = {}

  def build():
    kx, kt, kp = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (batch, size, size, config["in_channels"]), dtype)
    t = jax.random.uniform(kt, (batch,)) * 1000.0
    start = time.perf_counter()
    params = _host_params(jax.eval_shape(model.init, kp, x, t))
    holder["init_s"] = time.perf_counter() - start
    holder["num_params"] = sum(p.size for p in jax.tree.leaves(params))
    if config["mode"] == "forward":
      return jax.jit(model.apply), (params, None, x, t)
    optimizer = optax.adam(1e-4)
    step = unet_lib.make_train_step(model, optimizer, donate=config["variant"] == "donated")
    return step, (params, optimizer.init(params), jax.random.key(1), x)

  row = harness.run_case(config, build, warmup=config["warmup"], iters=config["iters"],
                         carry_outputs=2 if config["mode"] == "train_step" else 0)
  row["peak_mb"] = harness.peak_memory_mb()
  row.update(holder)
  row["attention"] = _attention_implementation(config, dtype)
  row["device_kind"] = jax.devices()[0].device_kind
  return row


# --- the grid (this process never touches a device) ---------------------------


def _cases() -> list[dict]:
  profile = QUICK_PROFILE if _QUICK.value else PROFILE
  batch = 2 if _QUICK.value else _BATCH.value
  resolutions = [8] if _QUICK.value else [int(r) for r in _RESOLUTIONS.value]
  variant_resolution = _variant_resolution()
  common = dict(profile, batch=batch, remat_policy=_REMAT_POLICY.value,
                iters=2 if _QUICK.value else _ITERS.value,
                warmup=1 if _QUICK.value else _WARMUP.value)
  cases = []
  # The variants follow the grid rows of their resolution, so that a run cut
  # short by --deadline_s still holds the side-by-side comparison.
  for resolution in sorted(set(resolutions) | {variant_resolution}):
    if resolution in resolutions:
      for dtype in _DTYPES.value:
        for mode in _MODES.value:
          cases.append(dict(common, resolution=resolution, dtype=dtype, mode=mode,
                            variant="plain"))
    if resolution == variant_resolution:
      for variant in _VARIANTS.value:
        case = dict(common, resolution=resolution, dtype="bfloat16", mode="train_step",
                    variant=variant)
        if case not in cases:
          cases.append(case)
  return cases


def _variant_resolution() -> int:
  return 8 if _QUICK.value else _VARIANT_RESOLUTION.value


def _is_variant_row(row: dict) -> bool:
  return (row.get("resolution") == _variant_resolution() and row.get("dtype") == "bfloat16"
          and row.get("mode") == "train_step" and row.get("variant") in _VARIANTS.value)


def _add_ratios(rows: list[dict]) -> None:
  """Time and memory of each variant over the plain step's."""
  plain = next((r for r in rows if _is_variant_row(r) and r["variant"] == "plain"
                and r.get("status") == "ok"), None)
  if plain is None:
    return
  for row in rows:
    if _is_variant_row(row) and row.get("status") == "ok":
      row["time_vs_plain"] = row["median_ms"] / plain["median_ms"]
      for key in ("peak", "planned_peak"):
        if row.get(f"{key}_mb") and plain.get(f"{key}_mb"):
          row[f"{key}_vs_plain"] = row[f"{key}_mb"] / plain[f"{key}_mb"]


def _write_partial(rows: list[dict]) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(_OUTPUT.value)), exist_ok=True)
  with open(_OUTPUT.value, "w") as f:
    json.dump({"environment": "partial run: see the rows' device_kind", "rows": rows}, f,
              indent=1)


def main(argv):
  del argv
  if _SINGLE_CASE.value is not None:
    print(json.dumps(run_single_case(json.loads(_SINGLE_CASE.value))), flush=True)
    return
  rows = []
  start = time.perf_counter()
  for config in _cases():
    elapsed = time.perf_counter() - start
    if elapsed > _DEADLINE.value:
      rows.append({**config, "status": "unsup",
                   "message": f"skipped: --deadline_s={_DEADLINE.value} passed ({elapsed:.0f} s)"})
      continue
    case_start = time.perf_counter()
    try:
      row = harness.run_in_fresh_process(
          "experiments.benchmark_unet", ["--single_case", json.dumps(config)],
          timeout_s=min(_CASE_TIMEOUT.value, max(_DEADLINE.value - elapsed, 60)))
    except subprocess.TimeoutExpired as e:
      row = {"status": "error", "message": f"case process timed out after {e.timeout} s"}
    row = {**config, **row}
    row["process_s"] = time.perf_counter() - case_start
    logging.info("%s", {k: v for k, v in row.items() if k != "traceback"})
    rows.append(row)
    # Written after every case, so a run cut short keeps what it measured. The
    # parent process never touches a device (environment() would, so it is
    # only recorded at the end).
    _write_partial(rows)
  _add_ratios(rows)
  logging.info("all cases: %.1f s", time.perf_counter() - start)
  harness.write_rows(rows, _OUTPUT.value)
  grid = [r for r in rows if r["variant"] == "plain"]
  print(harness.format_table(grid, ["resolution", "dtype", "mode", "status", "median_ms",
                                    "peak_mb", "planned_peak_mb", "compile_s", "attention"]))
  print()
  print(harness.format_table([r for r in rows if _is_variant_row(r)],
                             ["resolution", "dtype", "variant", "status", "median_ms",
                              "time_vs_plain", "peak_mb", "peak_vs_plain",
                              "planned_peak_mb", "planned_peak_vs_plain"]))
  print(f"\n{len(rows)} cases in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  app.run(main)
