r"""Speculative decoding of the lm job's character model: acceptance and speed-up.

Reads two checkpoints of `experiments.train --model=lm`: the model (the
job's default, a causal Transformer of width 64 with 2 blocks) and a draft
trained the same way, 4 times narrower with 1 block. Then, on
`--num_prompts` windows of `--prompt_length` bytes cut from the held-out
text (`train.LM_VALIDATION_MODULES`), it times `pk.generate` of
`--sample_length` bytes without a draft and with it, for each of
`--num_draft_tokens` and `--temperatures` (0 decodes greedily; others sample
with a fixed key), one prompt per call (B = 1) and all of them in one call:

    JAX_PLATFORMS=cpu python -m experiments.train --model=lm --steps=300 \
        --output_dir=/tmp/lm
    JAX_PLATFORMS=cpu python -m experiments.train --model=lm --steps=300 \
        --model_dim=16 --num_layers=1 --output_dir=/tmp/lm_draft
    JAX_PLATFORMS=cpu python -m experiments.benchmark_speculative \
        --model_dir=/tmp/lm --draft_dir=/tmp/lm_draft

`--model_dim`, `--num_layers`, `--num_heads`, `--ssm_cell` and `--dtype`
are the train job's flags and describe the model (`--sample_length` is its
too); the `--draft_*` flags describe the draft. One row per batch size,
temperature and K (0: without a draft): the median over `--iters` rounds
(after one that compiles; each round times every K in turn, so a shared
machine's load drifts across all alike) of the total time over the
prompts, `tokens_per_s` (generated tokens over that time), `speedup` (the
time without a draft over the time with it) and `acceptance_rate` (the
mean over the prompts of the fraction of draft tokens the model kept).
Then the cost of one call of each model, the reason for those times: a step
of the model and of the draft, and a call of the model on K + 1 tokens after
a prompt (what a round's scoring costs). The rows are printed, and written as
JSON to `--output` when it is given.
"""

import json
import os
import statistics
import time

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from experiments import train
import probjax_hk as pk

_MODEL_DIR = flags.DEFINE_string("model_dir", None, "The model's train --output_dir.",
                                 required=True)
_DRAFT_DIR = flags.DEFINE_string("draft_dir", None, "The draft's train --output_dir.",
                                 required=True)
_DRAFT_MODEL_DIM = flags.DEFINE_integer("draft_model_dim", 16, "The draft's width.",
                                        lower_bound=1)
_DRAFT_NUM_LAYERS = flags.DEFINE_integer("draft_num_layers", 1, "The draft's blocks.",
                                         lower_bound=1)
_DRAFT_NUM_HEADS = flags.DEFINE_integer("draft_num_heads", 4, "The draft's heads.",
                                        lower_bound=1)
_DRAFT_SSM_CELL = flags.DEFINE_enum("draft_ssm_cell", None, list(train.SSM_CELLS),
                                    "An SSMModel draft with this cell instead of a Transformer.")
_NUM_DRAFT_TOKENS = flags.DEFINE_list("num_draft_tokens", ["2", "4", "6"],
                                      "K values: draft tokens per round.")
_TEMPERATURES = flags.DEFINE_list("temperatures", ["0", "0.8"],
                                  "Temperatures (0: greedy).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "Prompts from the held-out text.",
                                    lower_bound=1)
_PROMPT_LENGTH = flags.DEFINE_integer("prompt_length", 64, "Bytes per prompt.",
                                      lower_bound=1)
_ITERS = flags.DEFINE_integer("iters", 5, "Timed calls per row (after one that compiles).",
                              lower_bound=1)
_OUTPUT = flags.DEFINE_string("output", None, "A JSON file for the rows (default: none).")


def _params(directory: str):
  return pk.load_checkpoint(os.path.join(directory, "checkpoints")).params


def _prompts(num: int, length: int) -> np.ndarray:
  """[num, length] int32 windows of the held-out text, evenly spaced."""
  text = train.stdlib_text(train.LM_VALIDATION_MODULES)
  starts = np.linspace(0, len(text) - length, num).astype(int)
  return np.stack([text[s:s + length] for s in starts]).astype(np.int32)


def _timed(calls: dict, batches, iters: int) -> tuple[dict, dict]:
  """Each of `calls` over all `batches`, once untimed, then `iters` rounds
  that run every call in turn (a shared machine's load drifts across all
  alike): (the median seconds per call, each call's last outputs)."""
  outputs = {name: [jax.block_until_ready(call(b)) for b in batches]
             for name, call in calls.items()}
  times = {name: [] for name in calls}
  for _ in range(iters):
    for name, call in calls.items():
      start = time.perf_counter()
      outputs[name] = [jax.block_until_ready(call(b)) for b in batches]
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}, outputs


