r"""fit() on every device of one machine: data parallel, FSDP, experts, processes.

    python -m experiments.benchmark_scaling    # docs/benchmarks/scaling.json
    python -m experiments.benchmark_scaling --cases=dp --device_counts=1,2,4,8

Each case can run alone (`--cases=fsdp`); the rows of the cases not run are
kept from the existing `--output`, so a machine's cases can be measured one
command at a time into one file. On a CPU, tiny models on simulated devices
(each worker process gets its device count from the program):

    JAX_PLATFORMS=cpu python -m experiments.benchmark_scaling --smoke \
        --num_devices=4 --output=/tmp/scaling_smoke.json

Every configuration trains in a fresh process (`--worker`, which prints one
JSON row), so each device's allocator peak (`peak_bytes_in_use`) belongs to
that configuration alone, and a process that dies still gives a row. The
driver, whose JAX runs on the CPU only (it holds no device memory), makes
each model's parameters; a worker hands them as numpy arrays to `fit()`,
which places them on the mesh itself (replicated, or sharded: no device
ever holds a whole copy it does not train with), and trains on one
global batch of random bf16 inputs in memory (`fit()` keeps in-memory data
on every device: one global batch per device is part of each peak). It runs
`fit(..., mesh=..., parameter_sharding=...)` twice: `--warmup_steps` steps
that compile, then `--steps` steps timed by `fit()` itself
(`FitResult.steps_per_sec`, which also leaves out the call's first step).
Adam(1e-4), a next-step mean-square loss, float32 parameters, bf16
activations. N below is `--num_devices` (default: every device).

Cases (`--cases`):
  dp            `Transformer(256, 8, 4)` (causal) and `SSMModel(16, 128, 16,
                4, cell=Mamba2Cell)`, 8 sequences of 4096 tokens per device,
                parameters replicated, on 1 device and on N (and on each of
                `--device_counts`; `--dp_models` picks the models).
  fsdp          `Transformer(1024, 16, 24, scan_layers=True)` (causal), one
                sequence of 2048 tokens per device: on 1 device, and on N
                with `parameter_sharding='replicated'` against `'fsdp'`.
  moe           `MoELayer(8 experts, top-2, d_hidden 1024)` on d_model 512,
                65,536 tokens per device (16 x 4096): on 1 device, and on N
                with every expert on every device (no `expert_axis`, data
                parallel) against `expert_axis='expert'` with
                `expert_parameter_sharding('expert')` (8 / N experts per
                device; needs N to divide 8).
  multiprocess  the dp Transformer on N devices driven by one process
                against one process per device (`jax.distributed.initialize`
                on a local coordinator, all started by this program; on a
                GPU each process takes its device with `local_device_ids`):
                the losses of the `--steps` steps and the throughput.

Columns: `num_gpus` (the devices of the mesh: CPU devices in a CPU run),
`tokens_per_s` (tokens of the global batch per second), `step_ms`,
`scaling_efficiency` (tokens_per_s / (num_gpus x the 1-device row's of the
same model and per-device batch); 1.0 on that row; null without one),
`peak_bytes_per_device` (the largest of the mesh's devices'
`memory_stats()["peak_bytes_in_use"]`; null where the backend reports none,
as on a CPU; `peak_bytes_by_device` lists them), `state_bytes_per_device`
(the parameters' and optimizer state's bytes on the first device). Ratios
against the case's baseline row: fsdp `peak_memory_ratio` and
`step_time_ratio` (over 'replicated' on N devices), moe
`expert_bytes_ratio` (the expert weights and their Adam moments per device)
and `step_time_ratio` (over the replicated experts), multiprocess
`throughput_ratio` (over one process), `max_abs_loss_diff` and
`same_losses` (every step's loss within `--loss_rtol`).
"""

import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import zlib

from absl import app
from absl import flags
import numpy as np

from experiments import harness

CASES = ("dp", "fsdp", "moe", "multiprocess")
DP_MODELS = ("transformer", "mamba2")

