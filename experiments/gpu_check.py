r"""Checks every kernel path the library can choose on this GPU, in minutes.

The first command to run on a GPU (a new kind, a new driver or JAX):

    python -m experiments.gpu_check              # docs/benchmarks/gpu_check.json
    python -m experiments.dispatch_tables        # the defaults then use what passed here
    JAX_PLATFORMS=cpu python -m experiments.gpu_check --smoke --output=/tmp/gpu_check.json

In order of importance, each row written to `--output` as it finishes (a run
cut short keeps its rows):

1. `ops`: for each op (`OPS`) and each of its kernel backends on this device
   (Triton; Mosaic GPU where `ops._mosaic_gpu.takes` holds, 16-bit inputs on
   a Hopper GPU: its kernels wherever they take the shape, Triton elsewhere),
   the forward and the gradient of every input (`jax.vjp` against fixed
   random cotangents) against the op's float32 reference at two small odd
   shapes (T no multiple of a block, grouped heads, padded head or state
   sizes, empty groups) and a representative one, within the bound its tests
   use (`experiments/tolerances.py`): a `check` row per (op, backend, shape),
   status 'fail' with the errors over their bounds. Ops built on matmuls are
   checked with bfloat16 inputs (a GPU runs float32 matmuls as TF32, which
   the float32 bounds, set on the CPU, do not allow); the scans in float32 and
   complex64. Then one `time` row per implementation at the representative
   shape: the kernel (`implementation='pallas'`, what the defaults would run)
   against its peers (XLA; cuDNN for attention), fwd+bwd (forward alone for
   decoding), each naming the dispatch table points it measures (`points`),
   which `dispatch_tables` reads.
2. `models`: one train step (Adam) of each model with the default dispatch:
   Transformer, DiT, SSMModel per cell, MoELayer 'auto', UNet; the loss must
   be finite.
3. `generate`: greedy `generate` of a Transformer and a Mamba-2 language model
   against their forward pass on the generated tokens: every token the
   forward's argmax, or within a rounding of it (`checks.greedy_agreement`).
4. `sharded`: the data-parallel train step compiled for 8 GPUs of a mock
   topology (`compile_sharded_step`, in its own process): every kernel call at
   the per-device batch B / 8, no all-gather.

The JSON is a merge of runs (`{"sources": {run: {"environment", "commit"}},
"rows"}`, every row naming its run in `source`): a run replaces the earlier
run of its device kind and JAX minor release and keeps the others'. The
environment holds the GPU's name and compute capability, the driver, CUDA,
cuDNN, JAX and jaxlib versions and the commit. The exit status is 1 when any
row failed (status fail, error or OOM); a table of every row ends the output.

`--smoke` runs the same list on the CPU (the kernels in Pallas interpret
mode) at tiny sizes: each op at one shape with the odd shapes' features,
timed there with one call per sample, and one SSM cell of the five
(`SMOKE_MODELS`); it checks the program, not the numbers
(tests/experiments/test_gpu_check.py).
"""

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from experiments import checks
from experiments import harness
from experiments import model_steps
from experiments import shape_grid
from experiments import tolerances
from experiments import workloads
import ops
from ops import _backend
from ops import _mosaic_gpu
from ops.decode_attention import api as decode_api
from ops.flex_attention import api as flex_api
from ops.gated_delta_rule import configs as gdr_configs
from ops.gated_delta_rule import pallas as gdr_pallas
from ops.grouped_matmul import pallas as gmm_pallas
from ops.grouped_matmul import reference as gmm_reference
import probjax_hk as pk
from probjax_hk import attention as pk_attention

SECTIONS = ("ops", "models", "generate", "sharded")
OPS = ("flex_attention", "ssd", "gated_delta_rule", "grouped_mlp", "grouped_matmul",
       "selective_scan", "linear_scan", "decode_attention")
FAILED = ("fail", "error", "OOM")
# The models of --smoke: each case of `model_steps` once. The SSM cells share
# `ssm_case` (on the CPU each runs its op's XLA tier): one stands for the five.
SMOKE_MODELS = ("transformer", "dit", "ssm_ssd", "moe", "unet")

_OUTPUT = flags.DEFINE_string("output", "docs/benchmarks/gpu_check.json",
                              "JSON path (the curated suite file; another for trial runs).")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes on the CPU: checks the program.")
