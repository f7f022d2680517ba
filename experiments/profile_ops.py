"""Where a compiled call's device time goes: per-kernel times from a trace.

    python -m experiments.profile_ops --cases moe_gmm,moe_dense --output $OUT/profile.json

Each case is traced with `jax.profiler.trace` over `--calls` back-to-back
calls (after warm-up). The trace's device events are grouped by kernel name
into rows of microseconds and launches per call; each case also records its
wall time per call (timed without the profiler), the device-busy time (the
union of its kernels' intervals) and so the idle share, which says whether a
call is bound by its kernels or by the gaps between them. On the CPU the
"kernels" are the XLA ops the runtime reports (`hlo_op`), which is enough to
test this program; the numbers that matter come from the GPU.
"""

import functools
import os

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments import harness
from experiments import tracing
from experiments import workloads

_CASES = flags.DEFINE_list("cases", None, "Case names (default: all); see CASES.")
_CALLS = flags.DEFINE_integer("calls", 20, "Traced calls per case.")
_TOP = flags.DEFINE_integer("top", 12, "Kernels printed per case.")
_SMALL = flags.DEFINE_bool("small", False, "Tiny shapes (CPU smoke test).")
_OUTPUT = flags.DEFINE_string("output", None, "JSON output path.")
_HLO_DIR = flags.DEFINE_string("hlo_dir", None, "Write each case's optimized HLO here "
                               "(<case>.hlo.txt), to look up what a fusion computes.")
_PLAIN_CALLS = flags.DEFINE_integer(
    "plain_calls", 0, "Instead of tracing, only run each case's call this many times "
    "(blocking on each), for an outside profiler to pick a launch from, e.g. "
    "`ncu -k regex:flex_attention_fwd -s 2 -c 1 --section WarpStateStats python -m "
    "experiments.profile_ops --cases flex_triton_h32_fwd_full --plain_calls 3`.")


# ---------------------------------------------------------------------------
# Cases: name -> build(small) -> (fn, args). Imports are local so that one
# case's missing dependency (e.g. cuDNN on the CPU) fails only that case.


def _vjp(fn, num_diff):
  """(diff args..., other args..., cotangent) -> gradients of fn."""
  def grad(*args):
    diff, rest, cot = args[:num_diff], args[num_diff:-1], args[-1]
    return jax.vjp(lambda *d: fn(*d, *rest), *diff)[1](cot)
  return grad


def _moe(impl, small, variant=None, tiles=None):
  import haiku as hk
  from probjax_hk import moe
  tokens = 256 if small else 8192
  model = hk.transform_with_state(lambda x: moe.MoELayer(
      workloads.NUM_EXPERTS, workloads.TOP_K, workloads.D_HIDDEN, activation="gelu",
      dropless_impl=impl)(x))
  x = jax.random.normal(jax.random.key(0), (tokens, workloads.D_MODEL), jnp.bfloat16)
  params, state = model.init(jax.random.key(1), x)
  cot = jax.random.normal(jax.random.key(5), x.shape, x.dtype)
  fn = _vjp(lambda p, x: model.apply(p, state, None, x)[0], 2)
  if variant:  # the experts' kernels chosen by hand (workloads.GROUPED_MLP_VARIANTS)
    def fn(*args, grad=fn):
      with workloads.grouped_mlp_kernels(variant):
        return grad(*args)
  if tiles:  # the plain Mosaic grouped matmuls' tiles chosen by hand
    def fn(*args, grad=fn):
      with workloads.mosaic_gmm_tiles(tiles):
        return grad(*args)
  return fn, (params, x, cot)


def _mosaic_config(**tiles):
  from ops.grouped_matmul import mosaic
  return mosaic.MosaicConfig(**tiles)


