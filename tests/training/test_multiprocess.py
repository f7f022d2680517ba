"""fit() on several hosts: 2 processes x 4 devices train as 1 process x 8.

The test starts two processes of 4 CPU devices each that join through
`jax.distributed.initialize` on a local coordinator, and a third, alone with
8 CPU devices. All three run `multiprocess_worker.py`: `fit()` in memory, on
a stream, with `parameter_sharding='fsdp'`, and with a causal Transformer's
sequence split over a 'context' mesh axis that spans the processes; the two
processes must end with the parameters and losses of the one.

Training on several hosts
-------------------------
Every host runs the same program, which calls `jax.distributed.initialize()`
before any other JAX call. The processes then form one runtime:
`jax.devices()` lists the devices of every host, and `fit()`'s default mesh
spans them all, each process driving its own devices. In memory, every
process passes the same arrays. On a stream, each process yields its own
B / P rows of every global batch of `batch_size` B (P processes,
`jax.process_count()`; this one's index `jax.process_index()`), e.g.
`data.shard(num_shards=jax.process_count(), index=jax.process_index())` for a
`tf.data` pipeline. `FitResult.params` are global arrays (with
`parameter_sharding='fsdp'` each process holds only its devices' shards);
`jax.experimental.multihost_utils.process_allgather` fetches their values.

One process per host, all its GPUs; host0 is the coordinator (any free port
that the other hosts can reach). On host i of N:

    python train.py --coordinator_address=host0:1234 --num_processes=N \
        --process_id=i

where train.py starts with

    jax.distributed.initialize(coordinator_address, num_processes, process_id)

For one process per GPU, start 8 processes per host (`--num_processes` counts
them all) and give each its GPU: `jax.distributed.initialize(...,
local_device_ids=[local_rank])`. Under SLURM (`srun --ntasks-per-node=8
--gpus-per-task=1 python train.py`), Open MPI, Kubernetes or on Cloud TPU,
`jax.distributed.initialize()` with no arguments reads all of this from the
environment. The library's training job takes the same flags:

    python -m experiments.train --distributed \
        --coordinator_address=host0:1234 --num_processes=2 --process_id=$RANK

On CPUs (as in this test), collectives between processes go through Gloo
(`jax_cpu_collectives_implementation`, JAX's default).
"""

import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import simulated_devices

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_NUM_PROCESSES = 2
_DEVICES_PER_PROCESS = 4
_NUM_DEVICES = _NUM_PROCESSES * _DEVICES_PER_PROCESS
# Compilation dominates (a few seconds a program on a busy 2-core machine); a
# process that dies leaves the other waiting in a collective, so the run
# stops at the first failure and, at the latest, at this deadline.
_DEADLINE_S = 420
_FITS = ("arrays", "stream", "fsdp", "context")
# Gloo's all-reduce between the processes adds the per-device gradients in
# another order than one process does: the last bits differ.
_ATOL = 1e-5


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _tail(path: str, chars: int = 3000) -> str:
  with open(path, errors="replace") as f:
    return f.read()[-chars:]


def _run_all(directory) -> dict:
  """Runs the workers and the reference at once; returns their JSON outputs
  by name ('process_0', 'process_1', 'reference')."""
  address = f"localhost:{_free_port()}"
  commands = {f"process_{i}": (_NUM_PROCESSES, i, _DEVICES_PER_PROCESS)
              for i in range(_NUM_PROCESSES)}
  commands["reference"] = (1, 0, _NUM_DEVICES)
  procs, paths = {}, {}
  try:
    for name, (count, index, devices) in commands.items():
      paths[name] = {k: str(directory / f"{name}.{k}")
                     for k in ("json", "stdout", "stderr")}
      with open(paths[name]["stdout"], "w") as out, \
           open(paths[name]["stderr"], "w") as err:
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "tests.training.multiprocess_worker",
             paths[name]["json"], str(count), str(index), address],
            cwd=_ROOT, env=simulated_devices.env(devices), stdout=out, stderr=err)
    deadline = time.monotonic() + _DEADLINE_S
    while any(p.poll() is None for p in procs.values()):
      failed = any(p.poll() not in (None, 0) for p in procs.values())
      if failed or time.monotonic() > deadline:
        break
      time.sleep(0.2)
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
        p.wait()
  codes = {name: p.returncode for name, p in procs.items()}
  if any(codes.values()):
    report = [f"worker exit codes {codes} (negative: killed, after a failure"
              f" elsewhere or the {_DEADLINE_S} s deadline)"]
    for name in procs:
      stderr = _tail(paths[name]["stderr"])
      report.append(f"--- {name} stderr (tail) ---\n{stderr}")
    pytest.fail("\n".join(report), pytrace=False)
  outputs = {}
  for name in procs:
    with open(paths[name]["json"]) as f:
      outputs[name] = json.load(f)
  return outputs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  return _run_all(tmp_path_factory.mktemp("multiprocess"))


