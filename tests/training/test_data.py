"""Tests of the data layer: the prefetch thread, padding, data kinds."""

import threading
import time

import jax
import numpy as np
import pytest

from probjax_hk.training import data as data_lib
from probjax_hk.training import sharding


def test_prefetcher_stays_two_ahead_in_order_and_closes():
  pulled = []
  def source():
    for i in range(10):
      pulled.append(i)
      yield i
  prefetcher = data_lib.Prefetcher(source(), lambda x: x * 10)
  deadline = time.time() + 5
  while len(pulled) < 3 and time.time() < deadline:
    time.sleep(0.01)
  time.sleep(0.1)
  # Two prepared items wait in the queue, a third is blocked on the put.
  assert len(pulled) == 3
  assert [next(prefetcher) for _ in range(4)] == [0, 10, 20, 30]
  prefetcher.close()
  assert not prefetcher._thread.is_alive()  # pylint: disable=protected-access
  assert len(pulled) <= 7


def test_prefetcher_runs_in_background_and_reraises():
  threads = []
  def source():
    threads.append(threading.current_thread().name)
    yield 1
    raise KeyError("bad record")
  prefetcher = data_lib.Prefetcher(source(), lambda x: x)
  assert next(prefetcher) == 1
  with pytest.raises(KeyError, match="bad record"):
    next(prefetcher)
  assert threads == ["probjax_hk-prefetch"]


def test_prefetcher_skips_none_and_ends():
  prefetcher = data_lib.Prefetcher(iter(range(5)),
                                   lambda x: None if x % 2 else x)
  assert list(prefetcher) == [0, 2, 4]
  with pytest.raises(StopIteration):
    next(prefetcher)


def test_pad_rows_and_mask():
  batch = {"x": np.arange(6.0).reshape(3, 2)}
  padded, mask = data_lib.pad_rows(batch, 5)
  assert padded["x"].shape == (5, 2)
  np.testing.assert_array_equal(mask, [True, True, True, False, False])
  np.testing.assert_array_equal(padded["x"][:3], batch["x"])


def test_data_kinds():
  x = np.zeros((4, 2))
  assert data_lib.is_in_memory(x)
  assert data_lib.is_in_memory({"x": x, "y": x[:, 0]})
  assert data_lib.is_in_memory((x, x))
  assert not data_lib.is_in_memory([{"x": x}])  # a list is batches
  assert not data_lib.is_in_memory(iter([x]))
  assert not data_lib.is_in_memory(b for b in [x])


def test_stream_batches_land_on_the_mesh():
  mesh = sharding.default_mesh()
  stream = data_lib.StreamData(
      ({"x": np.full((n, 3), n, np.float32)} for n in (4, 4, 2)),
      batch_size=None, last_batch="pad", mesh=mesh)
  items = list(stream)
  stream.close()
  assert stream.batch_size == 4 and len(items) == 3
  batch, mask, count = items[-1]
  assert count == 1 and isinstance(batch["x"], jax.Array)
  assert batch["x"].sharding.is_equivalent_to(sharding.batch_sharding(mesh), 2)
  np.testing.assert_array_equal(mask, [True, True, False, False])
  with pytest.raises(ValueError, match="larger than `batch_size`"):
    data_lib.StreamData(iter([{"x": x} for x in [np.zeros((8, 1))]]),
                        batch_size=4, last_batch="drop", mesh=mesh)


def test_stream_groups_stack_steps_on_the_batch_axis():
  mesh = sharding.default_mesh()
  stream = data_lib.StreamData(
      ({"x": np.full((n, 3), i, np.float32)} for i, n in enumerate((4, 4, 4, 2, 4))),
      batch_size=None, last_batch="pad", mesh=mesh, steps_per_call=2)
  items = list(stream)
  stream.close()
  # Two full groups of two, then the tail as a list of single steps; the
  # stacked arrays split the batch (second) axis over the mesh.
  assert [item.count for item in items[:2]] == [2, 2]
  assert [item.count for item in items[2]] == [1]
  stacked = items[1]
  assert stacked.batch["x"].shape == (2, 4, 3)
  assert stacked.batch["x"].sharding.is_equivalent_to(
      sharding.batch_sharding(mesh, stacked=True), 3)
  np.testing.assert_array_equal(stacked.mask, [[True] * 4, [True, True, False, False]])
  first, second = stacked.split()
  np.testing.assert_array_equal(second.batch["x"][:, 0], [3, 3, 3, 3])
  np.testing.assert_array_equal(second.mask, [True, True, False, False])


@pytest.mark.parametrize("background", [None, True, False])
def test_stream_prepares_in_a_thread_only_off_cpu(background):
  mesh = sharding.default_mesh()
  stream = data_lib.StreamData(
      ({"x": np.full((4, 3), i, np.float32)} for i in range(5)),
      batch_size=None, last_batch="drop", mesh=mesh, background=background)
  threaded = background if background is not None else False  # CPU tests
  assert stream.background == threaded
  threads = []
  def prepare(batch, base=stream._prepare):  # pylint: disable=protected-access
    threads.append(threading.current_thread().name)
    return base(batch)
  stream._prepare = prepare  # pylint: disable=protected-access
  items = list(stream)
  stream.close()
  assert [int(item.batch["x"][0, 0]) for item in items] == [0, 1, 2, 3, 4]
  assert set(threads) == {"probjax_hk-prefetch" if threaded else "MainThread"}


def test_stream_steps_per_call_limited_by_item_bytes():
  mesh = sharding.default_mesh()
  def stream():  # 4 x 256 float32 = 4 KiB per batch
    return ({"x": np.zeros((4, 256), np.float32)} for _ in range(3))
  source = data_lib.StreamData(stream(), batch_size=None, last_batch="drop",
                               mesh=mesh, steps_per_call=64)
  source.limit_steps_per_call(40 * 1024)
  assert source.steps_per_call == 10
  source.limit_steps_per_call(100)  # smaller than one batch: one step per call
  assert source.steps_per_call == 1
  source = data_lib.StreamData(stream(), batch_size=None, last_batch="drop",
                               mesh=mesh, steps_per_call=4)
  source.limit_steps_per_call(1 << 30)  # never more than asked
  assert source.steps_per_call == 4
  list(source)
  with pytest.raises(RuntimeError, match="started"):
    source.limit_steps_per_call(1 << 30)
  source.close()


@pytest.mark.parametrize("examples,batch,steps_per_call,aligned", [
    (96, 16, 4, True),     # 6 steps per epoch: 12 epochs = 18 calls of 4
    (64, 8, 10, True),     # 8 per epoch: 10 epochs = 8 calls of 10
    (64, 8, 64, True),     # the automatic 64: 8 epochs = 1 call
    (70, 10, 1, True),     # one step per call: any block
    (1000, 1, 7, False),   # 1000 per epoch: 7 epochs would be 7x the block
])
def test_array_blocks_hold_whole_multi_step_calls(examples, batch, steps_per_call,
                                                  aligned):
  # A multi-step call cannot cross a block of epoch orders; a block that is a
  # whole number of calls leaves no single steps at its end.
  source = data_lib.ArrayData({"x": np.zeros((examples, 2), np.float32)},
                              batch_size=batch, last_batch="drop",
                              mesh=sharding.default_mesh(),
                              steps_per_call=steps_per_call)
  steps = source.epochs_per_block * source.steps_per_epoch
  assert steps >= data_lib.BLOCK_STEPS
  assert (steps % steps_per_call == 0) == aligned