def _gmm(impl, small):
  """The grouped matmul forward at M 131072 (1024 with --small), [8, 512, 1024]:
  impl 'pallas' (the default kernel), 'triton' (the Triton kernel), 'xla',
  'dense' (one matmul of the same work) or 'jax_mosaic' (JAX's own Mosaic GPU
  ragged dot, `jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, at the
  fastest of its tiles in a sweep on an H200; GPU only)."""
  import ops
  from ops.grouped_matmul import pallas as gmm_pallas
  from ops.grouped_matmul import reference
  lhs, rhs, sizes = workloads.gmm_inputs(1024 if small else 131072)
  if impl == "dense":
    return (lambda a, b, s: jnp.matmul(a, b[0])), (lhs, rhs, sizes)
  if impl == "triton":
    def triton(a, b, s):
      return gmm_pallas.grouped_matmul_pallas(
          a, b, *reference.group_bounds(s, a.shape[0]), mosaic=False, mosaic_tgmm=False)
    return triton, (lhs, rhs, sizes)
  if impl == "jax_mosaic":
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return (lambda a, b, s: ragged_dot_mgpu.ragged_dot(
        a, b, group_sizes=s, block_m=128, block_n=128, block_k=64,
        max_concurrent_steps=5, grid_block_n=4)), (lhs, rhs, sizes)
  return (lambda a, b, s: ops.grouped_matmul(a, b, s, implementation=impl)), (lhs, rhs, sizes)


def _selective_scan(state, small):
  import ops
  shape = (2, 64, 16, state) if small else (8, 4096, 256, state)
  fn = lambda *a: ops.selective_scan(*a, implementation="pallas")
  return (jax.grad(workloads.scan_loss(fn), argnums=(0, 1, 2, 3, 4)),
          workloads.selective_inputs(*shape))


def _ssd(op, impl, shape, mode, small):
  dims = (1, 64, 2, 16, 16) if small else workloads.SSD_SHAPES[shape]
  args = workloads.ssd_inputs(*dims, jnp.bfloat16)
  # The chunk sizes of benchmark_kernel_ssd's rows: the kernels' defaults,
  # 128 for the chunked XLA SSD and 64 for the XLA gated delta rule.
  chunk = None if impl == "pallas" else (128 if op == "ssd" else 64)
  fn = workloads.chunked_op(op, impl, chunk)
  if mode == "fwd":
    return fn, args
  return jax.grad(workloads.chunked_loss(fn), argnums=(0, 1, 2, 3)), args


def _attention(impl, mode, small, causal=True, shape=(8, 8, 4096, 32)):
  shape = (1, 2, 128, 32) if small else shape
  return workloads.attention_case(impl, shape, causal, mode)()


def _model_step(model_name, choice, small):
  """model_steps' train step (bf16, batch 8, 4096 tokens), not donated.

  Not donated so that the traced calls can reuse one set of arguments; the
  kernels are the same, only the buffers' reuse differs.
  """
  from experiments import model_steps
  tokens, batch = (128, 2) if small else (4096, 8)
  return model_steps.build_train_step(model_name, choice, batch, tokens, jnp.bfloat16,
                                      donate=False)()


