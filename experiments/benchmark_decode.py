"""Decoding on one GPU: the split-K attention kernel, and generation end to end.

Sections (`--sections`, one JSON row each, `section` says which):

- kernel: `ops.decode_attention` (T new tokens per sequence against a KV
  cache of S slots, every sequence `--fill` full) with its Pallas kernel and
  its XLA path, `jax.nn.dot_product_attention` on the same cache
  (implementation='xla', the plain masked attention, and 'cudnn' where cuDNN
  takes the call), and the bandwidth floor: the cache bytes the call must
  read over `--bandwidth_tbps`. Defaults: bf16, K = 8 key/value heads of
  H = 128, N = 32 query heads, S = 4,096 and 32,768, B = 1, 8 and 64. One
  summary row per shape with the ratios. With --check the kernel is first
  compared with the float32 reference on the device (T in {1, 4}, GQA and
  MHA, lengths that vary per sequence, a window).
- generate: `probjax_hk.generate` end to end on `TokenModel`s over a
  `--vocab_size` vocabulary with random parameters (throughput does not
  depend on training), parameters cast to `--dtype` so that the models
  compute in it: `Transformer(1024, 16, 8, num_kv_heads=4, is_causal=True,
  use_rope=True)` with its default attention (`pk.dot_product_attention`,
  the kernels of its dispatch; 'transformer') and with XLA attention
  (`implementation='xla'`; 'transformer_xla'), against `SSMModel`s of
  `Mamba2Cell` ('mamba2') and of `GatedDeltaNetCell` ('gated_deltanet') of
  the same width, whose depth is the one that brings the parameter count of
  their body (the sequence model, `body_params`) nearest the Transformer's
  (`params_vs_transformer`; `params` adds the embedding and the vocabulary
  projection), at B = 1 and 32, a 1,024-token random prompt and G = 512
  generated tokens, sampled at `--temperature` with a fixed key. Per model
  and batch: `prefill` times the prompt's prefill alone (one compiled call
  returning the last logits and the state, what `generate` starts from);
  `generate` times the whole `generate` call, which is that prefill and a
  `lax.scan` of G - 1 steps (the first token comes from the prefill's
  logits). The summary row's `per_token_ms` is (generate - prefill) /
  (G - 1), the time of one step; `tokens_per_s` is B * G over the whole call
  and `decode_tokens_per_s` B over one step; `*_vs_transformer` divide by
  the default-attention Transformer's time at the same B. `--counts_only`
  gives the models' depths and parameter counts and times nothing.

Rows in the harness format (status ok | OOM | fail | unsup | error), medians
of `--iters` (kernel) and `--gen_iters` (generate) samples after warm-up.

  python3 -m experiments.benchmark_decode --check --output=/tmp/benchmark_decode.json
  python3 -m experiments.benchmark_decode --sections=generate --output=/tmp/generate.json
  python3 -m experiments.benchmark_decode --sections=generate --counts_only
  python3 -m experiments.benchmark_decode --smoke   # tiny shapes; runs on a CPU

`--impls` also takes `pallas_<splits>x<block_k>x<warps>x<stages>`: the kernel
on that tiling (`ops.decode_attention.TritonConfig`; splits 0: the default
count for the shape), to tune the default.
"""

import dataclasses
import functools
import json
import math
import re
from typing import Any, Callable

from absl import app
from absl import flags
from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from ops import _backend
from ops.decode_attention import api as decode_api
from ops.decode_attention import configs as decode_configs
from ops.decode_attention import pallas as decode_pallas
from ops.decode_attention import reference as decode_reference
import probjax_hk as pk


@dataclasses.dataclass(frozen=True)
class GenerateSizes:
  """The generate section's models (the SSMs' depth is matched at run time)."""
  model_dim: int                # D: the Transformer's width, and the SSMs'
  num_heads: int                # the Transformer's query heads
  num_layers: int               # the Transformer's blocks
  num_kv_heads: int             # the Transformer's key/value heads (GQA)
  mamba2: dict[str, Any]        # Mamba2Cell's keyword arguments
  gated_deltanet: dict[str, Any]  # GatedDeltaNetCell's keyword arguments


