"""Decode attention on one GPU: the split-K kernel against XLA and cuDNN.

Times `ops.decode_attention` (T new tokens per sequence against a bf16 KV cache
of S slots, every sequence `--fill` full) with its Pallas kernel and its XLA
path, `jax.nn.dot_product_attention` on the same cache (implementation='xla',
the plain masked attention, and 'cudnn' where cuDNN takes the call), and
against the bandwidth floor: the cache bytes the call must read over
`--bandwidth_tbps`. Rows in the harness format (status ok | OOM | fail |
unsup | error) plus one summary row per shape with the ratios. With --check
the kernel is first compared with the float32 reference on the device
(T in {1, 4}, GQA and MHA, lengths that vary per sequence, a window).

  python3 -m experiments.benchmark_kernel_decode --check --output=/tmp/decode_attention.json
  python3 -m experiments.benchmark_kernel_decode --smoke   # tiny shapes; runs on a CPU

`--impls` also takes `pallas_<splits>x<block_k>x<warps>x<stages>`: the kernel
on that tiling (`ops.decode_attention.DecodeConfig`; splits 0: the default
count for the shape), to tune the default.
"""

import functools
import json
import re

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from ops import _backend
from ops.decode_attention import api as decode_api
from ops.decode_attention import pallas as decode_pallas
from ops.decode_attention import reference as decode_reference

_OUTPUT = flags.DEFINE_string("output", "/tmp/benchmark_kernel_decode.json", "JSON path.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes (B 1-2, S 64-200, N 4, H 32) "
                           "and few iterations: checks the program on a CPU.")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "Batch sizes B.")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["1024", "8192", "32768"], "Cache slots S.")
_KV_HEADS = flags.DEFINE_list("kv_heads", ["8", "32"], "Key/value heads K.")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 32, "Query heads N.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head size H.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 1, "New tokens T per sequence.")
_FILL = flags.DEFINE_float("fill", 1.0, "Valid fraction of the cache (lengths = fill * S).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"],
                           "Input dtype.")
_IMPLS = flags.DEFINE_list(
    "impls", ["pallas", "xla", "jax_nn_xla", "cudnn"],
    "pallas / xla: ops.decode_attention's kernel and XLA path; jax_nn_xla / cudnn: "
    "jax.nn.dot_product_attention with that implementation; "
    "pallas_<splits>x<block_k>x<warps>x<stages>: the kernel on that tiling "
    "(splits 0: the default count).")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed samples per case.")
_CHECK = flags.DEFINE_bool("check", False, "Check the kernel against the reference first.")
_BANDWIDTH = flags.DEFINE_float("bandwidth_tbps", 4.3, "Memory bandwidth of the floor, "
                                "TB/s (an H200's device-to-device copy measured 4.3).")

SMOKE = dict(batches=(1, 2), seq_lens=(64, 200), kv_heads=(1, 4), num_heads=4, head_dim=32)
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
      config = decode_pallas.DecodeConfig(block_k=block_k, num_splits=splits or default.num_splits,
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
    row = dict(kind="check", shape=[b, t, s, n, kh, h], dtype=jnp.dtype(dtype).name,
               window=window)
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
    if r.get("kind") == "time" and r.get("status") == "ok":
      groups.setdefault(r["shape"], {})[r["impl"]] = r
  out = []
  for shape, by_impl in groups.items():
    first = next(iter(by_impl.values()))
    s = dict(kind="summary", shape=shape, floor_ms=first["floor_ms"])
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


def main(argv):
  del argv
  dtype = jnp.dtype(_DTYPE.value)
  if _SMOKE.value:
    batches, seq_lens, kv_heads = SMOKE["batches"], SMOKE["seq_lens"], SMOKE["kv_heads"]
    num_heads, head_dim, iters = SMOKE["num_heads"], SMOKE["head_dim"], 3
  else:
    batches, seq_lens, kv_heads = (tuple(map(int, f.value))
                                   for f in (_BATCHES, _SEQ_LENS, _KV_HEADS))
    num_heads, head_dim, iters = _NUM_HEADS.value, _HEAD_DIM.value, _ITERS.value
  t, fill = _NEW_TOKENS.value, _FILL.value
  rows = _check_rows(dtype) if _CHECK.value and not _SMOKE.value else []
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
          row_config = dict(kind="time", shape=name, B=b, T=t, S=s, N=num_heads, K=kh,
                            H=head_dim, dtype=dtype.name, fill=fill, impl=impl,
                            floor_ms=floor)
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
  rows += summary
  harness.write_rows(rows, _OUTPUT.value)
  print(harness.format_table(summary, [
      "shape", "pallas_ms", "xla_ms", "jax_nn_xla_ms", "cudnn_ms", "floor_ms",
      "pallas_vs_floor", "xla_over_pallas", "jax_nn_xla_over_pallas", "cudnn_over_pallas",
      "pallas_tiled_best", "pallas_tiled_best_ms"]))
  print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
  app.run(main)
