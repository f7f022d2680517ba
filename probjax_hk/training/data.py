"""The two kinds of training data `fit()` takes: in-memory arrays and streams.

In-memory data is a pytree of arrays with a shared leading dimension N. It is
copied once to every device; each epoch is a permutation drawn with a JAX key
(`fold_in(data_key, epoch)`), and the compiled step gathers its batch from the
device copy with that permutation, so no batch crosses the host. The batch of
global step `s` is a pure function of `(data_key, s)`: a resumed fit sees the
same batches as an uninterrupted one.

A stream is any Python iterable of batches (numpy or JAX pytrees). On an
accelerator a background thread converts each batch and places it on the mesh,
staying `PREFETCH` (two) items ahead of the step, so the host's data work
overlaps the device's. On a CPU mesh the host's cores are the device: a thread
there takes cores from the step it would overlap (BUILD_NOTES.md, fit()),
so the main thread prepares each item instead,
while the call dispatched before it runs. With `steps_per_call=K` an item is K
batches stacked [K, B, ...] (one transfer, one compiled call). The stream
ending ends the fit.

The last partial batch (an epoch's remainder, or a short batch from a stream)
is dropped (`last_batch='drop'`) or padded to the full batch size
(`last_batch='pad'`) with a boolean row mask passed to the loss as `mask=`, so
the step keeps one shape and never recompiles.

Glossary of shapes: N examples, B batch size.
"""

import functools
import itertools
import math
import queue
import threading
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sized

import jax
import jax.numpy as jnp
import numpy as np

from probjax_hk.training import sharding as sharding_lib

PREFETCH = 2
BLOCK_STEPS = 64  # in-memory data: epochs' orders are drawn >= this many steps at a time
LAST_BATCH_MODES = ("drop", "pad")
_END = object()


def is_in_memory(data) -> bool:
  """True for a pytree of arrays, False for an iterable of batches.

  A top-level `list` is a sequence of batches; a dict, tuple, namedtuple or
  array (of arrays) is in-memory data.
  """
  if isinstance(data, (list, Iterator)):
    return False
  leaves = jax.tree.leaves(data)
  return bool(leaves) and all(
      isinstance(x, (np.ndarray, jax.Array)) for x in leaves)