_SECTIONS = flags.DEFINE_list("sections", list(SECTIONS), f"What to run, of {SECTIONS}.")
_OPS = flags.DEFINE_list("ops", list(OPS), f"The ops of the ops section, of {OPS}.")


# ---------------------------------------------------------------------------
# The environment and the rows.


def _commit() -> str | None:
  """HEAD of the checkout, with '-dirty' where tracked files differ from it."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, timeout=30).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True, timeout=30).stdout.strip()
  except Exception:  # pylint: disable=broad-except
    return None
  return (head + ("-dirty" if dirty else "")) or None


def environment() -> dict:
  """`harness.environment()` (the GPU's name, compute capability, driver,
  CUDA, cuDNN, jaxlib) and the commit."""
  return dict(harness.environment(), commit=_commit())


def _minor(version: str) -> str:
  return ".".join(str(version).split(".")[:2])


class Recorder:
  """Rows of this run, written to `path` after each one beside the runs of
  other device kinds (or JAX minor releases) that the file already holds."""

  def __init__(self, path: str, env: dict):
    self.path, self.env, self.rows = path, env, []
    self.run = env["time"]
    self.kept_sources, self.kept_rows = {}, []
    if os.path.exists(path):
      with open(path) as f:
        data = json.load(f)
      if "sources" not in data:  # one run, as an older file
        run = data.get("environment", {}).get("time", "run")
        data = {"sources": {run: {"environment": data.get("environment", {})}},
                "rows": [dict(r, source=run) for r in data["rows"]]}
      mine = (env["device_kind"], _minor(env["jax"]))
      for run, source in data["sources"].items():
        theirs = source.get("environment", {})
        if (theirs.get("device_kind"), _minor(theirs.get("jax", ""))) != mine:
          self.kept_sources[run] = source
      self.kept_rows = [r for r in data["rows"] if r.get("source") in self.kept_sources]

  def add(self, row: dict) -> dict:
    row = dict(row, source=self.run)
    self.rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k not in ("traceback", "source")},
                     default=str), flush=True)
    sources = dict(self.kept_sources)
    sources[self.run] = {"environment": self.env, "commit": self.env.get("commit")}
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    with open(self.path, "w") as f:
      json.dump({"sources": dict(sorted(sources.items())), "rows": self.kept_rows + self.rows},
                f, indent=1, default=str)
    return row


# ---------------------------------------------------------------------------
# The ops: checks against the float32 reference, then one timing.


@dataclasses.dataclass(frozen=True)
class Backend:
  """One way of running an op's kernels: `fn(*args)`; `public` where it is
  the op's own `implementation='pallas'` call (the one the defaults run)."""
  fn: Callable
  public: bool = False


@dataclasses.dataclass(frozen=True)
class Case:
  """One shape of an op's check, built on demand (`build`)."""
  name: str
  fields: dict   # what the rows record of the shape
  dtype: Any     # the inputs' dtype: the key of the bound
  # -> (backends by name, the reference, the differentiated args, their
  # output's cotangent, the timed implementations at this shape: name ->
  # (fn or None for the kernel, the dispatch-table points it measures)).
  build: Callable[[], tuple]


@dataclasses.dataclass(frozen=True)
class OpSpec:
  op: str
  outputs: tuple[str, ...]  # names of the output's leaves
  inputs: tuple[str, ...]   # names of the differentiated args (the gradients: 'd' + name)
  cases: tuple[Case, ...]   # the last one is the representative shape, timed
  mode: str = "fwd+bwd"     # what the timing rows time


def _normal(key, shape, dtype):
  """Standard normal values of `dtype` (complex: both parts)."""
  if jnp.issubdtype(dtype, jnp.complexfloating):
    re, im = jax.random.normal(key, (2, *shape))
    return (re + 1j * im).astype(dtype)
  return jax.random.normal(key, shape).astype(dtype)


def _cotangent(fn, args, seed=7):
  """Random cotangents of `fn(*args)`'s output leaves, in their dtypes."""
  out = jax.eval_shape(fn, *args)
  leaves, tree = jax.tree.flatten(out)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [_normal(k, l.shape, l.dtype) for k, l in zip(keys, leaves)])


def _mosaic(dtype) -> bool:
  return _mosaic_gpu.takes(dtype)