# The issue's Transformer; Mamba-2's usual cell (P 64, S 128, expand 2); the
# gated delta net with heads of 128 (D / 8).
SIZES = GenerateSizes(1024, 16, 8, 4, mamba2=dict(expand=2, head_dim=64, state_dim=128),
                      gated_deltanet=dict(num_heads=8))
SMOKE_SIZES = GenerateSizes(32, 4, 1, 2, mamba2=dict(expand=2, head_dim=16, state_dim=16),
                            gated_deltanet=dict(num_heads=2))
SMOKE_GENERATE = dict(batches=(2,), prompt_len=16, gen_tokens=32, vocab_size=64)
GENERATE_MODELS = ("transformer", "transformer_xla", "mamba2", "gated_deltanet")
_TRANSFORMERS = {"transformer": "default", "transformer_xla": "xla"}

SECTIONS = ("kernel", "generate")
_SECTIONS = flags.DEFINE_list("sections", list(SECTIONS), f"Sections to run, of {SECTIONS}.")
_OUTPUT = flags.DEFINE_string("output", "/tmp/benchmark_decode.json", "JSON path.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes and few iterations (kernel: B 2, "
                           "S 200, N 4, K 2, H 32; generate: width 32, 1 layer, "
                           "B 2, a 16-token prompt, 32 tokens): checks the program on a CPU.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"],
                           "The kernel's inputs; the generated models' parameters and "
                           "computation.")
# kernel
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "64"], "kernel: batch sizes B.")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["4096", "32768"], "kernel: cache slots S.")
_KV_HEADS = flags.DEFINE_list("kv_heads", ["8"], "kernel: key/value heads K.")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 32, "kernel: query heads N.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "kernel: head size H.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 1, "kernel: new tokens T per sequence.")
_FILL = flags.DEFINE_float("fill", 1.0, "kernel: valid fraction of the cache "
                           "(lengths = fill * S).")
_IMPLS = flags.DEFINE_list(
    "impls", ["pallas", "xla", "jax_nn_xla", "cudnn"],
    "kernel: pallas / xla: ops.decode_attention's kernel and XLA path; jax_nn_xla / "
    "cudnn: jax.nn.dot_product_attention with that implementation; "
    "pallas_<splits>x<block_k>x<warps>x<stages>: the kernel on that tiling "
    "(splits 0: the default count).")
_ITERS = flags.DEFINE_integer("iters", 20, "kernel: timed samples per case.")
_CHECK = flags.DEFINE_bool("check", False, "kernel: check the kernel against the "
                           "reference first.")
_BANDWIDTH = flags.DEFINE_float("bandwidth_tbps", 4.3, "kernel: memory bandwidth of the "
                                "floor, TB/s (an H200's device-to-device copy measured 4.3).")
# generate
_MODELS = flags.DEFINE_list("models", list(GENERATE_MODELS),
                            f"generate: models, of {GENERATE_MODELS}.")
_GEN_BATCHES = flags.DEFINE_list("gen_batches", ["1", "32"], "generate: batch sizes B.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 1024, "generate: prompt tokens T.")
_GEN_TOKENS = flags.DEFINE_integer("gen_tokens", 512, "generate: generated tokens G (>= 2).")
_VOCAB = flags.DEFINE_integer("vocab_size", 32000, "generate: vocabulary size V.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "generate: sampling temperature "
                                  "(0: greedy).")
_GEN_ITERS = flags.DEFINE_integer("gen_iters", 5, "generate: timed samples per case.")
_COUNTS_ONLY = flags.DEFINE_bool("counts_only", False, "generate: one row per model with "
                                 "its depth and parameter counts; time nothing.")

SMOKE = dict(batches=(2,), seq_lens=(200,), kv_heads=(2,), num_heads=4, head_dim=32)
_TILED = re.compile(r"pallas_(\d+)x(\d+)x(\d+)x(\d+)$")


def _inputs(b, t, s, n, kh, h, dtype, fill, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), dtype)
  k = jax.random.normal(keys[1], (b, s, kh, h), dtype)
  v = jax.random.normal(keys[2], (b, s, kh, h), dtype)
  lengths = jnp.full((b,), max(t, min(s, round(fill * s))), jnp.int32)
  return q, k, v, lengths


