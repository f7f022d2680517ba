"""The model grid: forward and train step of every model, per attention and dtype.

    python -m experiments.benchmark_gpu_nn --output docs/benchmarks/gpu_nn.json
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
`<output stem>_unet.json` / `_moe.json` beside `--output`.
"""

import functools
import os
from typing import Callable

from absl import app
from absl import flags
from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import optax

from experiments import harness
import probjax_hk as pk

_OUTPUT = flags.DEFINE_string("output", "docs/benchmarks/gpu_nn.json", "JSON output path.")
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

MODEL_DIM, NUM_HEADS, NUM_LAYERS = 256, 8, 4


def _implementation(name: str) -> str | None:
  """A flag value ('default', 'pallas', 'xla', ...) as an `implementation` argument."""
  return None if name == "default" else name


def _attention_fn(attention: str) -> Callable:
  return functools.partial(pk.dot_product_attention, implementation=_implementation(attention))


def transformer_case(attention_fn, batch, tokens, dtype):
  model = hk.transform(lambda x, t: pk.Transformer(
      MODEL_DIM, NUM_HEADS, NUM_LAYERS, attention_fn=attention_fn)(x))
  x = jax.random.normal(jax.random.key(1), (batch, tokens, MODEL_DIM), dtype)
  return model, (x, jnp.zeros((batch,)))


def dit_case(attention_fn, batch, tokens, dtype):
  model = hk.transform(lambda x, t: pk.DiffusionTransformer(
      MODEL_DIM, NUM_HEADS, NUM_LAYERS, attention_fn=attention_fn)(x, t))
  x = jax.random.normal(jax.random.key(1), (batch, tokens, MODEL_DIM), dtype)
  return model, (x, jax.random.uniform(jax.random.key(2), (batch,)) * 1000)


def ssm_case(cell_name, **cell_kwargs):
  """SSMModel(16, 128, 16, 4), the SSM benchmark profile, with one cell.

  The case's `implementation` ('default', 'pallas', 'xla') goes to the cell's
  scan op.
  """
  def case(implementation, batch, tokens, dtype):
    cell = getattr(pk, cell_name)
    kwargs = dict(cell_kwargs, implementation=_implementation(implementation))
    model = hk.transform(lambda x, t: pk.SSMModel(16, 128, 16, 4, cell=cell,
                                                  cell_kwargs=kwargs)(x))
    x = jax.random.normal(jax.random.key(1), (batch, tokens, 16), dtype)
    return model, (x, jnp.zeros((batch,)))
  return case


# name -> (attention_fn or SSM implementation, batch, tokens, dtype)
#      -> (transformed model, inputs).
MODELS = {
    "transformer": transformer_case,
    "dit": dit_case,
    "ssm_lru": ssm_case("LRUCell"),
    "ssm_mamba": ssm_case("MambaCell"),
    "ssm_ssd": ssm_case("SSDCell", num_heads=2),  # heads of 64
    "ssm_mamba2": ssm_case("Mamba2Cell"),
    "ssm_gated_delta_net": ssm_case("GatedDeltaNetCell", num_heads=2),
}
# Models with attention run once per --attention value, the SSMs once per
# --ssm_implementation value.
ATTENTION_MODELS = ("transformer", "dit")


def _check_attention(attention, tokens, batch, dtype):
  """Raises harness.Unsupported when the attention cannot take this case."""
  q = jax.ShapeDtypeStruct((batch, tokens, NUM_HEADS, MODEL_DIM // NUM_HEADS), dtype)
  try:
    pk.choose_attention_implementation(q, q, q, implementation=_implementation(attention))
  except ValueError as e:
    raise harness.Unsupported(str(e)) from e


def _make_case(model_name, choice, batch, tokens, dtype):
  """`choice`: the attention implementation or, for an SSM, the op implementation."""
  if model_name in ATTENTION_MODELS:
    _check_attention(choice, tokens, batch, dtype)
    choice = _attention_fn(choice)
  return MODELS[model_name](choice, batch, tokens, dtype)


def build_forward(model_name, choice, batch, tokens, dtype):
  def build():
    model, inputs = _make_case(model_name, choice, batch, tokens, dtype)
    params = model.init(jax.random.key(0), *inputs)
    return jax.jit(lambda p, *a: model.apply(p, None, *a)), (params, *inputs)
  return build


def build_train_step(model_name, choice, batch, tokens, dtype):
  def build():
    model, inputs = _make_case(model_name, choice, batch, tokens, dtype)
    params = model.init(jax.random.key(0), *inputs)
    optimizer = optax.adam(1e-4)
    opt_state = optimizer.init(params)

    def loss_fn(p, *a):
      out = model.apply(p, None, *a)
      return jnp.mean(jnp.square(out.astype(jnp.float32)))

    # Donated as in training; the harness feeds each call's state to the next.
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, *a):
      loss, grads = jax.value_and_grad(loss_fn)(p, *a)
      updates, s = optimizer.update(grads, s, p)
      return optax.apply_updates(p, updates), s, loss

    return step, (params, opt_state, *inputs)
  return build


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
  harness.run_program(module, f"{os.path.splitext(_OUTPUT.value)[0]}_{model_name}.json",
                      program_flags)


def main(argv):
  del argv
  unknown = set(_MODELS.value) - set(MODELS) - set(PROGRAMS)
  if unknown:
    raise ValueError(f"--models: unknown {sorted(unknown)}; choose from "
                     f"{sorted(MODELS) + sorted(PROGRAMS)}")
  rows = []
  for model_name in _MODELS.value:
    if model_name in PROGRAMS:
      _run_program(model_name)
      continue
    for dtype_name in _DTYPE.value:
      dtype = jnp.dtype(dtype_name)
      for tokens in map(int, _TOKENS.value):
        # The attention implementation, or the SSM cell's op implementation.
        is_attention = model_name in ATTENTION_MODELS
        key = "attention" if is_attention else "implementation"
        for choice in _ATTENTION.value if is_attention else _SSM_IMPLEMENTATION.value:
          for mode, builder in (("forward", build_forward), ("train_step", build_train_step)):
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