def _unsupported_off_gpu(what: str):
  if not _backend.on_nvidia_gpu():
    raise harness.Unsupported(f"{what} needs an NVIDIA GPU; the default backend is "
                              f"{jax.default_backend()!r}")


def _flex_spec(smoke: bool) -> OpSpec:
  # (B, T, S, N, K, H), options: GQA 4:1 and 3:1, H 80 and 48 padded, a
  # causal call with key lengths, a cross one with a window.
  shapes = {
      "odd_a": ((2, 300, 300, 8, 2, 80), dict(is_causal=True, key_value_seq_lengths=(300, 211))),
      "odd_b": ((2, 197, 333, 6, 2, 48), dict(local_window_size=(64, 32))),
      "representative": ((2, 4096, 4096, 16, 16, 128), dict(is_causal=True)),
  }
  if smoke:
    shapes = {"representative": ((2, 19, 19, 4, 1, 24),
                                 dict(is_causal=True, key_value_seq_lengths=(19, 7)))}
  dtype = jnp.bfloat16

  def case(name, dims, options):
    def build():
      q, k, v, w = workloads.attention_inputs(*dims, dtype)
      opts = {k_: (jnp.asarray(v_, jnp.int32) if k_ == "key_value_seq_lengths" else v_)
              for k_, v_ in options.items()}

      def flex(triton):
        def fn(q, k, v):
          forced = (workloads.flex_config_changes(mosaic_fwd=None, mosaic_bwd=None)
                    if triton else contextlib.nullcontext())
          with forced:
            return flex_api.flex_attention(q, k, v, implementation="pallas", **opts)
        return fn
      backends = {"triton": Backend(flex(True), public=not _mosaic(dtype))}
      if _mosaic(dtype):
        backends["mosaic"] = Backend(flex(False), public=True)
      reference = functools.partial(flex_api.flex_attention, implementation="xla", **opts)

      def cudnn(q, k, v):
        _unsupported_off_gpu("cuDNN attention")
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **opts)
      b, t, s, n, kh, h = dims
      point = dict(dtype="bfloat16", variant=pk_attention.grid_variant(
          q, k, opts.get("is_causal", False), opts.get("local_window_size")),
                   head_dim=h, length=s)
      timed = {"pallas": (None, {"attention": dict(point, impl="flex"),
                                 "flex_attention": {"impl": "pallas"}}),
               "cudnn": (cudnn, {"attention": dict(point, impl="cudnn")}),
               "xla": (reference, {"flex_attention": {"impl": "xla"}})}
      return backends, reference, (q, k, v), w, timed
    b, t, s, n, kh, h = dims
    return Case(name, dict(B=b, T=t, S=s, N=n, K=kh, H=h, options=sorted(options)), dtype,
                build)
  return OpSpec("flex_attention", ("out",), ("q", "k", "v"),
                tuple(case(n, *s) for n, s in shapes.items()))


def _decode_spec(smoke: bool) -> OpSpec:
  # (B, T, S, N, K, H), lengths, window: T new tokens against a cache of S.
  shapes = {
      "odd_a": ((3, 1, 1000, 8, 2, 80), (1000, 377, 1), None),
      "odd_b": ((2, 4, 777, 4, 4, 64), (777, 5), 100),
      # A cache shorter than the kernel's 64-key tile (padded to it inside).
      "odd_short_cache": ((4, 2, 40, 8, 2, 128), (40, 9, 2, 33), 16),
      "representative": ((8, 1, 4096, 32, 8, 128), (4096,) * 8, None),
  }
  if smoke:
    shapes = {"representative": ((3, 1, 40, 4, 2, 24), (40, 17, 1), None)}
  dtype = jnp.bfloat16

  def case(name, dims, lengths, window):
    def build():
      q, k, v, w = workloads.attention_inputs(*dims, dtype)
      lengths_ = jnp.asarray(lengths, jnp.int32)
      call = lambda implementation: lambda q, k, v: decode_api.decode_attention(
          q, k, v, lengths_, local_window_size=window, implementation=implementation)
      reference = lambda q, k, v: ops.decode_attention_reference(
          q, k, v, lengths_, local_window_size=window)

      def cudnn(q, k, v):
        _unsupported_off_gpu("cuDNN attention")
        if q.shape[1] != 1 or window is not None:
          raise harness.Unsupported("cuDNN: one new token per sequence, no window")
        return jax.nn.dot_product_attention(
            q, k, v, query_seq_lengths=jnp.ones_like(lengths_),
            key_value_seq_lengths=lengths_, implementation="cudnn")
      timed = {"pallas": (call("pallas"), {"decode_attention": {"impl": "pallas"}}),
               "xla": (call("xla"), {"decode_attention": {"impl": "xla"}}),
               "cudnn": (cudnn, {"decode_attention": {"impl": "cudnn"}})}
      return ({"triton": Backend(call("pallas"), public=True)}, reference, (q, k, v), w, timed)
    b, t, s, n, kh, h = dims
    return Case(name, dict(B=b, T=t, S=s, N=n, K=kh, H=h, window=window), dtype, build)
  return OpSpec("decode_attention", ("out",), ("q", "k", "v"),
                tuple(case(n, *s) for n, s in shapes.items()), mode="fwd")