_OUTPUT = flags.DEFINE_string(
    "output", "docs/benchmarks/scaling.json",
    "Where to write the JSON rows (rows of cases not run are kept from it).")
_CASES = flags.DEFINE_list("cases", list(CASES), f"Cases to run, of {CASES}.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny models and few steps (a CPU check).")
_NUM_DEVICES = flags.DEFINE_integer(
    "num_devices", None, "N, the devices to scale to (default: every device; on a CPU "
    "the workers get this many simulated devices).", lower_bound=1)
_DP_MODELS = flags.DEFINE_list("dp_models", list(DP_MODELS),
                               f"dp: the models to scale, of {DP_MODELS}.")
_DEVICE_COUNTS = flags.DEFINE_list(
    "device_counts", [], "dp: more device counts to run between 1 and N (e.g. 2,4).")
_STEPS = flags.DEFINE_integer("steps", None, "Timed steps per fit (default 100; 4 with "
                              "--smoke).", lower_bound=2)
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 2, "Steps of the fit that compiles.",
                                     lower_bound=1)
_STEPS_PER_CALL = flags.DEFINE_integer(
    "steps_per_call", 1, "fit()'s steps_per_call: 1 times every step (the host's "
    "per-step work hides behind steps of milliseconds).", lower_bound=1)
_LOSS_RTOL = flags.DEFINE_float(
    "loss_rtol", 1e-4, "multiprocess: the relative difference of each step's loss "
    "up to which the two runs count as the same (all-reduces may add in another order).",
    lower_bound=0.0)
_WORKER_TIMEOUT_S = flags.DEFINE_integer(
    "worker_timeout_s", 600, "A configuration's process (or process group) is stopped "
    "after this many seconds.", lower_bound=1)
_WORKER = flags.DEFINE_string("worker", None, "Internal: run one configuration (JSON) "
                              "and print its row.")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LEARNING_RATE = 1e-4

# name -> the model and its per-device batch. `dims` are the constructor's
# leading arguments: Transformer (D, heads, layers), SSMModel (input, width,
# output, layers), MoE (experts, top-k, d_model, d_hidden); `width` is the
# input's feature size.
WORKLOADS = {
    "transformer": dict(model="transformer", dims=[256, 8, 4], width=256,
                        seq_len=4096, batch_per_device=8),
    "mamba2": dict(model="mamba2", dims=[16, 128, 16, 4], width=16, seq_len=4096,
                   batch_per_device=8),
    "transformer_large": dict(model="transformer", dims=[1024, 16, 24], width=1024,
                              seq_len=2048, batch_per_device=1, scan_layers=True),
    "moe": dict(model="moe", dims=[8, 2, 512, 1024], width=512, seq_len=4096,
                batch_per_device=16),
}
SMOKE_WORKLOADS = {
    "transformer": dict(model="transformer", dims=[32, 2, 1], width=32, seq_len=32,
                        batch_per_device=2),
    "mamba2": dict(model="mamba2", dims=[4, 32, 4, 1], width=4, seq_len=32,
                   batch_per_device=2, cell_kwargs={"head_dim": 16, "state_dim": 8}),
    # [64, 64] projections (4096 elements): 'fsdp' splits them.
    "transformer_large": dict(model="transformer", dims=[64, 4, 2], width=64,
                              seq_len=32, batch_per_device=1, scan_layers=True),
    "moe": dict(model="moe", dims=[8, 2, 16, 32], width=16, seq_len=32,
                batch_per_device=2),
}
_EXPERT_AXIS = "expert"


# ---------------------------------------------------------------------------
# The worker: one configuration in its own process.


