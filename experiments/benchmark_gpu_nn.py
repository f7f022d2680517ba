"""The model grid: forward and train step of every model, per attention and dtype.

    python -m experiments.benchmark_gpu_nn    # docs/benchmarks/models.json
    JAX_PLATFORMS=cpu python -m experiments.benchmark_gpu_nn --tokens 128 \
        --output /tmp/gpu_nn_cpu.json

Standard profile: batch 8, width 256, 8 heads of 32, 4 layers. One JSON row
per (model, attention or op implementation, dtype, tokens, mode) with `status` in
ok | OOM | fail | unsup | error; a failing case records its row and the grid
moves on. The train step is `jax.value_and_grad` of a mean-square loss plus an
Adam update, with the parameter and optimizer buffers donated.

`unet` and `moe` in `--models` run their own programs in a child process
(`benchmark_unet`: one fresh process per case for the memory peak;
`benchmark_kernel_moe --sections moe`: MoELayer per `dropless_impl`), writing
their suites' files, `unet.json` / `moe.json`, beside `--output`.
"""

import os

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp

from experiments import harness
from experiments import model_steps

_OUTPUT = flags.DEFINE_string("output", "docs/benchmarks/models.json",
                              "JSON output path (the curated suite file; another for trial runs).")
_MODELS = flags.DEFINE_list("models", ["transformer", "dit"],
                            "Models to run: transformer, dit, ssm_lru, ssm_mamba, "
                            "ssm_ssd, ssm_mamba2, ssm_gated_delta_net, unet, moe.")
_ATTENTION = flags.DEFINE_list("attention", ["default", "xla", "cudnn"],
                               "Attention implementations ('default' = None).")
_SSM_IMPLEMENTATION = flags.DEFINE_list(
    "ssm_implementation", ["default", "xla"],
    "SSM op implementations ('default' = None, 'pallas', 'xla').")
_DTYPE = flags.DEFINE_list("dtype", ["bfloat16", "float32"], "Input dtypes.")
_TOKENS = flags.DEFINE_list("tokens", ["1024", "4096"], "Sequence lengths.")
_BATCH = flags.DEFINE_integer("batch", 8, "Batch size.")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls per case.")

# Models benchmarked by their own program: name -> (module, extra flags, and
# the flags of a small CPU smoke run).
PROGRAMS = {
    "unet": ("experiments.benchmark_unet", lambda: [f"--dtypes={','.join(_DTYPE.value)}"],
             ["--quick"]),
    "moe": ("experiments.benchmark_kernel_moe", lambda: ["--sections=moe"], ["--tokens=256"]),
}


def _run_program(model_name: str) -> None:
  module, extra, cpu_extra = PROGRAMS[model_name]
  program_flags = extra() + (cpu_extra if jax.default_backend() == "cpu" else [])
  # The model's name is its suite's: unet.json, moe.json.
  harness.run_program(module, os.path.join(os.path.dirname(_OUTPUT.value), f"{model_name}.json"),
                      program_flags)


def main(argv):
  del argv
  unknown = set(_MODELS.value) - set(model_steps.MODELS) - set(PROGRAMS)
  if unknown:
    raise ValueError(f"--models: unknown {sorted(unknown)}; choose from "
                     f"{sorted(model_steps.MODELS) + sorted(PROGRAMS)}")
  rows = []
  for model_name in _MODELS.value:
    if model_name in PROGRAMS:
      _run_program(model_name)
      continue
    for dtype_name in _DTYPE.value:
      dtype = jnp.dtype(dtype_name)
      for tokens in map(int, _TOKENS.value):
        # The attention implementation, or the SSM cell's op implementation.
        is_attention = model_name in model_steps.ATTENTION_MODELS
        key = "attention" if is_attention else "implementation"
        for choice in _ATTENTION.value if is_attention else _SSM_IMPLEMENTATION.value:
          for mode, builder in (("forward", model_steps.build_forward),
                                ("train_step", model_steps.build_train_step)):
            config = dict(model=model_name, dtype=dtype_name, tokens=tokens,
                          batch=_BATCH.value, mode=mode, **{key: choice})
            row = harness.run_case(config, builder(model_name, choice, _BATCH.value,
                                                   tokens, dtype), iters=_ITERS.value,
                                   carry_outputs=2 if mode == "train_step" else 0)
            logging.info("%s", row)
            rows.append(row)
            harness.write_rows(rows, _OUTPUT.value)  # A killed run keeps its rows.
  print(harness.format_table(rows, ["model", "attention", "implementation", "dtype",
                                    "tokens", "mode", "status", "median_ms", "compile_s"]))


if __name__ == "__main__":
  app.run(main)