def _chunked_spec(op: str, smoke: bool) -> OpSpec:
  # (B, T, N heads, G query/key groups, K, V): T no multiple of a chunk,
  # heads sharing q/k, K and V padded; the gated delta rule's second shape is
  # K = V = 128, where its Mosaic GPU kernels take the call.
  key_value = (128, 128) if op == "gated_delta_rule" else (64, 64)
  shapes = {"odd_a": (1, 300, 4, 2, 24, 40), "odd_b": (2, 77, 2, 2, *key_value),
            "representative": (8, 4096, 4, 4, *key_value)}
  if smoke:
    shapes = {"representative": (1, 37, 4, 2, 12, 20)}
  dtype = jnp.bfloat16
  names = ("q", "k", "v", "log_decay") + (("beta",) if op == "gated_delta_rule" else ())

  def case(name, dims):
    b, t, n, g, kd, vd = dims

    def build():
      q, k, v, log_decay, beta = workloads.ssd_inputs(b, t, n, kd, vd, dtype, seed=1, groups=g)
      args = (q, k, v, log_decay) + ((beta,) if op == "gated_delta_rule" else ())
      if op == "ssd":
        call = lambda impl: lambda *a: ops.ssd(*a, implementation=impl)
        backends = {"triton": Backend(call("pallas"), public=True)}
        reference = ops.ssd_reference
      else:
        call = lambda impl: lambda *a: ops.gated_delta_rule(*a, implementation=impl)
        blocks = dataclasses.replace(gdr_configs.TritonConfig.get_default(t, kd, vd),
                                     mosaic_walk=False, mosaic_grads=False,
                                     mosaic_key_grads=False)
        backends = {"triton": Backend(
            lambda *a: gdr_pallas.gated_delta_rule_pallas(*a, blocks=blocks),
            public=not _mosaic(dtype))}
        if _mosaic(dtype):
          backends["mosaic"] = Backend(call("pallas"), public=True)
        reference = ops.gated_delta_rule_reference
      point = dict(key_dim=kd, length=t)
      timed = {"pallas": (None, {op: dict(point, impl="pallas")}),
               "xla": (call("xla"), {op: dict(point, impl="xla")})}
      return backends, reference, args, _cotangent(reference, args), timed
    return Case(name, dict(B=b, T=t, N=n, G=g, K=kd, V=vd), dtype, build)
  return OpSpec(op, ("y", "final"), names, tuple(case(n, s) for n, s in shapes.items()))


def _scan_spec(op: str, smoke: bool) -> OpSpec:
  # selective scan (B, T, D, S), linear scan (B, T, D): T no multiple of a
  # chunk, D and S no multiple of a block (S padded); the second shape reversed.
  if op == "selective_scan":
    shapes = {"odd_a": ((2, 300, 40, 12), False), "odd_b": ((1, 1000, 24, 16), True),
              "representative": ((8, 4096, 256, 16), False)}
    if smoke:
      shapes = {"representative": ((2, 37, 12, 6), True)}
    dtype, inputs, names = jnp.float32, workloads.selective_inputs, ("u", "delta", "A", "B", "C")
    fields = lambda s: dict(zip("BTDS", s))
    point = lambda s: dict(state=s[3], length=s[1])
  else:
    shapes = {"odd_a": ((2, 300, 40), False), "odd_b": ((1, 1000, 24), True),
              "representative": ((8, 4096, 256), False)}
    if smoke:
      shapes = {"representative": ((2, 37, 12), True)}
    dtype, inputs, names = jnp.complex64, workloads.linear_inputs, ("a", "b")
    fields = lambda s: dict(zip("BTD", s))
    point = lambda s: dict(length=s[1])
  public = getattr(ops, op)
  reference = getattr(ops, f"{op}_reference")

  def case(name, shape, reverse):
    def build():
      args = inputs(*shape, seed=1)
      call = lambda impl: lambda *a: public(*a, reverse=reverse, implementation=impl)
      ref = lambda *a: reference(*a, reverse=reverse)
      timed = {"pallas": (None, {op: dict(point(shape), impl="pallas")}),
               "xla": (call("xla"), {op: dict(point(shape), impl="xla")})}
      return ({"triton": Backend(call("pallas"), public=True)}, ref, args, _cotangent(ref, args),
              timed)
    return Case(name, dict(fields(shape), reverse=reverse), dtype, build)
  outputs = ("y", "final") if op == "selective_scan" else ("h", "final")
  return OpSpec(op, outputs, names, tuple(case(n, *s) for n, s in shapes.items()))