def _transformed(config):
  """The configuration's loss as an `hk.transform` (MoE: `_with_state`).

  `expert_axis=False` builds the MoE without it (same parameters), for an
  initialisation outside a mesh.
  """
  import haiku as hk
  import jax.numpy as jnp
  import probjax_hk as pk

  def next_step_loss(x, y):  # x, y: [B, T, F]: y predicts the next x
    return jnp.mean(jnp.square(y[:, :-1, :x.shape[-1]].astype(jnp.float32)
                               - x[:, 1:].astype(jnp.float32)))

  model, dims = config["model"], config["dims"]
  if model == "transformer":
    return hk.transform(lambda x: next_step_loss(x, pk.Transformer(
        *dims, is_causal=True, scan_layers=config.get("scan_layers", False))(x)))
  if model == "mamba2":
    return hk.transform(lambda x: next_step_loss(x, pk.SSMModel(
        *dims, cell=pk.Mamba2Cell, cell_kwargs=config.get("cell_kwargs"))(x)))
  if model == "moe":
    num_experts, top_k, _, d_hidden = dims
    axis = _EXPERT_AXIS if config.get("expert_axis") else None
    return hk.transform_with_state(lambda x: next_step_loss(x, pk.MoELayer(
        num_experts, top_k, d_hidden, expert_axis=axis)(x)))
  raise ValueError(f"unknown model {model!r}")


def _bytes_on(trees, device, keep=lambda path: True) -> int:
  """Bytes of the leaves' shards on `device` (leaves whose key path `keep`s)."""
  import jax
  total = 0
  for tree in trees:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if hasattr(leaf, "addressable_shards") and keep(jax.tree_util.keystr(path)):
        total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
  return total


def _is_expert_weight(keystr: str) -> bool:
  return keystr.endswith(("['w_in']", "['w_out']"))


def _train(config) -> dict:
  """Runs the configuration's two fits; returns its measurements."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh
  import optax
  import probjax_hk as pk

  if config["num_processes"] > 1:
    jax.distributed.initialize(
        coordinator_address=config["coordinator"], num_processes=config["num_processes"],
        process_id=config["process_id"], initialization_timeout=120,
        local_device_ids=[config["process_id"]] if config["platform"] == "gpu" else None)
    devices = jax.devices()
  else:
    devices = jax.devices()[:config["num_gpus"]]
  if len(devices) != config["num_gpus"]:
    raise ValueError(f"the configuration needs {config['num_gpus']} devices, the process "
                     f"sees {len(jax.devices())}")
  axis = _EXPERT_AXIS if config.get("expert_axis") else "data"
  mesh = Mesh(np.asarray(devices), (axis,))
  sharding = config["parameter_sharding"]
  if sharding == "expert":
    sharding = pk.expert_parameter_sharding(_EXPERT_AXIS)
  batch_size = config["num_gpus"] * config["batch_per_device"]
  x = np.random.default_rng(0).standard_normal(
      (batch_size, config["seq_len"], config["width"]), np.float32).astype(jnp.bfloat16)

  # Host (numpy) parameters, made by the driver: fit() copies them onto the mesh.
  with open(config["params_path"], "rb") as f:
    params, state = pickle.load(f)
  net = _transformed(config)

  def run(num_steps):
    return pk.fit(net.apply, params, x, state=state, optimizer=optax.adam(_LEARNING_RATE),
                  batch_size=batch_size, num_steps=num_steps, rng=1, mesh=mesh,
                  parameter_sharding=sharding, steps_per_call=config["steps_per_call"],
                  progress=False)

  # Compiles (with K steps per call: the K-step call and the single step of a
  # tail); the timed fit reuses the programs.
  k = config["steps_per_call"]
  run(max(config["warmup_steps"], k + 1 if k > 1 else 1))
  start = time.perf_counter()
  result = run(config["steps"])
  jax.block_until_ready(result.params)
  wall = time.perf_counter() - start
  steps_per_s = result.steps_per_sec
  tokens = batch_size * config["seq_len"]
  local = [d for d in devices if d.process_index == jax.process_index()]
  stats = [d.memory_stats() or {} for d in local]
  peaks = [s.get("peak_bytes_in_use") for s in stats]
  trees = (result.params, result.opt_state)
  out = dict(
      status="ok", tokens_per_step=tokens, global_batch=batch_size,
      tokens_per_s=steps_per_s * tokens, step_ms=1e3 / steps_per_s, wall_s=wall,
      peak_bytes_per_device=None if None in peaks else max(peaks),
      peak_bytes_by_device=peaks,
      bytes_limit_per_device=stats[0].get("bytes_limit"),
      state_bytes_per_device=_bytes_on(trees, local[0]),
      losses=[float(v) for v in result.history["loss"]],
      device_kind=devices[0].device_kind)
  if config["model"] == "moe":
    out.update(
        expert_param_bytes_per_device=_bytes_on([result.params], local[0], _is_expert_weight),
        expert_state_bytes_per_device=_bytes_on(trees, local[0], _is_expert_weight))
  return out


def _worker(config_json: str) -> None:
  """Prints the configuration's row (a probe: the machine) as the last line."""
  config = json.loads(config_json)
  if config.get("probe"):
    import jax
    print(json.dumps(dict(harness.environment(), platform=jax.default_backend())),
          flush=True)
    return
  multiprocess = config["num_processes"] > 1
  import jax
  if config["platform"] == "cpu":
    jax.config.update("jax_num_cpu_devices", config["cpu_devices"])
    if multiprocess:  # Gloo carries CPU collectives between processes.
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
  row = {k: v for k, v in config.items() if k != "params_path"}
  try:
    row.update(_train(config))
  except Exception as exc:  # The row says what failed; the run moves on.
    text = f"{type(exc).__name__}: {exc}"
    row.update(status="OOM" if harness.looks_like_oom(text) else "error",
               message=text[:2000], traceback=traceback.format_exc()[-4000:])
  print(json.dumps(row), flush=True)
  if multiprocess and row["status"] != "ok":
    # At once: a normal exit waits at the distributed shutdown barrier for the
    # other processes, which may be waiting in a collective for this one.
    os._exit(1)