def _path_name(path) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def leading_dim(tree, argname: str) -> int:
  """The shared leading dimension of a pytree of arrays (ValueError if none)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not leaves:
    raise ValueError(f"`{argname}` holds no arrays")
  dims = {}
  for path, x in leaves:
    if np.ndim(x) == 0:
      raise ValueError(f"`{argname}` leaf {_path_name(path)} is a scalar; every"
                       " leaf needs a leading batch dimension")
    dims[_path_name(path)] = np.shape(x)[0]
  if len(set(dims.values())) > 1:
    raise ValueError(f"`{argname}` leaves have mismatched leading dimensions:"
                     f" {dims}")
  return next(iter(dims.values()))


def pad_rows(batch, size: int):
  """Pads the leading axis of a host batch to `size` (edge rows repeated).

  Returns:
    (padded batch [size, ...], mask [size] bool, True on the real rows).
  """
  n = leading_dim(batch, "batch")
  mask = np.arange(size) < n
  if n == size:
    return batch, mask
  def pad(x):
    x = np.asarray(x)
    return np.concatenate([x, np.repeat(x[-1:], size - n, axis=0)])
  return jax.tree.map(pad, batch), mask


class ArrayData:
  """A pytree of arrays [N, ...] on the mesh, batched by the compiled step."""

  def __init__(self, data, *, batch_size: int | None, last_batch: str, mesh,
               argname: str = "data", steps_per_call: int = 1):
    self.num_examples = leading_dim(data, argname)
    if self.num_examples == 0:
      raise ValueError(f"`{argname}` holds no examples (its leaves have leading"
                       f" dimension 0)")
    if batch_size is None:
      batch_size = self.num_examples
    if batch_size > self.num_examples:
      raise ValueError(f"`batch_size` must be <= the number of examples in"
                       f" `{argname}`, got {batch_size=} and"
                       f" {self.num_examples} examples")
    self.batch_size = batch_size
    self.last_batch = last_batch
    if last_batch == "pad":
      self.steps_per_epoch = -(-self.num_examples // batch_size)
    else:
      self.steps_per_epoch = self.num_examples // batch_size
    self.arrays = sharding_lib.put_replicated(data, mesh)
    self.mesh = mesh

    # Orders are drawn a block of epochs at a time, at least BLOCK_STEPS steps'
    # worth: with one or a few steps per epoch, a host call per epoch would
    # cost more than the step itself. A multi-step call cannot cross a block,
    # so where it costs at most 4x the block, the block is a whole number of
    # `steps_per_call` calls (else each block would end in single steps).
    epochs = -(-BLOCK_STEPS // self.steps_per_epoch)
    whole = steps_per_call // math.gcd(self.steps_per_epoch, steps_per_call)
    aligned = -(-epochs // whole) * whole
    self.epochs_per_block = aligned if aligned <= 4 * epochs else epochs

  def permutation(self, data_key, block: int) -> jax.Array:
    """The example order of epochs `block * E ... block * E + E - 1`
    (E = `epochs_per_block`), each cut or padded to `steps_per_epoch * B`,
    concatenated: [E * steps_per_epoch * B]. Epoch e's order depends only on
    `(data_key, e)`, whatever the block size."""
    first = np.int32(block * self.epochs_per_block)
    return _permutation(data_key, first, self.epochs_per_block,
                        self.num_examples,
                        self.steps_per_epoch * self.batch_size,
                        sharding_lib.replicated(self.mesh))


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _permutation(data_key, first_epoch, num_epochs, num_examples, length,
                 out_sharding):
  def one(epoch):
    perm = jax.random.permutation(jax.random.fold_in(data_key, epoch),
                                  num_examples)
    if length <= num_examples:  # 'drop': the remainder is left out
      return perm[:length]
    return jnp.pad(perm, (0, length - num_examples))  # 'pad': masked rows
  perms = jax.vmap(one)(first_epoch + jnp.arange(num_epochs, dtype=jnp.int32))
  return jax.lax.with_sharding_constraint(
      perms.reshape(-1).astype(jnp.int32), out_sharding)


class StreamItem(NamedTuple):
  """Device batches for `count` steps: [B, ...] when `count` is 1, else
  stacked [count, B, ...]; `mask` likewise ([B] / [count, B] bool) or None."""
  batch: Any
  mask: Any
  count: int

  def split(self) -> list["StreamItem"]:
    """The single steps of a stacked item (slices on the device)."""
    return [StreamItem(jax.tree.map(lambda x: x[i], self.batch),
                       None if self.mask is None else self.mask[i], 1)
            for i in range(self.count)]


class StreamData:
  """An iterable of batches, placed on the mesh ahead of the step."""

  def __init__(self, data: Iterable, *, batch_size: int | None,
               last_batch: str, mesh, argname: str = "data",
               steps_per_call: int = 1, background: bool | None = None,
               sequence_axis: str | None = None, tensor_axis: str | None = None):
    """`background`: prepare items in a thread (`Prefetcher`); None: unless
    every device of `mesh` is a CPU (module docstring). `sequence_axis`: the
    mesh axis each batch's time axis is split over, `tensor_axis` one it is
    kept whole along (`sharding.batch_spec`)."""
    iterator = iter(data)
    first = next(iterator, _END)
    if first is _END:
      raise ValueError(f"`{argname}` is an empty stream: it yielded no batch")
    first_size = leading_dim(first, f"{argname} (first batch)")
    local = jax.process_count()
    if batch_size is None:
      batch_size = first_size * local
    if first_size > batch_size // local:
      raise ValueError(f"`{argname}` yielded a batch of {first_size} rows per"
                       f" process, larger than `batch_size`={batch_size}")
    if first_size < batch_size // local and last_batch == "drop":
      raise ValueError(f"`{argname}`'s first batch has {first_size} rows per"
                       f" process, fewer than `batch_size`={batch_size}: with"
                       f" last_batch='drop' every such batch would be dropped")
    self.batch_size = batch_size
    self.last_batch = last_batch
    self.steps_per_call = steps_per_call
    if background is None:
      background = any(d.platform != "cpu" for d in mesh.devices.flat)
    self.background = background
    self.first = first
    self.mesh = mesh
    self.sequence_axis = sequence_axis
    self.tensor_axis = tensor_axis
    self._iterator = itertools.chain([first], iterator)
    self._prefetcher = None

  def limit_steps_per_call(self, item_bytes: int) -> None:
    """Fewer steps per call where `steps_per_call` batches like the first
    would stack into more than `item_bytes` (call before iterating)."""
    if self._prefetcher is not None:
      raise RuntimeError("limit_steps_per_call after the stream started")
    batch_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(self.first))
    self.steps_per_call = max(1, min(self.steps_per_call,
                                     item_bytes // max(1, batch_bytes)))

  def _on_host(self, batch):
    """Host batch -> (batch, mask or None) at the full size; None to drop it."""
    local_size = self.batch_size // jax.process_count()
    n = leading_dim(batch, "batch")
    if n > local_size:
      raise ValueError(f"a stream batch has {n} rows, more than `batch_size`"
                       f"={self.batch_size} (per process: {local_size})")
    sharding_lib.check_time_length(batch, self.mesh, self.sequence_axis,
                                   "stream batch")
    mask = None
    if self.last_batch == "pad":
      batch, mask = pad_rows(batch, local_size)
    elif n < local_size:
      return None
    return batch, mask

  def _put(self, batch, mask, count: int = 1) -> StreamItem:
    place = lambda x: sharding_lib.put_batch(
        x, self.mesh, stacked=count > 1, sequence_axis=self.sequence_axis,
        tensor_axis=self.tensor_axis)
    return StreamItem(place(batch), None if mask is None else place(mask), count)

  def _prepare(self, batch) -> StreamItem | None:
    on_host = self._on_host(batch)
    return None if on_host is None else self._put(*on_host)

  def _prepare_group(self, batches) -> StreamItem | list[StreamItem] | None:
    """K host batches -> one stacked item; fewer (the stream's tail, or
    dropped partial batches) -> a list of single-step items."""
    on_host = [h for h in map(self._on_host, batches) if h is not None]
    if len(on_host) < self.steps_per_call:
      return [self._put(*h) for h in on_host] or None
    batch = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                         *[b for b, _ in on_host])
    mask = None if on_host[0][1] is None else np.stack([m for _, m in on_host])
    return self._put(batch, mask, len(on_host))

  def __iter__(self):
    feeder = Prefetcher if self.background else InlineFeeder
    if self.steps_per_call == 1:
      self._prefetcher = feeder(self._iterator, self._prepare)
    else:
      groups = iter(lambda: list(itertools.islice(self._iterator, self.steps_per_call)), [])
      self._prefetcher = feeder(groups, self._prepare_group)
    return self._prefetcher

  def close(self):
    if self._prefetcher is not None:
      self._prefetcher.close()


class InlineFeeder:
  """`Prefetcher`'s interface without a thread: `prepare` runs on `next`."""

  def __init__(self, iterator: Iterator, prepare: Callable[[Any], Any]):
    self._iterator = iterator
    self._prepare = prepare

  def __iter__(self):
    return self

  def __next__(self):
    while True:
      prepared = self._prepare(next(self._iterator))
      if prepared is not None:
        return prepared

  def close(self):
    pass