def _grouped_spec(op: str, smoke: bool) -> OpSpec:
  # (M, K, N, group sizes): M and the widths no multiple of a tile, empty
  # groups, rows after the last group; the MLP's first shape GELU, its second
  # SwiGLU.
  shapes = {"odd_a": (301, 72, 136, (70, 0, 150, 13, 0, 40, 20, 8)),
            "odd_b": (1000, 128, 200, (300, 0, 0, 500, 100, 0, 50, 0)),
            "representative": (16384, workloads.D_MODEL, workloads.D_HIDDEN, None)}
  layer = shape_grid.MoePoint(workloads.NUM_EXPERTS, workloads.TOP_K, workloads.D_MODEL,
                              workloads.D_HIDDEN, tokens=8192)
  if smoke:
    shapes = {"representative": (37, 24, 40, (5, 0, 20, 12))}
    layer = shape_grid.MoePoint(4, 2, 32, 64, tokens=32)
  dtype = jnp.bfloat16

  def case(name, m, kd, nd, sizes):
    activation = "swiglu" if name == "odd_b" else "gelu"
    groups = len(sizes) if sizes else layer.experts

    def build():
      keys = jax.random.split(jax.random.key(1), 4)
      group_sizes = (workloads.balanced_sizes(m, groups, keys[3]) if sizes is None
                     else jnp.asarray(sizes, jnp.int32))
      starts, ends = gmm_reference.group_bounds(group_sizes, m)
      if op == "grouped_matmul":
        lhs = jax.random.normal(keys[0], (m, kd)).astype(dtype)
        rhs = (jax.random.normal(keys[1], (groups, kd, nd)) / np.sqrt(kd)).astype(dtype)
        args = (lhs, rhs)
        kernels = lambda mosaic: lambda a, b: gmm_pallas.grouped_matmul_pallas(
            a, b, starts, ends, mosaic=mosaic, mosaic_tgmm=mosaic)
        backends = {"triton": Backend(kernels(False))}
        if _mosaic(dtype):
          backends["mosaic"] = Backend(kernels(True))
        call = lambda impl: lambda a, b: ops.grouped_matmul(a, b, group_sizes,
                                                            implementation=impl)
        reference = lambda a, b: ops.grouped_matmul_reference(a, b, group_sizes)
      else:
        f_in = (2 if activation == "swiglu" else 1) * nd
        x = jax.random.normal(keys[0], (m, kd)).astype(dtype)
        w_in = jax.random.normal(keys[1], (groups, kd, f_in)) / np.sqrt(kd)
        w_out = jax.random.normal(keys[2], (groups, nd, kd)) / np.sqrt(nd)
        args = (x, w_in, w_out)

        def kernels(variant):
          def fn(*a):
            with workloads.grouped_mlp_kernels(variant):
              return ops.grouped_mlp(*a, group_sizes, activation=activation,
                                     implementation="pallas")
          return fn
        backends = {"triton": Backend(kernels("gmm_triton"))}
        if _mosaic(dtype):
          backends["mosaic"] = Backend(kernels("gmm_mosaic"))
        call = lambda impl: lambda *a: ops.grouped_mlp(*a, group_sizes, activation=activation,
                                                       implementation=impl)
        reference = lambda *a: ops.grouped_mlp_reference(*a, group_sizes,
                                                         activation=activation)
      timed = {"pallas": (call("pallas"), {op: {"impl": "pallas"}}),
               "xla": (call("xla"), {op: {"impl": "xla"}})}
      if op == "grouped_mlp":  # the MoE layer's paths: its 'gmm' runs this op
        moe_point = dict(experts=layer.experts, top_k=layer.top_k, d_model=layer.d_model,
                         d_hidden=layer.d_hidden, tokens=layer.tokens)
        for impl in ("gmm", "ragged_dot"):
          timed[f"moe_{impl}"] = (("moe", impl, layer), {"moe": dict(moe_point, impl=impl)})
      return backends, reference, args, _cotangent(reference, args), timed
    fields = dict(M=m, K=kd, N=nd, G=groups)
    if op == "grouped_mlp":
      fields["activation"] = activation
    return Case(name, fields, dtype, build)
  outputs = ("out",)
  names = ("lhs", "rhs") if op == "grouped_matmul" else ("x", "w_in", "w_out")
  return OpSpec(op, outputs, names, tuple(case(n, *s) for n, s in shapes.items()))