def _call_seconds(model_fn, params, prompt, num_new: int, max_length: int, iters: int,
                  calls: int = 100) -> float:
  """Seconds of one call of the model on `num_new` tokens after `prompt`
  [1, T] with a state of `max_length`: `step` for 1, `prefill` on its state
  otherwise (the median over `iters` compiled loops of `calls` calls)."""
  prefill = hk.without_apply_rng(hk.transform(
      lambda tokens, state=None: model_fn().prefill(tokens, state, max_length=max_length))).apply
  step = hk.without_apply_rng(hk.transform(
      lambda tokens, state: model_fn().step(tokens, state))).apply

  @jax.jit
  def loop(params):
    _, state = prefill(params, prompt)
    def call(_, carry):
      token, before = carry
      tokens = jnp.broadcast_to(token[:, None], (1, num_new))
      if num_new == 1:
        logits, after = step(params, tokens[:, 0], before)
      else:
        logits, after = prefill(params, tokens, before)
      # The next token depends on this call's output, so no call is skipped.
      token = jnp.argmax(logits.reshape(1, -1, logits.shape[-1])[:, -1], -1).astype(jnp.int32)
      return token, after._replace(lengths=before.lengths)
    return jax.lax.fori_loop(0, calls, call, (prompt[:, -1], state))[0]

  seconds, _ = _timed({"loop": lambda b: loop(params)}, [None], iters)
  return seconds["loop"] / calls


def main(argv):
  del argv
  job = flags.FLAGS  # the train job's flags describe the model
  dtype = jnp.dtype(job.dtype)
  _, model_fn = train.make_lm(train.model_dim_of("lm", job.model_dim), job.num_heads,
                              job.num_layers, job.ssm_cell, dtype)
  _, draft_fn = train.make_lm(_DRAFT_MODEL_DIM.value, _DRAFT_NUM_HEADS.value,
                              _DRAFT_NUM_LAYERS.value, _DRAFT_SSM_CELL.value, dtype)
  params, draft_params = _params(_MODEL_DIR.value), _params(_DRAFT_DIR.value)
  prompts = _prompts(_NUM_PROMPTS.value, _PROMPT_LENGTH.value)
  num_tokens, iters = job.sample_length, _ITERS.value
  draft_tokens = [int(k) for k in _NUM_DRAFT_TOKENS.value]
  rows = []
  for batch_size in (1, len(prompts)):
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    for temperature in map(float, _TEMPERATURES.value):
      options = dict(temperature=temperature, rng=None if temperature == 0 else 0)
      calls = {0: lambda b: pk.generate(model_fn, params, b, num_tokens, **options)}
      for k in draft_tokens:
        calls[k] = lambda b, k=k: pk.generate(
            model_fn, params, b, num_tokens, draft_model_fn=draft_fn,
            draft_params=draft_params, num_draft_tokens=k, return_acceptance_rate=True,
            **options)
      seconds, outputs = _timed(calls, batches, iters)
      for k in calls:
        row = dict(batch_size=batch_size, temperature=temperature, num_draft_tokens=k,
                   seconds=seconds[k], tokens_per_s=len(prompts) * num_tokens / seconds[k])
        if k:
          rates = np.concatenate([np.asarray(rate) for _, rate in outputs[k]])
          row.update(speedup=seconds[0] / seconds[k], acceptance_rate=float(np.nanmean(rates)))
        rows.append(row)
        print(json.dumps(row))
  # One call of each model, with the cache of the plain and the speculative loop.
  prompt, length = prompts[:1], prompts.shape[1] + num_tokens - 1
  costs = {"model_step_s": _call_seconds(model_fn, params, prompt, 1, length, iters),
           "draft_step_s": _call_seconds(draft_fn, draft_params, prompt, 1, length, iters)}
  for k in draft_tokens:
    costs[f"model_call_{k + 1}_tokens_s"] = _call_seconds(model_fn, params, prompt, k + 1,
                                                         length + k, iters)
  print(json.dumps(costs))
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f:
      json.dump({"cpu_count": os.cpu_count(), "device": jax.devices()[0].device_kind,
                 "num_prompts": len(prompts), "prompt_length": _PROMPT_LENGTH.value,
                 "sample_length": num_tokens, "rows": rows, "calls": costs}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