# ---------------------------------------------------------------------------
# The driver: configurations, worker processes, the rows' ratios.


def _worker_env() -> dict:
  # NCCL's NVLink multicast (NVLS) objects need a driver and fabric feature
  # that a machine may lack, and NCCL then fails at init instead of falling
  # back: off in every worker.
  return dict(os.environ, NCCL_NVLS_ENABLE="0")


def _start(config: dict, directory: str, name: str):
  command = [sys.executable, "-m", "experiments.benchmark_scaling",
             f"--worker={json.dumps(config)}"]
  out = open(os.path.join(directory, f"{name}.out"), "w")
  err = open(os.path.join(directory, f"{name}.err"), "w")
  with out, err:
    return subprocess.Popen(command, cwd=_ROOT, env=_worker_env(), stdout=out, stderr=err)


def _row_of(directory: str, name: str) -> dict | None:
  with open(os.path.join(directory, f"{name}.out")) as f:
    lines = [l for l in f.read().splitlines() if l.startswith("{")]
  return json.loads(lines[-1]) if lines else None


def _tail(directory: str, name: str, chars: int = 2000) -> str:
  with open(os.path.join(directory, f"{name}.err"), errors="replace") as f:
    return f.read()[-chars:]


def run_workers(configs: list[dict], timeout_s: float) -> list[dict]:
  """Runs the configurations' processes together (a process group, or one);
  returns their rows. The first to fail stops the others (which would wait
  for it in a collective), as does the deadline."""
  with tempfile.TemporaryDirectory(prefix="benchmark_scaling_") as directory:
    procs = [_start(c, directory, str(i)) for i, c in enumerate(configs)]
    deadline = time.monotonic() + timeout_s
    try:
      while any(p.poll() is None for p in procs):
        if (any(p.poll() not in (None, 0) for p in procs)
            or time.monotonic() > deadline):
          break
        time.sleep(0.1)
    finally:
      timed_out = [p.poll() is None for p in procs]
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
    rows = []
    for i, (config, proc) in enumerate(zip(configs, procs)):
      row = _row_of(directory, str(i))
      if row is None:
        why = (f"stopped after {timeout_s} s" if timed_out[i] else
               f"exit code {proc.returncode}")
        stderr = _tail(directory, str(i))
        row = dict(config, status="OOM" if harness.looks_like_oom(stderr) else "error",
                   message=f"{why}, no row: {stderr}")
      rows.append(row)
    return rows