def op_spec(op: str, smoke: bool) -> OpSpec:
  if op == "flex_attention":
    return _flex_spec(smoke)
  if op == "decode_attention":
    return _decode_spec(smoke)
  if op in ("ssd", "gated_delta_rule"):
    return _chunked_spec(op, smoke)
  if op in ("selective_scan", "linear_scan"):
    return _scan_spec(op, smoke)
  return _grouped_spec(op, smoke)


def judge(spec: OpSpec, dtype, got: tuple, want: tuple) -> dict:
  """Errors of `got` against `want` (`checks.vjp_function`'s: the output, then
  one gradient per input) with the op's measure, against its bounds: the
  errors, the worst error over its bound, and status 'fail' naming the errors
  over their bounds (NaN among them)."""
  bounds = tolerances.OPS[spec.op]
  outputs = {name: bounds.metric(g, w) for name, g, w in
             zip(spec.outputs, jax.tree.leaves(got[0]), jax.tree.leaves(want[0]))}
  gradients = {name: bounds.metric(g, w) for name, g, w in zip(spec.inputs, got[1:], want[1:])}
  ratios = [e / bounds.bound(dtype) for e in outputs.values()]
  ratios += [e / bounds.bound(dtype, n) for n, e in gradients.items()]
  row = dict(errors={**outputs, **{f"d{n}": e for n, e in gradients.items()}},
             worst=max(float(r) if np.isfinite(r) else float("inf") for r in ratios))
  over = bounds.over(dtype, outputs, gradients)
  if over:
    row.update(status="fail", message="; ".join(over))
  return row


def op_rows(spec: OpSpec, smoke: bool, record: Callable[[dict], dict]) -> None:
  """Checks every backend of `spec` at each case, then times the
  representative case's implementations."""
  timing = dict(warmup=1, iters=2, sample_ms=0) if smoke else {}
  for case in spec.cases:
    try:
      backends, reference, args, cotangent, timed = case.build()
    except Exception as exc:  # pylint: disable=broad-except
      record(dict(kind="check", op=spec.op, case=case.name, **case.fields, status="error",
                  message=f"{type(exc).__name__}: {str(exc)[:2000]}"))
      continue
    want = harness.computed_once(
        lambda: checks.reference_vjp_outputs(reference, args, cotangent), "the f32 reference")
    compiled = {}
    for name, backend in backends.items():
      compiled[name] = jax.jit(checks.vjp_function(backend.fn))

      def errors(name=name, backend=backend):
        harness.require_supported(backend.fn, *args)
        reference_out = want()
        start = time.perf_counter()
        got = compiled[name](*args, cotangent)
        jax.block_until_ready(got)
        return dict(judge(spec, case.dtype, got, reference_out),
                    seconds=time.perf_counter() - start)
      record(harness.check_row(dict(kind="check", op=spec.op, backend=name, case=case.name,
                                    dtype=jnp.dtype(case.dtype).name, **case.fields),
                               errors))
    if case is not spec.cases[-1]:
      continue
    public = next((compiled[n] for n, b in backends.items() if b.public), None)
    for impl, (fn, points) in timed.items():
      config = dict(kind="time", op=spec.op, impl=impl, mode=spec.mode, case=case.name,
                    dtype=jnp.dtype(case.dtype).name, **case.fields, points=points)
      record(harness.run_case(config, _timed(spec, fn, public, args, cotangent), **timing))