class Prefetcher:
  """Runs `prepare(item)` over an iterator in a thread, `size` items ahead.

  Exceptions of the iterator or of `prepare` are re-raised by `__next__` in the
  consuming thread; `prepare` returning None skips the item.
  """

  def __init__(self, iterator: Iterator, prepare: Callable[[Any], Any],
               size: int = PREFETCH):
    self._queue = queue.Queue(maxsize=size)
    self._stop = threading.Event()
    self._thread = threading.Thread(
        target=self._run, args=(iterator, prepare), daemon=True,
        name="probjax_hk-prefetch")
    self._thread.start()

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _run(self, iterator, prepare):
    try:
      for item in iterator:
        if self._stop.is_set():
          return
        prepared = prepare(item)
        if prepared is not None and not self._put(prepared):
          return
    except BaseException as e:  # pylint: disable=broad-except
      self._put(_Raised(e))
      return
    self._put(_END)

  def __iter__(self):
    return self

  def __next__(self):
    item = self._queue.get()
    if item is _END:
      self._queue.put(_END)  # stays exhausted
      raise StopIteration
    if isinstance(item, _Raised):
      raise item.error
    return item

  def close(self):
    """Stops the thread (it may be blocked inside the user's iterator)."""
    self._stop.set()
    try:
      while True:
        self._queue.get_nowait()
    except queue.Empty:
      pass
    self._thread.join(timeout=1.0)


class _Raised:

  def __init__(self, error: BaseException):
    self.error = error


def validation_batches(data, batch_size: int, argname: str = "validation_data"):
  """Returns a function yielding host batches of `validation_data` each call.

  Arrays are cut into batches of `min(batch_size, N)` rows, the remainder as a
  smaller last batch (an exact mean needs no padding: batch losses are weighted
  by their row count). Iterables must be re-iterable (a list of batches, not a
  generator).
  """
  if is_in_memory(data):
    n = leading_dim(data, argname)
    if n == 0:
      raise ValueError(f"`{argname}` holds no examples (its leaves have leading"
                       f" dimension 0)")
    size = min(batch_size, n)
    def arrays():
      for start in range(0, n, size):
        yield jax.tree.map(lambda x: x[start:start + size], data)
    return arrays
  if isinstance(data, Iterator) or not isinstance(data, Iterable):
    raise ValueError(f"`{argname}` must be a pytree of arrays or a re-iterable"
                     f" collection of batches (e.g. a list), got {type(data)}")
  if isinstance(data, Sized) and len(data) == 0:
    raise ValueError(f"`{argname}` is empty: it holds no batch to evaluate")
  return lambda: iter(data)