def attention_fn(impl: str, seq_q: int):
  """(q, k_cache, v_cache, lengths) -> out for one implementation."""
  if impl in ("pallas", "xla"):
    return functools.partial(decode_api.decode_attention, implementation=impl)
  if match := _TILED.match(impl):
    splits, block_k, warps, stages = map(int, match.groups())
    def tiled(q, k, v, lengths):
      interpret = _backend.pallas_interpret()
      default = decode_pallas.default_config(q.shape, k.shape, interpret=interpret)
      config = decode_configs.TritonConfig(block_k=block_k,
                                           num_splits=splits or default.num_splits,
                                           num_warps=warps, num_stages=stages)
      return decode_pallas.decode_attention_pallas(
          q, k, v, lengths, scale=q.shape[-1] ** -0.5, interpret=interpret, config=config)
    return tiled
  if impl == "jax_nn_xla":
    if seq_q == 1:  # the lengths are the whole mask
      return lambda q, k, v, lengths: jax.nn.dot_product_attention(
          q, k, v, key_value_seq_lengths=lengths, implementation="xla")
    return lambda q, k, v, lengths: jax.nn.dot_product_attention(
        q, k, v, mask=decode_reference.allowed_mask(lengths, seq_q, k.shape[1])[:, None],
        implementation="xla")
  if impl == "cudnn":
    if not _backend.on_nvidia_gpu():
      raise harness.Unsupported("cuDNN attention needs an NVIDIA GPU")
    if seq_q != 1:  # jax.nn's causal mask is top-left aligned; cuDNN takes no dense mask here
      raise harness.Unsupported("cuDNN: the decode mask of T > 1 new tokens")
    return lambda q, k, v, lengths: jax.nn.dot_product_attention(
        q, k, v, query_seq_lengths=jnp.ones_like(lengths), key_value_seq_lengths=lengths,
        implementation="cudnn")
  raise ValueError(f"unknown implementation {impl!r}")


def _case(impl, shape, dtype, fill):
  b, t, s, n, kh, h = shape
  def build():
    fn = attention_fn(impl, t)
    return jax.jit(fn), _inputs(b, t, s, n, kh, h, dtype, fill)
  return build


def floor_ms(b, t, s, kh, h, dtype, fill, bandwidth_tbps):
  """The cache bytes a call reads (K and V up to each length) over the bandwidth."""
  length = max(t, min(s, round(fill * s)))
  return 2 * b * length * kh * h * jnp.dtype(dtype).itemsize / (bandwidth_tbps * 1e9)