CASES = {
    "moe_gmm": lambda small: _moe("gmm", small),
    "moe_gmm_mosaic": lambda small: _moe("gmm", small, "gmm_mosaic"),
    "moe_gmm_triton": lambda small: _moe("gmm", small, "gmm_triton"),
    "moe_gmm_triton_tgmm": lambda small: _moe("gmm", small, "gmm_triton_tgmm"),
    "moe_dense": lambda small: _moe("dense", small),
    # The plain Mosaic grouped matmuls on the tiles of a config, not the
    # default's choice (which takes 64-row tiles for N 512 at 8192 tokens).
    "moe_gmm_tiles_128x128m": lambda small: _moe("gmm", small, tiles=_mosaic_config(
        block_m=128, block_n=128, split="m", max_concurrent_steps=4)),
    "moe_gmm_tiles_64x256n": lambda small: _moe("gmm", small, tiles=_mosaic_config(
        block_m=64, block_n=256, split="n", max_concurrent_steps=4)),
    "gmm_op": lambda small: _gmm("pallas", small),
    "gmm_op_triton": lambda small: _gmm("triton", small),
    "gmm_jax_mosaic_ragged_dot": lambda small: _gmm("jax_mosaic", small),
    "gmm_dense_matmul": lambda small: _gmm("dense", small),
    "selective_scan_s16": lambda small: _selective_scan(16, small),
    "selective_scan_s128": lambda small: _selective_scan(128, small),
    # {ssd,gdn}_{fwd,fwdbwd}_{0,1}[_xla]: the kernels, or the chunked XLA peer.
    **{f"{name}_{mode.replace('+', '')}_{shape}{suffix}":
       functools.partial(lambda small, op, impl, shape, mode: _ssd(op, impl, shape, mode, small),
                         op=op, impl=impl, shape=shape, mode=mode)
       for name, op in (("ssd", "ssd"), ("gdn", "gated_delta_rule"))
       for shape in (0, 1) for mode in ("fwd", "fwd+bwd")
       for impl, suffix in (("pallas", ""), ("xla", "_xla"))},
    "flex_h32_fwd": lambda small: _attention("flex", "fwd", small),
    "cudnn_h32_fwd": lambda small: _attention("cudnn", "fwd", small),
    "flex_h32_fwdbwd": lambda small: _attention("flex", "fwd+bwd", small),
    "cudnn_h32_fwdbwd": lambda small: _attention("cudnn", "fwd+bwd", small),
    # Full attention: the Triton forward's case (the Mosaic one takes causal calls).
    "flex_triton_h32_fwd_full": lambda small: _attention("flex_triton", "fwd", small, False),
    "cudnn_h32_fwd_full": lambda small: _attention("cudnn", "fwd", small, False),
    # The T 1024 anchor's forward (full attention): flex's kernels (the forward
    # and the first-tile maxima's second launch) against JAX's mha at its best tiles.
    **{f"{impl}_h32_fwd_full_t1024": functools.partial(
        lambda small, impl: _attention(impl, "fwd", small, False, shape=(8, 8, 1024, 32)),
        impl=impl)
       for impl in ("flex", "flex_refresh_in_kernel", "mha_128x64", "cudnn")},
    # flex's forward kernels at the other ANCHORS.md head sizes (the Mosaic
    # forward and the first-tile maxima's second pass), full attention.
    "flex_h64_fwd_full": lambda small: _attention("flex", "fwd", small, False,
                                                  shape=(4, 16, 4096, 64)),
    "flex_h128_fwd_full": lambda small: _attention("flex", "fwd", small, False,
                                                   shape=(2, 16, 8192, 128)),
    # The standard-profile model steps, per attention ('default' = flex on NVIDIA GPUs).
    **{f"{model}_step_{choice}": functools.partial(
        lambda small, model, choice: _model_step(model, choice, small),
        model=model, choice=choice)
       for model in ("transformer", "dit") for choice in ("default", "cudnn", "xla")},
}


def main(argv):
  del argv
  names = _CASES.value or list(CASES)
  unknown = sorted(set(names) - set(CASES))
  if unknown:
    raise app.UsageError(f"--cases: unknown {unknown}; known: {sorted(CASES)}")
  results = []
  for name in names:
    try:
      fn, args = CASES[name](_SMALL.value)
      if _PLAIN_CALLS.value:
        for _ in range(_PLAIN_CALLS.value):
          jax.block_until_ready(fn(*args))
        print(f"## {name}: {_PLAIN_CALLS.value} plain calls", flush=True)
        continue
      hlo_path = None
      if _HLO_DIR.value:
        os.makedirs(_HLO_DIR.value, exist_ok=True)
        hlo_path = os.path.join(_HLO_DIR.value, f"{name}.hlo.txt")
      result = {"case": name, "status": "ok",
                **tracing.profile(fn, args, calls=_CALLS.value, hlo_path=hlo_path)}
    except Exception as exc:  # One case's failure must not stop the others.
      result = {"case": name, "status": "error", "message": f"{type(exc).__name__}: {exc}"[:1000]}
      print(f"## {name}: {result['message']}", flush=True)
      results.append(result)
      continue
    results.append(result)
    print(f"## {name}: wall {result['wall_us']:.1f} us/call, device busy "
          f"{result['busy_us']:.1f} us, idle {100 * result['idle_share']:.0f}%, "
          f"{result['launches']:.0f} launches", flush=True)
    rows = [dict(k, name=tracing.short_name(k["name"]), share=round(100 * k["share"], 1))
            for k in result["kernels"][:_TOP.value]]
    print(harness.format_table(rows, ["name", "us", "launches", "share"]), flush=True)
    if _OUTPUT.value:
      harness.write_rows(results, _OUTPUT.value)


if __name__ == "__main__":
  app.run(main)