def probe() -> dict:
  """The machine, from a process of its own: this one never initialises a
  device backend, which would hold device memory while the workers run
  (a CPU-only run, JAX_PLATFORMS=cpu, asks its own)."""
  if os.environ.get("JAX_PLATFORMS") == "cpu":
    return dict(harness.environment(), platform="cpu")
  row = run_workers([{"probe": True}], timeout_s=300)[0]
  if "platform" not in row:
    raise RuntimeError(f"the probe process failed: {row.get('message')}")
  return row


def make_parameters(config: dict, directory: str) -> str:
  """Initialises the configuration's model on this process's CPU and pickles
  (params, Haiku state or None) as numpy arrays into `directory`; returns the
  file (one per model: configurations of the same model share it)."""
  import jax
  import jax.numpy as jnp
  fields = [config.get(k) for k in ("model", "dims", "width", "seq_len", "scan_layers",
                                    "cell_kwargs")]
  path = os.path.join(directory, f"params_{zlib.crc32(json.dumps(fields).encode())}.pkl")
  if not os.path.exists(path):
    # The MoE's parameters are the same with and without `expert_axis`, which
    # needs a mesh.
    init = _transformed(dict(config, expert_axis=False)).init
    example = jnp.zeros((1, config["seq_len"], config["width"]), jnp.bfloat16)
    out = jax.device_get(jax.jit(init)(jax.random.key(0), example))
    with open(path, "wb") as f:
      pickle.dump(out if config["model"] == "moe" else (out, None), f)
  return path