def _check_rows(dtype):
  """The kernel against the float32 reference on this device."""
  cases = [  # B, T, S, N, K, H, lengths, window
      (4, 1, 4096, 32, 8, 128, [4096, 1000, 77, 1], None),
      (3, 4, 2000, 8, 2, 64, [2000, 513, 4], None),
      (2, 4, 3000, 8, 8, 128, [3000, 1234], 256),
      (2, 16, 1024, 4, 1, 80, [1024, 300], None),
      (2, 1, 32768, 32, 8, 128, [32768, 20000], None),
  ]
  rows = []
  for b, t, s, n, kh, h, lengths, window in cases:
    q, k, v, _ = _inputs(b, t, s, n, kh, h, dtype, 1.0, seed=1)
    lengths = jnp.asarray(lengths, jnp.int32)
    row = dict(section="kernel", kind="check", shape=[b, t, s, n, kh, h],
               dtype=jnp.dtype(dtype).name, window=window)
    try:
      out = jax.jit(functools.partial(decode_api.decode_attention, local_window_size=window,
                                      implementation="pallas"))(q, k, v, lengths)
      f32 = lambda x: x.astype(jnp.float32)
      ref = jax.jit(functools.partial(decode_reference.decode_attention_reference,
                                      local_window_size=window))(f32(q), f32(k), f32(v), lengths)
      out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
      row.update(status="ok", rel=float(np.linalg.norm(out - ref) / np.linalg.norm(ref)),
                 finite=bool(np.isfinite(out).all()))
    except Exception as exc:  # Record and go on: the timing still matters.
      row.update(status="error", message=f"{type(exc).__name__}: {str(exc)[:1500]}")
    logging.info("check %s", row)
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def _summaries(rows):
  """One row per shape: times, the floor, and the ratios of one run."""
  groups = {}
  for r in rows:
    if r.get("section") == "kernel" and r.get("kind") == "time" and r.get("status") == "ok":
      groups.setdefault(r["shape"], {})[r["impl"]] = r
  out = []
  for shape, by_impl in groups.items():
    first = next(iter(by_impl.values()))
    s = dict(section="kernel", kind="summary", shape=shape, status="ok",
             floor_ms=first["floor_ms"])
    for impl, r in by_impl.items():
      s[f"{impl}_ms"] = r["median_ms"]
    if "pallas" in by_impl:
      s["pallas_vs_floor"] = s["pallas_ms"] / s["floor_ms"]
      s["pallas_tbps"] = by_impl["pallas"]["tbps"]
      for peer in ("xla", "jax_nn_xla", "cudnn"):
        if peer in by_impl:  # > 1: the kernel is faster
          s[f"{peer}_over_pallas"] = s[f"{peer}_ms"] / s["pallas_ms"]
    tiled = {k: v["median_ms"] for k, v in by_impl.items() if _TILED.match(k)}
    if tiled:
      s["pallas_tiled_best"] = min(tiled, key=tiled.get)
      s["pallas_tiled_best_ms"] = tiled[s["pallas_tiled_best"]]
    out.append(s)
  return out


def _kernel_section(dtype, smoke):
  """The kernel section's rows: checks, one timing row per shape and
  implementation, one summary row per shape."""
  if smoke:
    batches, seq_lens, kv_heads = SMOKE["batches"], SMOKE["seq_lens"], SMOKE["kv_heads"]
    num_heads, head_dim, iters = SMOKE["num_heads"], SMOKE["head_dim"], 3
  else:
    batches, seq_lens, kv_heads = (_positive_ints(f) for f in (_BATCHES, _SEQ_LENS, _KV_HEADS))
    num_heads, head_dim, iters = _NUM_HEADS.value, _HEAD_DIM.value, _ITERS.value
  t, fill = _NEW_TOKENS.value, _FILL.value
  rows = _check_rows(dtype) if _CHECK.value and not smoke else []
  interpret = _backend.pallas_interpret()
  for b in batches:
    for s in seq_lens:
      for kh in kv_heads:
        shape = (b, t, s, num_heads, kh, head_dim)
        name = f"b{b}_t{t}_s{s}_n{num_heads}_k{kh}_h{head_dim}"
        floor = floor_ms(b, t, s, kh, head_dim, dtype, fill, _BANDWIDTH.value)
        config = decode_pallas.default_config((b, t, num_heads, head_dim),
                                              (b, s, kh, head_dim), interpret=interpret)
        for impl in _IMPLS.value:
          row_config = dict(section="kernel", kind="time", shape=name, B=b, T=t, S=s,
                            N=num_heads, K=kh, H=head_dim, dtype=dtype.name, fill=fill,
                            impl=impl, floor_ms=floor)
          if impl == "pallas":
            row_config.update(num_splits=decode_pallas.chunking(s, config)[1],
                              block_k=config.block_k, num_warps=config.num_warps,
                              num_stages=config.num_stages)
          row = harness.run_case(row_config, _case(impl, shape, dtype, fill), iters=iters)
          if row["status"] == "ok":
            row["tbps"] = floor * _BANDWIDTH.value / row["median_ms"]
          print(json.dumps({k: row.get(k) for k in ("shape", "impl", "status", "median_ms",
                                                     "floor_ms", "message")}), flush=True)
          rows.append(row)
  summary = _summaries(rows)
  print(harness.format_table(summary, [
      "shape", "pallas_ms", "xla_ms", "jax_nn_xla_ms", "cudnn_ms", "floor_ms",
      "pallas_vs_floor", "xla_over_pallas", "jax_nn_xla_over_pallas", "cudnn_over_pallas",
      "pallas_tiled_best", "pallas_tiled_best_ms"]), flush=True)
  return rows + summary


