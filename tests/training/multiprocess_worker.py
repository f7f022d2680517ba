"""One process of `test_multiprocess.py`: `fit()` on its share of a mesh.

    python -m tests.training.multiprocess_worker OUT_JSON NUM_PROCESSES \
        PROCESS_ID COORDINATOR_ADDRESS

With NUM_PROCESSES 1 it runs alone (the reference, on every local device);
otherwise it first joins the others through `jax.distributed.initialize`.
Every process runs the same fits: in memory (each process passes the whole
data set), on a stream (each process yields its own rows of every global
batch), in memory with `parameter_sharding='fsdp'` (`fit_model`), and a
causal Transformer with its sequence split over a 'context' axis that
crosses the processes (ring attention's permutes between them). It
writes the gathered parameters, the loss history and how its arrays are
placed to OUT_JSON.
"""

import json
import os
import sys
import traceback

import haiku as hk
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

import probjax_hk
from tests.training import common

BATCH_SIZE = 16
NUM_STEPS = 6
# Steps per compiled call: the 6 steps run as one 4-step call and two single
# steps, so both compiled forms (and, on the stream, both ways of placing a
# batch: stacked [4, B, ...] and single [B, ...]) cross the processes.
STEPS_PER_CALL = 4


def _wide_loss(batch):
  # A [32, 32] matrix (1024 elements, FSDP_MIN_SIZE): 'fsdp' splits it over
  # all 8 devices; the smaller leaves stay replicated.
  pred = hk.nets.MLP([32, 32, 1])(batch["x"])[:, 0]  # [B]
  return jnp.mean((pred - batch["y"]) ** 2)


WIDE_NET = hk.transform(_wide_loss)


def _causal_loss(batch):
  y = probjax_hk.Transformer(16, 2, 1, is_causal=True, use_rope=True)(batch["x"])  # [B, T, D]
  return jnp.mean((y - batch["y"]) ** 2)


CAUSAL_NET = hk.transform(_causal_loss)


def local_stream(data, batch_size):
  """Global batches of `batch_size` rows, of which this process yields its
  own contiguous slice [B / P, ...] (the rows its devices hold)."""
  rows = batch_size // jax.process_count()
  first = jax.process_index() * rows
  for batch in common.stream(data, batch_size):
    yield {k: v[first:first + rows] for k, v in batch.items()}


def gathered(tree):
  """Every leaf as nested lists of its global value (from every process)."""
  return jax.tree.map(lambda x: np.asarray(x).tolist(),
                      multihost_utils.process_allgather(tree, tiled=True))


def placement(tree):
  """Per leaf: [spans processes, this process's shard shapes]."""
  return {jax.tree_util.keystr(path): [
      not x.is_fully_addressable,
      sorted(list(s.data.shape) for s in x.addressable_shards)]
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def summary(result):
  return {"params": gathered(result.params),
          "loss": result.history["loss"].tolist(),
          "step": result.step,
          "placement": placement(result.params),
          "opt_placement": placement(result.opt_state)}


def main(out_path, num_processes, process_id, coordinator):
  if num_processes > 1:
    # Gloo carries CPU collectives between processes (JAX 0.11's default,
    # named so that a change of default cannot leave them unimplemented).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator,
                               num_processes=num_processes,
                               process_id=process_id,
                               initialization_timeout=120)
  data = common.make_data()
  kw = dict(batch_size=BATCH_SIZE, optimizer=common.OPTIMIZER, progress=False,
            rng=2, steps_per_call=STEPS_PER_CALL)
  out = {"process_count": jax.process_count(),
         "device_count": jax.device_count(),
         "local_device_count": jax.local_device_count()}
  out["arrays"] = summary(probjax_hk.fit(
      common.loss_fn, common.init_params(), data, num_steps=NUM_STEPS, **kw))
  out["stream"] = summary(probjax_hk.fit(
      common.loss_fn, common.init_params(), local_stream(data, BATCH_SIZE),
      **kw))
  # fit_model creates the parameters in their 'fsdp' shardings.
  out["fsdp"] = summary(probjax_hk.fit_model(
      WIDE_NET, data, num_steps=NUM_STEPS, parameter_sharding="fsdp", **kw))
  # 'context' first: with the devices in process order, its two halves are
  # the two processes' devices.
  mesh = jax.make_mesh((2, 4), ("context", "data"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  out["context_processes"] = sorted({d.process_index for d in mesh.devices[:, 0]})
  rs = np.random.RandomState(0)
  sequences = {k: rs.randn(8, 16, 16).astype(np.float32) for k in ("x", "y")}  # [B, T, D]
  out["context"] = summary(probjax_hk.fit_model(
      CAUSAL_NET, sequences, num_steps=NUM_STEPS, mesh=mesh, sequence_axis="context",
      **dict(kw, batch_size=8)))
  with open(out_path, "w") as f:
    json.dump(out, f)


if __name__ == "__main__":
  try:
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
         sys.argv[4] if len(sys.argv) > 4 else None)
  except BaseException:  # pylint: disable=broad-except
    # Exit at once: a normal exit waits at the distributed shutdown barrier
    # for the other processes, which may wait for this one.
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
