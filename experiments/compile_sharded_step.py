r"""Compiles data-parallel, FSDP and context-parallel train steps for N GPUs and checks the kernels.

A check, not a timing: every Pallas kernel of a sharded train step must run on
the per-device batch (B / N) with no all-gather in front of it. The step (the
standard Transformer or the Mamba-2 SSMModel, bf16, Adam) is compiled for a
mesh of N devices and again for one device at batch B / N; the kernels (every
custom call that is not a cuBLAS or cuDNN call) must be the same calls with
the same operand shapes in both programs. The all-gathers of the N-device
program are listed: none under 'replicated', parameters only under 'fsdp'.

`--context_parallel` adds, per model, the step of one sequence of
`--context_seq_len` tokens (65,536) split over an Explicit 'context' axis of
the N devices, as `fit(..., sequence_axis='context')` runs it, against one
device's step at T / N. No kernel operand or result and no all-gather may hold
a dimension of the whole sequence T (`whole_sequence_*` empty). The Mamba-2
model's ssd kernels must be the calls of one device's step at T / N
(`kernels_match_per_device_sequence`), its all-gathers the per-device states;
the Transformer's attention runs as a ring of collective-permutes over XLA
blocks (no kernel takes global positions yet), so its step holds no attention
kernel and does not match one device's.

With fewer GPUs than N, JAX's mock GPU topology (`jax_mock_gpu_topology`,
compile only: nothing runs) stands in for the N-GPU machine:

  python -m experiments.compile_sharded_step --num_devices=8 \
      --output=/tmp/compile_sharded_step.json

On a CPU (8 simulated devices, kernels in interpret mode, so no custom calls
to compare) it checks the all-gathers only:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
      python -m experiments.compile_sharded_step --seq_len=256 --batch=16

and the context-parallel steps, at a shorter sequence:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
      python -m experiments.compile_sharded_step --seq_len=256 --batch=16 \
      --parameter_sharding=replicated --context_parallel --context_seq_len=2048
"""

import collections
import json
import os
import re
import time

from absl import app
from absl import flags
import jax

_NUM_DEVICES = flags.DEFINE_integer("num_devices", 8, "Devices of the mesh.", lower_bound=2)
_BATCH = flags.DEFINE_integer("batch", 64, "Global batch (sequences).", lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "Tokens per sequence.", lower_bound=1)
_MODELS = flags.DEFINE_list("models", ["transformer", "mamba2"], "Models to compile.")
_SHARDINGS = flags.DEFINE_list("parameter_sharding", ["replicated", "fsdp"],
                               "fit()'s parameter_sharding modes to compile.")
_CONTEXT_PARALLEL = flags.DEFINE_bool(
    "context_parallel", False, "Also compile each model's context-parallel step: one "
    "sequence of --context_seq_len tokens, its time axis split over the devices.")
_CONTEXT_SEQ_LEN = flags.DEFINE_integer(
    "context_seq_len", 65536, "Tokens of the context-parallel step's sequence.", lower_bound=1)
_OUTPUT = flags.DEFINE_string("output", None, "Where to write the JSON result.")

# The kernels are custom calls; the library calls of XLA's own GPU code are not.
_LIBRARY_CALLS = ("__cublas", "__cudnn", "cu_threefry", "xla.gpu.ext")


def _set_up_devices(num_devices: int) -> str:
  """Mocks an N-GPU host when this one has fewer GPUs; returns what it uses."""
  if jax.config.jax_platforms in (None, "", "cuda", "gpu"):
    import jax._src.xla_bridge as xb  # the backend is not yet initialized here
    if not xb.backends_are_initialized():
      jax.config.update("jax_mock_gpu_topology", f"1x{num_devices}x1")
      # Autotuning runs kernels, which mocked devices cannot: the compile
      # waits for ever. The check reads the program, not its speed.
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                 + " --xla_gpu_autotune_level=0").strip()
  devices = jax.devices()
  if len(devices) < num_devices:
    raise ValueError(f"--num_devices={num_devices} but only {len(devices)} devices")
  return f"{len(devices)} x {devices[0].device_kind}"