def _timed(spec: OpSpec, fn, public, args, cotangent) -> Callable[[], tuple]:
  """A `harness.run_case` build thunk of one timed implementation: `fn` fwd+bwd
  as one vjp against `cotangent`, or forward alone (`spec.mode`); None: the
  op's kernel as its check compiled it (`public`, fwd+bwd); ('moe', impl,
  layer): the MoE layer's fwd+bwd with that `dropless_impl`."""
  def build():
    if isinstance(fn, tuple):
      _, impl, layer = fn
      step, step_args = workloads.moe_case(impl, "fwd+bwd", *workloads.moe_inputs(
          layer.tokens, layer), layer)
      return jax.jit(step), step_args
    if fn is None:  # the op's kernel as its check ran it
      if public is None:
        raise harness.Unsupported("no check ran the op's own kernel path")
      return public, (*args, cotangent)
    harness.require_supported(fn, *args)
    if spec.mode == "fwd+bwd":
      return jax.jit(checks.vjp_function(fn)), (*args, cotangent)
    return jax.jit(fn), args
  return build


# ---------------------------------------------------------------------------
# Models, generation, the sharded step.


def _attention_choice(profile, batch, tokens, dtype) -> str:
  """What `dot_product_attention(implementation=None)` runs in the attention models."""
  q = jax.ShapeDtypeStruct((batch, tokens, profile.num_heads,
                            profile.width // profile.num_heads), dtype)
  return pk.choose_attention_implementation(q, q, q)


def model_rows(smoke: bool, record: Callable[[dict], dict]) -> None:
  """One Adam step of each model with the default dispatch: a finite loss."""
  profile = model_steps.SMALL if smoke else model_steps.STANDARD
  batch, tokens, side = (1, 8, 8) if smoke else (4, 1024, 32)
  dtype = jnp.bfloat16
  for name in SMOKE_MODELS if smoke else model_steps.MODELS:
    length = side if name == "unet" else tokens
    row = dict(kind="model", model=name, batch=batch, tokens=length,
               dtype=jnp.dtype(dtype).name)
    if name in model_steps.ATTENTION_MODELS:
      row["attention"] = _attention_choice(profile, batch, length, dtype)

    def loss(name=name, length=length):
      build = model_steps.build_train_step(name, "default", batch, length, dtype,
                                           profile=profile)
      start = time.perf_counter()
      step, args = build()
      value = float(step(*args)[2])
      result = dict(loss=value, seconds=time.perf_counter() - start)
      if not np.isfinite(value):
        result.update(status="fail", message=f"the loss is {value}")
      return result
    record(harness.check_row(row, loss))


def _language_models(smoke: bool) -> dict:
  """name -> model_fn of a Transformer and a Mamba-2 TokenModel."""
  if smoke:
    width, vocab = 32, 64
    transformer = lambda: pk.Transformer(width, 4, 1, num_kv_heads=2, is_causal=True,
                                         use_rope=True)
    mamba2 = lambda: pk.SSMModel(width, width, width, 1, cell=pk.Mamba2Cell,
                                 cell_kwargs=dict(head_dim=16, state_dim=8))
  else:
    width, vocab = 256, 512
    transformer = lambda: pk.Transformer(width, 8, 4, num_kv_heads=2, is_causal=True,
                                         use_rope=True)
    mamba2 = lambda: pk.SSMModel(width, width, width, 2, cell=pk.Mamba2Cell,
                                 cell_kwargs=dict(head_dim=64, state_dim=64))
  return {name: (lambda body=body: pk.TokenModel(body(), vocab), vocab)
          for name, body in (("transformer", transformer), ("mamba2", mamba2))}


def generate_rows(smoke: bool, record: Callable[[dict], dict]) -> None:
  """Greedy `generate` against the forward pass on the generated tokens."""
  batch, prompt_len, new = (2, 8, 4) if smoke else (4, 64, 32)
  for name, (model_fn, vocab) in _language_models(smoke).items():
    row = dict(kind="generate", model=name, batch=batch, prompt=prompt_len, tokens=new,
               vocab=vocab)

    def compare(model_fn=model_fn, vocab=vocab):
      forward = hk.without_apply_rng(hk.transform(lambda tokens: model_fn()(tokens)))
      prompt = jax.random.randint(jax.random.key(0), (batch, prompt_len), 0, vocab)
      params = jax.jit(forward.init)(jax.random.key(1), prompt)
      start = time.perf_counter()
      tokens = pk.generate(model_fn, params, prompt, new, temperature=0)
      logits = jax.jit(forward.apply)(params, jnp.concatenate([prompt, tokens], axis=1))
      logits = logits[:, prompt_len - 1:-1]  # [B, G, V]: what predicted each token
      return dict(checks.greedy_agreement(tokens, logits),
                  seconds=time.perf_counter() - start)
    record(harness.check_row(row, compare))


def sharded_rows(smoke: bool, record: Callable[[dict], dict]) -> None:
  """`compile_sharded_step` for 8 devices in a process of its own (a mock GPU
  topology must be set before JAX starts; on a CPU, 8 simulated devices)."""
  env = dict(os.environ)
  if smoke or not _backend.on_nvidia_gpu():
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=(env.get("XLA_FLAGS", "") +
                                               " --xla_force_host_platform_device_count=8"))
    options = ["--seq_len=8", "--batch=8", "--models=transformer"]
  else:
    options = ["--seq_len=1024", "--batch=16", "--models=transformer,mamba2"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory() as folder:
    output = os.path.join(folder, "sharded.json")
    command = [sys.executable, "-m", "experiments.compile_sharded_step", "--num_devices=8",
               "--parameter_sharding=replicated", f"--output={output}", *options]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    seconds = time.perf_counter() - start
    rows = json.load(open(output))["rows"] if os.path.exists(output) else []
  if proc.returncode or not rows:
    record(dict(kind="sharded", status="error", seconds=seconds,
                message=(proc.stderr or proc.stdout)[-2000:]))
    return
  for r in rows:
    row = dict(kind="sharded", model=r["model"], parameter_sharding=r["parameter_sharding"],
               num_devices=r["num_devices"], batch=r["batch"], seq_len=r["seq_len"],
               kernel_calls=r["kernel_calls"],
               kernels_match_per_device_batch=r["kernels_match_per_device_batch"],
               all_gathers=r["all_gathers"], status="ok", seconds=seconds)
    problems = []
    if not r["kernels_match_per_device_batch"]:
      problems.append("the kernels differ from the one-device step's at B / 8")
    if r["all_gathers"]:
      problems.append(f"{r['all_gathers']} all-gathers: {r['all_gathered_shapes']}")
    if problems:
      row.update(status="fail", message="; ".join(problems))
    record(row)


# ---------------------------------------------------------------------------


def summary(rows: list[dict]) -> str:
  """The printed table: one line per row."""
  lines = []
  for r in rows:
    what = r.get("op") or r.get("model") or r.get("kind")
    detail = r.get("backend") or r.get("impl") or r.get("parameter_sharding") or ""
    value = r.get("median_ms") if r["kind"] == "time" else r.get("worst", r.get("loss"))
    lines.append(dict(kind=r["kind"], what=what, how=detail, case=r.get("case", ""),
                      status=r.get("status"), value=value,
                      message=str(r.get("message", ""))[:80].replace("\n", " ")))
  return harness.format_table(lines, ["kind", "what", "how", "case", "status", "value",
                                      "message"])


def main(argv):
  del argv
  for flag, known in ((_SECTIONS, SECTIONS), (_OPS, OPS)):
    unknown = sorted(set(flag.value) - set(known))
    if unknown:
      raise app.UsageError(f"--{flag.name}: unknown {unknown}; known: {list(known)}")
  smoke = _SMOKE.value
  recorder = Recorder(_OUTPUT.value, environment())
  start = time.perf_counter()
  if "ops" in _SECTIONS.value:
    for op in OPS:
      if op in _OPS.value:
        op_rows(op_spec(op, smoke), smoke, recorder.add)
  if "models" in _SECTIONS.value:
    model_rows(smoke, recorder.add)
  if "generate" in _SECTIONS.value:
    generate_rows(smoke, recorder.add)
  if "sharded" in _SECTIONS.value:
    sharded_rows(smoke, recorder.add)
  print(summary(recorder.rows))
  failed = [r for r in recorder.rows if r.get("status") in FAILED]
  print(f"{len(recorder.rows)} rows, {len(failed)} failed, {time.perf_counter() - start:.0f} s; "
        f"rows in {_OUTPUT.value}")
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