def _body(model: str, sizes: GenerateSizes, ssm_layers: int | None):
  """The sequence model of one of GENERATE_MODELS, named "body"."""
  d = sizes.model_dim
  if model in _TRANSFORMERS:
    attention_fn = pk.dot_product_attention
    if _TRANSFORMERS[model] == "xla":
      attention_fn = functools.partial(pk.dot_product_attention, implementation="xla")
    return pk.Transformer(d, sizes.num_heads, sizes.num_layers, num_kv_heads=sizes.num_kv_heads,
                          is_causal=True, use_rope=True, attention_fn=attention_fn,
                          name="body")
  cell, cell_kwargs = _cell(model, sizes)
  return pk.SSMModel(d, d, d, ssm_layers, cell=cell, cell_kwargs=cell_kwargs, name="body")


def _cell(model: str, sizes: GenerateSizes):
  """(cell class, its keyword arguments) of an SSM of GENERATE_MODELS."""
  return {"mamba2": (pk.Mamba2Cell, sizes.mamba2),
          "gated_deltanet": (pk.GatedDeltaNetCell, sizes.gated_deltanet)}[model]


def make_model_fn(model: str, sizes: GenerateSizes, vocab_size: int,
                  ssm_layers: int | None = None) -> Callable[[], pk.TokenModel]:
  """The `model_fn` of `pk.generate` for one of GENERATE_MODELS (an SSM with
  `ssm_layers` blocks). Build it once per model: `generate` compiles per
  function object."""
  def model_fn():
    return pk.TokenModel(_body(model, sizes, ssm_layers), vocab_size, name="lm")
  return model_fn


def param_counts(model_fn: Callable[[], pk.TokenModel]) -> tuple[int, int]:
  """(all parameters, the body's) of `model_fn`'s model, from shapes alone."""
  init = hk.transform(lambda tokens: model_fn()(tokens)).init
  shapes = jax.eval_shape(init, jax.random.key(0), jax.ShapeDtypeStruct((1, 1), jnp.int32))
  per_module = {name: sum(math.prod(p.shape) for p in module.values())
                for name, module in shapes.items()}
  body = sum(n for name, n in per_module.items() if name.split("/")[0] == "body")
  return sum(per_module.values()), body


def matched_depth(model: str, sizes: GenerateSizes, vocab_size: int, target: int) -> int:
  """The SSM depth whose body parameter count is nearest `target`.

  Every block has the same parameters, so the count is linear in the depth.
  """
  one = param_counts(make_model_fn(model, sizes, vocab_size, 1))[1]
  per_layer = param_counts(make_model_fn(model, sizes, vocab_size, 2))[1] - one
  return max(1, 1 + round((target - one) / per_layer))


def _prompt(b, t, vocab_size):
  return jax.random.randint(jax.random.key(1), (b, t), 0, vocab_size, jnp.int32)