def _models():
  import haiku as hk
  import jax.numpy as jnp
  import probjax_hk as pk

  def transformer(batch):
    y = pk.Transformer(256, 8, 4, is_causal=True)(batch["x"])
    return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"].astype(jnp.float32)))

  def mamba2(batch):
    y = pk.SSMModel(16, 128, 16, 4, cell=pk.Mamba2Cell)(batch["x"])
    return jnp.mean(jnp.square(y.astype(jnp.float32) - batch["y"].astype(jnp.float32)))

  return {"transformer": (hk.without_apply_rng(hk.transform(transformer)), 256),
          "mamba2": (hk.without_apply_rng(hk.transform(mamba2)), 16)}


_SHAPE = r"[a-z0-9]+\[[0-9,]*\]"


def _kernels(text: str) -> collections.Counter:
  """(target, operand shapes, result shapes) of every kernel custom call in the
  compiled HLO text, which names operands without their shapes: those come
  from the instructions that define them."""
  defined = {}
  for line in text.splitlines():
    match = re.match(r"\s*(?:ROOT )?(%\S+) = (.*?) [a-z-]+\(", line)
    if match:
      defined[match.group(1)] = tuple(re.findall(_SHAPE, match.group(2)))
  found = collections.Counter()
  for line in text.splitlines():
    if " custom-call(" not in line:
      continue
    target = re.search(r'custom_call_target="([^"]+)"', line)
    if target is None or target.group(1).startswith(_LIBRARY_CALLS):
      continue
    result = tuple(re.findall(_SHAPE, line.split(" = ", 1)[1].split(" custom-call(", 1)[0]))
    names = re.findall(r"%[\w.-]+", line.split(" custom-call(", 1)[1].split(")", 1)[0])
    operands = tuple(s for n in names for s in defined.get(n, ("?",)))
    found[(target.group(1), operands, result)] += 1
  return found


def _all_gathers(text: str) -> list[tuple[str, ...]]:
  """The result dimensions ("[a,b]", one per gathered array) of each
  all-gather in the HLO text (a combined or asynchronous one returns a tuple;
  an asynchronous start's tuple also holds its operands)."""
  found = []
  for line in text.splitlines():
    match = re.search(r"= (.*?) all-gather(?:-start)?\(", line)
    if match:
      found.append(tuple(re.findall(r"\[[0-9,]*\]", match.group(1))))
  return found


def _compile(loss, width: int, mode: str, mesh, batch: int, seq_len: int,
             sequence_axis: str | None = None) -> str:
  """The compiled text of one Adam train step on `mesh` at global `batch`,
  each sequence split over `sequence_axis` (an Explicit axis) when given."""
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from probjax_hk.training import sharding

  tokens = jax.ShapeDtypeStruct((batch, seq_len, width), jnp.bfloat16)
  example = {"x": tokens, "y": tokens}
  params = jax.eval_shape(loss.init, jax.random.key(0), example)
  optimizer = optax.adam(1e-3)
  opt_state = jax.eval_shape(optimizer.init, params)
  param_specs = sharding.parameter_specs(params, mode, mesh)
  opt_specs = sharding.optimizer_state_specs(opt_state, params, param_specs)
  named = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                     is_leaf=lambda s: isinstance(s, P))
  state_shardings = (named(param_specs), named(opt_specs))
  data_sharding = NamedSharding(mesh, sharding.batch_spec(3, mesh, sequence_axis=sequence_axis))
  # Explicit axes read the layout from the arguments' types, not in_shardings.
  placed = lambda tree, shardings: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

  def step(params, opt_state, batch):
    grads = jax.grad(loss.apply)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  start = time.perf_counter()
  with jax.set_mesh(mesh):
    jitted = jax.jit(step, in_shardings=(*state_shardings, data_sharding),
                     out_shardings=state_shardings)
    lowered = jitted.lower(*placed((params, opt_state), state_shardings),
                           placed(example, {k: data_sharding for k in example}))
    lowered_at = time.perf_counter()
    text = lowered.compile().as_text()
  print(f"  {mesh.size} device(s), batch {batch}, T {seq_len}: lowered in"
        f" {lowered_at - start:.1f} s, compiled in {time.perf_counter() - lowered_at:.1f} s",
        flush=True)
  return text