def _leaves(tree, prefix=""):
  """{path: array} of a JSON tree of nested dicts with nested-list leaves."""
  if isinstance(tree, dict):
    return {k: v for key in sorted(tree)
            for k, v in _leaves(tree[key], f"{prefix}/{key}").items()}
  return {prefix: np.asarray(tree, np.float32)}


def _json_path(keystr: str) -> str:
  """"['mlp/~/linear_0']['w']" -> '/mlp/~/linear_0/w' (the `_leaves` path)."""
  return "".join("/" + k for k in re.findall(r"\['([^']*)'\]", keystr))


def _workers(runs):
  return [runs[f"process_{i}"] for i in range(_NUM_PROCESSES)]


def test_processes_form_one_mesh(runs):
  for i, out in enumerate(_workers(runs)):
    counts = (out["process_count"], out["device_count"],
              out["local_device_count"])
    assert counts == (_NUM_PROCESSES, _NUM_DEVICES, _DEVICES_PER_PROCESS), i
    assert out["context_processes"] == [0, 1], i  # the 'context' axis spans both
  reference = runs["reference"]
  counts = (reference["process_count"], reference["device_count"])
  assert counts == (1, _NUM_DEVICES)


@pytest.mark.parametrize("fit", _FITS)
def test_two_processes_train_as_one(runs, fit):
  """The same losses and parameters as one process with as many devices
  (in memory: every process passes all the data; stream: each its rows)."""
  reference = runs["reference"][fit]
  want = _leaves(reference["params"])
  for i, out in enumerate(_workers(runs)):
    got = out[fit]
    assert got["step"] == reference["step"], (i, fit)
    np.testing.assert_allclose(got["loss"], reference["loss"], rtol=0,
                               atol=_ATOL, err_msg=f"process {i}, {fit}: loss")
    params = _leaves(got["params"])
    assert params.keys() == want.keys(), (i, fit)
    for path, value in params.items():
      np.testing.assert_allclose(value, want[path], rtol=0, atol=_ATOL,
                                 err_msg=f"process {i}, {fit}: {path}")
  # Both processes report one run: the losses each read, bit for bit.
  first, second = (out[fit]["loss"] for out in _workers(runs))
  assert first == second, fit


@pytest.mark.parametrize("fit", _FITS)
def test_each_process_holds_its_devices_shards(runs, fit):
  """Every parameter and optimizer-state leaf is one array over all 8
  devices; each process holds the 4 shards of its devices, shaped as the
  one process's (sharded under 'fsdp', whole otherwise)."""
  reference = runs["reference"][fit]
  for key in ("placement", "opt_placement"):
    for out in _workers(runs):
      assert out[fit][key].keys() == reference[key].keys(), (fit, key)
    for path, (spans, shards) in reference[key].items():
      assert not spans and len(shards) == _NUM_DEVICES, (fit, path)
      for i, out in enumerate(_workers(runs)):
        spans_i, shards_i = out[fit][key][path]
        assert spans_i, (i, fit, path)  # a global array, not a local copy
        assert shards_i == shards[:_DEVICES_PER_PROCESS], (i, fit, path)
  full = {p: list(v.shape) for p, v in _leaves(reference["params"]).items()}
  split = [path for path, (_, shards) in reference["placement"].items()
           if shards[0] != full[_json_path(path)]]
  if fit == "fsdp":
    assert split, reference["placement"]  # the [32, 32] matrix
  else:
    assert not split, split