def _prefill_case(model_fn, params_fn, b, t, g, vocab_size):
  """The prompt's prefill alone, as `generate` runs it (cache of T + G - 1)."""
  def build():
    apply = hk.transform(lambda tokens: model_fn().prefill(tokens, max_length=t + g - 1)).apply
    def prefill(params, prompt):
      logits, state = apply(params, None, prompt)                    # [B, T, V]
      return logits[:, -1], state  # what generate samples the first token from
    return jax.jit(prefill), (params_fn(), _prompt(b, t, vocab_size))
  return build


def _generate_case(model_fn, params_fn, b, t, g, vocab_size, temperature):
  """`pk.generate` of G tokens after the prompt, one compiled call."""
  def build():
    def sample(params, prompt, rng):
      return pk.generate(model_fn, params, prompt, g, rng=rng, temperature=temperature)
    return jax.jit(sample), (params_fn(), _prompt(b, t, vocab_size), jax.random.key(2))
  return build


def _generate_summary(config, prefill_row, generate_row):
  """prefill and generate rows -> per-token time and tokens/s (or the failure)."""
  row = dict(config, kind="summary")
  for r in (prefill_row, generate_row):
    if r["status"] != "ok":
      row.update(status=r["status"], message=f"{r['kind']}: {r.get('message')}")
      return row
  b, g = config["B"], config["G"]
  prefill_ms, generate_ms = prefill_row["median_ms"], generate_row["median_ms"]
  per_token_ms = (generate_ms - prefill_ms) / (g - 1)
  row.update(status="ok", prefill_ms=prefill_ms, generate_ms=generate_ms,
             per_token_ms=per_token_ms, tokens_per_s=b * g / (generate_ms / 1e3),
             decode_tokens_per_s=b / (per_token_ms / 1e3))
  return row