def _context_parallel_row(name: str, loss, width: int, n: int, seq_len: int) -> dict:
  """The step of one sequence of `seq_len` tokens split over an Explicit
  'context' axis of n devices, as `fit(..., sequence_axis='context')` places
  it (parameters replicated), against one device's step at seq_len / n."""
  import numpy as np
  from jax.sharding import AxisType
  from jax.sharding import Mesh

  mesh = jax.make_mesh((n,), ("context",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:n])
  text = _compile(loss, width, "replicated", mesh, 1, seq_len, sequence_axis="context")
  one = _compile(loss, width, "replicated", Mesh(np.asarray(jax.devices()[:1]), ("data",)),
                 1, seq_len // n)
  kernels, per_device = _kernels(text), _kernels(one)
  shapes = sorted({s for (_, ins, outs) in kernels for s in ins + outs})
  gathered = sorted({d for g in _all_gathers(text) for d in g})
  whole = re.compile(rf"[\[,]{seq_len}[\],]")  # a dimension of the whole sequence
  return {
      "model": name, "parameter_sharding": "replicated", "parallelism": "context",
      "num_devices": n, "batch": 1, "seq_len": seq_len,
      "kernel_calls": sum(kernels.values()),
      "kernels_match_per_device_sequence": kernels == per_device,
      "kernel_shapes": shapes,
      "per_device_kernel_shapes": sorted(
          {s for (_, ins, outs) in per_device for s in ins + outs}),
      "whole_sequence_kernel_shapes": [s for s in shapes if whole.search(s)],
      "all_gathers": len(_all_gathers(text)),
      "all_gathered_shapes": gathered,
      "whole_sequence_gathered_shapes": [d for d in gathered if whole.search(d)],
      "collective_permutes": len(re.findall(r" collective-permute(?:-start)?\(", text)),
  }


def main(argv):
  del argv
  n = _NUM_DEVICES.value
  machine = _set_up_devices(n)
  print(f"devices: {machine}", flush=True)
  import numpy as np
  from jax.sharding import Mesh
  if _BATCH.value % n:
    raise app.UsageError(f"--batch={_BATCH.value} must be a multiple of --num_devices={n}")
  if _CONTEXT_PARALLEL.value and _CONTEXT_SEQ_LEN.value % n:
    raise app.UsageError(f"--context_seq_len={_CONTEXT_SEQ_LEN.value} must be a multiple"
                         f" of --num_devices={n}")
  meshes = {k: Mesh(np.asarray(jax.devices()[:k]), ("data",)) for k in (n, 1)}
  rows = []

  def add(row):
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if not k.endswith("shapes")}), flush=True)
    if _OUTPUT.value:  # after every row, so a long run keeps what it has
      with open(_OUTPUT.value, "w") as f:
        json.dump({"machine": machine, "jax": jax.__version__, "rows": rows}, f, indent=1)

  for name in _MODELS.value:
    loss, width = _models()[name]
    for mode in _SHARDINGS.value:
      print(f"{name}, {mode}:", flush=True)
      text = _compile(loss, width, mode, meshes[n], _BATCH.value, _SEQ_LEN.value)
      one = _compile(loss, width, mode, meshes[1], _BATCH.value // n, _SEQ_LEN.value)
      kernels, per_device = _kernels(text), _kernels(one)
      params = jax.eval_shape(loss.init, jax.random.key(0), {
          k: jax.ShapeDtypeStruct((1, _SEQ_LEN.value, width), "bfloat16") for k in "xy"})
      param_shapes = set()
      for p in jax.tree.leaves(params):  # whole, and as one of n shards
        param_shapes.add(f"[{','.join(map(str, p.shape))}]")
        for d, size in enumerate(p.shape):
          if size % n == 0:
            param_shapes.add(f"[{','.join(str(s // n if i == d else s) for i, s in enumerate(p.shape))}]")
      gathers = _all_gathers(text)
      add({
          "model": name, "parameter_sharding": mode, "parallelism": "data", "num_devices": n,
          "batch": _BATCH.value, "seq_len": _SEQ_LEN.value,
          "kernel_calls": sum(kernels.values()),
          "kernels_match_per_device_batch": kernels == per_device,
          "kernel_shapes": sorted({s for (_, ins, outs) in kernels for s in ins + outs}),
          "per_device_kernel_shapes": sorted(
              {s for (_, ins, outs) in per_device for s in ins + outs}),
          "all_gathers": len(gathers),
          "all_gathered_shapes": sorted({d for g in gathers for d in g}),
          "all_gathers_not_of_parameters": sorted({d for g in gathers for d in g} - param_shapes),
      })
    if _CONTEXT_PARALLEL.value:
      print(f"{name}, context parallel:", flush=True)
      add(_context_parallel_row(name, loss, width, n, _CONTEXT_SEQ_LEN.value))


if __name__ == "__main__":
  app.run(main)