def _config(case: str, variant: str, workload: dict, num_gpus: int, machine: dict,
            *, parameter_sharding: str = "replicated", expert_axis: bool = False,
            num_processes: int = 1) -> dict:
  return dict(
      workload, case=case, variant=variant, num_gpus=num_gpus, num_processes=num_processes,
      parameter_sharding=parameter_sharding, expert_axis=expert_axis, dtype="bfloat16",
      steps=machine["steps"], warmup_steps=_WARMUP_STEPS.value,
      steps_per_call=_STEPS_PER_CALL.value, platform=machine["platform"],
      cpu_devices=num_gpus // num_processes)


def _timed_rows(configs, machine, timeout_s):
  rows = []
  for config in configs:
    print(f"running {config['case']} {config['variant']} {config['model']} on "
          f"{config['num_gpus']} device(s)", flush=True)
    config = dict(config, params_path=make_parameters(config, machine["directory"]))
    rows.extend(run_workers([config], timeout_s))
  return rows


def _ok(row) -> bool:
  return row is not None and row.get("status") == "ok"


def _ratio(a, b):
  return None if a is None or not b else a / b


def dp_rows(workloads, n, machine, timeout_s):
  counts = sorted({1, n, *machine["device_counts"]})
  return _timed_rows([_config("dp", "data_parallel", workloads[name], k, machine)
                      for name in machine["dp_models"] for k in counts], machine, timeout_s)


def fsdp_rows(workloads, n, machine, timeout_s):
  w = workloads["transformer_large"]
  configs = [_config("fsdp", "one_device", w, 1, machine)]
  if n > 1:
    configs += [_config("fsdp", "data_parallel", w, n, machine),
                _config("fsdp", "fsdp", w, n, machine, parameter_sharding="fsdp")]
  rows = _timed_rows(configs, machine, timeout_s)
  if n > 1 and _ok(rows[1]) and _ok(rows[2]):
    rows[2].update(
        peak_memory_ratio=_ratio(rows[2]["peak_bytes_per_device"],
                                 rows[1]["peak_bytes_per_device"]),
        state_bytes_ratio=_ratio(rows[2]["state_bytes_per_device"],
                                 rows[1]["state_bytes_per_device"]),
        step_time_ratio=_ratio(rows[2]["step_ms"], rows[1]["step_ms"]))
  return rows


def moe_rows(workloads, n, machine, timeout_s):
  w = workloads["moe"]
  configs = [_config("moe", "one_device", w, 1, machine)]
  if n > 1:
    configs.append(_config("moe", "replicated_experts", w, n, machine))
  num_experts = w["dims"][0]
  rows = _timed_rows(configs, machine, timeout_s)
  if n > 1:
    expert = _config("moe", "expert_parallel", w, n, machine, parameter_sharding="expert",
                     expert_axis=True)
    if num_experts % n:
      rows.append(dict(expert, status="unsup", message=(
          f"{num_experts} experts do not split over {n} devices")))
    else:
      rows.extend(_timed_rows([expert], machine, timeout_s))
    if _ok(rows[1]) and _ok(rows[2]):
      rows[2].update(
          expert_bytes_ratio=_ratio(rows[2]["expert_state_bytes_per_device"],
                                    rows[1]["expert_state_bytes_per_device"]),
          peak_memory_ratio=_ratio(rows[2]["peak_bytes_per_device"],
                                   rows[1]["peak_bytes_per_device"]),
          step_time_ratio=_ratio(rows[2]["step_ms"], rows[1]["step_ms"]))
  return rows


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def multiprocess_rows(workloads, n, machine, timeout_s):
  w = workloads["transformer"]
  single = _timed_rows([_config("multiprocess", "one_process", w, n, machine)],
                       machine, timeout_s)[0]
  many = _config("multiprocess", "process_per_device", w, n, machine, num_processes=n)
  if n == 1:
    return [single, dict(many, status="unsup",
                         message="one device: there is only one process")]
  many["params_path"] = make_parameters(many, machine["directory"])
  print(f"running multiprocess: {n} processes of one device", flush=True)
  address = f"localhost:{_free_port()}"
  rows = run_workers([dict(many, coordinator=address, process_id=i) for i in range(n)],
                     timeout_s)
  failed = [r for r in rows if not _ok(r)]
  if failed:
    return [single, dict(failed[0], process_id=None)]
  # The processes step together: the slowest one's rate is the run's.
  slowest = min(rows, key=lambda r: r["tokens_per_s"])
  peaks = [r["peak_bytes_by_device"][0] for r in rows]
  row = dict(slowest, process_id=None, coordinator=None, peak_bytes_by_device=peaks,
             peak_bytes_per_device=None if None in peaks else max(peaks),
             tokens_per_s_by_process=[r["tokens_per_s"] for r in rows],
             processes_agree=all(r["losses"] == rows[0]["losses"] for r in rows))
  if _ok(single):
    want, got = np.asarray(single["losses"]), np.asarray(row["losses"])
    diff = np.abs(got - want)
    row.update(
        throughput_ratio=row["tokens_per_s"] / single["tokens_per_s"],
        max_abs_loss_diff=float(diff.max()),
        same_losses=bool(np.all(diff <= _LOSS_RTOL.value * np.abs(want))))
  return [single, row]


_CASE_ROWS = {"dp": dp_rows, "fsdp": fsdp_rows, "moe": moe_rows,
              "multiprocess": multiprocess_rows}


def add_scaling_efficiency(rows: list[dict]) -> None:
  """Sets each ok row's `scaling_efficiency` against the 1-device ok row of
  the same model and per-device batch (null where there is none)."""
  key = lambda r: json.dumps([r.get(k) for k in (
      "model", "dims", "seq_len", "batch_per_device", "scan_layers", "cell_kwargs",
      "steps_per_call")])
  one = {}
  for r in rows:
    if _ok(r) and r.get("num_gpus") == 1 and "tokens_per_s" in r:
      one.setdefault(key(r), r["tokens_per_s"])
  for r in rows:
    base = one.get(key(r)) if _ok(r) and "tokens_per_s" in r else None
    r["scaling_efficiency"] = (None if base is None else
                               r["tokens_per_s"] / (r["num_gpus"] * base))


def _write(rows: list[dict], environment: dict, path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump({"environment": environment, "rows": rows}, f, indent=1)


def _kept_rows(path: str, cases) -> list[dict]:
  """The rows of other cases in an existing output file."""
  try:
    with open(path) as f:
      rows = json.load(f)["rows"]
  except (OSError, ValueError, KeyError):
    return []
  return [r for r in rows if r.get("case") not in cases]


def _check_flags() -> list[str]:
  cases = list(dict.fromkeys(_CASES.value))
  unknown = sorted(set(cases) - set(CASES))
  if unknown or not cases:
    raise app.UsageError(f"--cases must name some of {CASES}, got {_CASES.value}")
  models = _DP_MODELS.value
  if not models or set(models) - set(DP_MODELS):
    raise app.UsageError(f"--dp_models must name some of {DP_MODELS}, got {models}")
  for count in _DEVICE_COUNTS.value:
    if not count.isdigit() or int(count) < 1:
      raise app.UsageError(f"--device_counts must be positive integers, got {count!r}")
  return cases


def main(argv):
  del argv
  if _WORKER.value is not None:
    _worker(_WORKER.value)
    return
  cases = _check_flags()
  # The driver's own JAX runs on the CPU only: a device backend would hold
  # device memory while the workers run, and on the CPU every op takes its
  # XLA path, so the parameters it makes need no kernel.
  import jax
  jax.config.update("jax_platforms", "cpu")
  machine = probe()
  available = machine["device_count"]
  n = _NUM_DEVICES.value or available
  if machine["platform"] != "cpu" and n > available:
    raise app.UsageError(f"--num_devices={n} but the machine has {available} devices")
  counts = [int(c) for c in _DEVICE_COUNTS.value]
  if any(c > n for c in counts):
    raise app.UsageError(f"--device_counts must be at most --num_devices={n}, got {counts}")
  steps = _STEPS.value or (4 if _SMOKE.value else 100)
  if steps <= _STEPS_PER_CALL.value:
    raise app.UsageError(f"--steps={steps} must exceed --steps_per_call="
                         f"{_STEPS_PER_CALL.value}: fit's rate leaves the first call out")
  machine.update(steps=steps, device_counts=counts,
                 dp_models=list(dict.fromkeys(_DP_MODELS.value)))
  workloads = SMOKE_WORKLOADS if _SMOKE.value else WORKLOADS
  environment = {k: v for k, v in machine.items()
                 if k not in ("steps", "device_counts", "dp_models")}
  environment.update(device_count=n, smoke=_SMOKE.value)
  print(f"machine: {n} of {available} x {machine['device_kind']} ({machine['platform']}), "
        f"JAX {machine['jax']}", flush=True)
  rows = _kept_rows(_OUTPUT.value, cases)
  with tempfile.TemporaryDirectory(prefix="benchmark_scaling_params_") as directory:
    machine["directory"] = directory
    for case in cases:
      rows.extend(_CASE_ROWS[case](workloads, n, machine, _WORKER_TIMEOUT_S.value))
      add_scaling_efficiency(rows)
      _write(rows, environment, _OUTPUT.value)  # after every case: a cut run keeps its rows
  print(harness.format_table(rows, [
      "case", "variant", "model", "num_gpus", "num_processes", "status", "tokens_per_s",
      "step_ms", "scaling_efficiency", "peak_bytes_per_device", "state_bytes_per_device",
      "peak_memory_ratio", "expert_bytes_ratio", "step_time_ratio", "throughput_ratio",
      "max_abs_loss_diff", "same_losses"]), flush=True)
  print(f"wrote {_OUTPUT.value}", flush=True)


if __name__ == "__main__":
  app.run(main)