def _generate_section(dtype, smoke):
  """The generate section's rows: prefill and generate timings and one summary
  row per model and batch size."""
  if smoke:
    sizes, iters = SMOKE_SIZES, 3
    batches = SMOKE_GENERATE["batches"]
    t, g, vocab_size = (SMOKE_GENERATE[k] for k in ("prompt_len", "gen_tokens", "vocab_size"))
  else:
    sizes, iters = SIZES, _GEN_ITERS.value
    batches = _positive_ints(_GEN_BATCHES)
    t, g, vocab_size = _PROMPT_LEN.value, _GEN_TOKENS.value, _VOCAB.value
  temperature = _TEMPERATURE.value
  target_params, target_body = param_counts(make_model_fn("transformer", sizes, vocab_size))
  rows, summaries = [], []
  for model in _MODELS.value:
    config = dict(section="generate", model=model, model_dim=sizes.model_dim)
    if model in _TRANSFORMERS:
      ssm_layers = None
      config.update(body="Transformer", attention=_TRANSFORMERS[model],
                    num_layers=sizes.num_layers, num_heads=sizes.num_heads,
                    num_kv_heads=sizes.num_kv_heads)
    else:
      ssm_layers = matched_depth(model, sizes, vocab_size, target_body)
      cell, cell_kwargs = _cell(model, sizes)
      config.update(body="SSMModel", cell=cell.__name__, cell_kwargs=cell_kwargs,
                    num_layers=ssm_layers)
    model_fn = make_model_fn(model, sizes, vocab_size, ssm_layers)
    params, body_params = param_counts(model_fn)
    config.update(params=params, body_params=body_params,
                  params_vs_transformer=body_params / target_body, T=t, G=g, V=vocab_size,
                  dtype=dtype.name, temperature=temperature)
    if _COUNTS_ONLY.value:
      summaries.append(dict(config, kind="params", status="ok"))
      continue

    @functools.cache
    def params_fn(model_fn=model_fn):
      """Random parameters in `dtype` (the embedding's dtype is the body's input's)."""
      init = hk.transform(lambda tokens: model_fn()(tokens)).init
      params = jax.jit(init)(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
      return jax.tree.map(lambda p: p.astype(dtype), params)

    for b in batches:
      case = dict(config, B=b, shape=f"{model}_b{b}")
      pre = harness.run_case(dict(case, kind="prefill"),
                             _prefill_case(model_fn, params_fn, b, t, g, vocab_size),
                             iters=iters)
      gen = harness.run_case(dict(case, kind="generate"),
                             _generate_case(model_fn, params_fn, b, t, g, vocab_size,
                                            temperature), iters=iters)
      summary = _generate_summary(case, pre, gen)
      for row in (pre, gen, summary):
        print(json.dumps({k: row.get(k) for k in (
            "shape", "kind", "status", "median_ms", "per_token_ms", "tokens_per_s",
            "body_params", "message")}), flush=True)
      rows += [pre, gen]
      summaries.append(summary)
    params_fn.cache_clear()
  timed = [s for s in summaries if s["kind"] == "summary" and s["status"] == "ok"]
  for s in timed:  # ratios to the Transformer (default attention) of the same B
    base = next((r for r in timed if r["model"] == "transformer" and r["B"] == s["B"]), None)
    if base is not None:
      s["prefill_vs_transformer"] = s["prefill_ms"] / base["prefill_ms"]
      s["per_token_vs_transformer"] = s["per_token_ms"] / base["per_token_ms"]
  print(f"Transformer: {target_params} parameters ({target_body} in the body)")
  print(harness.format_table(summaries, [
      "model", "B", "num_layers", "params", "body_params", "params_vs_transformer", "prefill_ms",
      "per_token_ms", "tokens_per_s", "decode_tokens_per_s", "prefill_vs_transformer",
      "per_token_vs_transformer", "status"]), flush=True)
  return rows + summaries


def _positive_ints(flag) -> tuple[int, ...]:
  """A list flag's values as positive ints; ValueError naming the flag."""
  try:
    values = tuple(int(v) for v in flag.value)
  except ValueError:
    values = ()
  if not values or min(values) < 1:
    raise ValueError(f"--{flag.name} must be a list of integers >= 1, got {flag.value}")
  return values


def _check_flags() -> None:
  """Every flag's value in range, before anything runs."""
  def one_of(flag, allowed, extra=None):
    bad = [v for v in flag.value if v not in allowed and not (extra and extra.match(v))]
    if bad:
      raise ValueError(f"--{flag.name}: unknown {bad}; choose from {list(allowed)}"
                       + (" or pallas_<splits>x<block_k>x<warps>x<stages>" if extra else ""))
  one_of(_SECTIONS, SECTIONS)
  one_of(_MODELS, GENERATE_MODELS)
  one_of(_IMPLS, ("pallas", "xla", "jax_nn_xla", "cudnn"), _TILED)
  for flag in (_BATCHES, _SEQ_LENS, _KV_HEADS, _GEN_BATCHES):
    _positive_ints(flag)
  for flag in (_NUM_HEADS, _HEAD_DIM, _NEW_TOKENS, _ITERS, _PROMPT_LEN, _VOCAB, _GEN_ITERS):
    if flag.value < 1:
      raise ValueError(f"--{flag.name} must be >= 1, got {flag.value}")
  if _GEN_TOKENS.value < 2:
    raise ValueError(f"--gen_tokens must be >= 2 (the per-token time is (generate - "
                     f"prefill) / (G - 1)), got {_GEN_TOKENS.value}")
  if not 0 < _FILL.value <= 1:
    raise ValueError(f"--fill must be in (0, 1], got {_FILL.value}")
  if not _TEMPERATURE.value >= 0:
    raise ValueError(f"--temperature must be >= 0 (0: greedy), got {_TEMPERATURE.value}")


def main(argv):
  del argv
  _check_flags()
  dtype, smoke = jnp.dtype(_DTYPE.value), _SMOKE.value
  rows = []
  for section, run in (("kernel", _kernel_section), ("generate", _generate_section)):
    if section in _SECTIONS.value:
      rows += run(dtype, smoke)
      harness.write_rows(rows, _OUTPUT.value)
  print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
  app.run(main)
