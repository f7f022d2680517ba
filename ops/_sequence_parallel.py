"""Context parallelism for the recurrences: the time axis split over mesh axes.

A recurrence whose state after a chunk of steps is an affine map of the state
before it (`h_out = transition(h_in) + final`, with `final` the chunk's end
state from a zero start) splits over devices the way a chunked kernel splits
over programs (LASP, Sun et al. 2024, https://arxiv.org/abs/2404.02882; the
state passing of Mamba-2's SSD, Dao and Gu 2024):

1. each device runs the op on its own chunk of the sequence from a zero
   state: its outputs up to a correction, its final state, and its chunk's
   total transition;
2. `entering_states` all-gathers those per-device summaries over the
   sequence axes ([n, ...] each, n the number of chunks) and runs the
   recurrence over the n devices, which gives each device the state entering
   its chunk (and every device the state after the last chunk);
3. each device corrects its outputs with the state entering its chunk.

So the only communication is the summaries: O(devices x state), never O(T).
The op runs steps 1 and 3 per shard with `run` (`ops/_sharding.py`'s
`Plan.run`), with "seq" among the labels its plan splits: the arrays'
layouts say which mesh axes split the sequence: Explicit mesh axes, and
Auto ones only for arrays passed outside a trace (under `jax.jit` the types
do not say how an array is split over Auto axes).
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ops import _sharding

_GATHERED = "sequence_parallel_summaries"  # the checkpoint name of the gathered summaries
Step = Callable[[Any, Any], Any]  # (state entering a chunk, its summary) -> state leaving it


def _saved(x: jax.Array) -> jax.Array:
  """`x` named for `run`'s checkpoint to keep; a complex `x` as its two real
  planes, as JAX's checkpoint cannot keep a named complex value (it rounds
  what it keeps with reduce_precision, which takes real floats only)."""
  if not jnp.iscomplexobj(x):
    return checkpoint_name(x, _GATHERED)
  planes = checkpoint_name(jnp.stack([x.real, x.imag]), _GATHERED)
  return jax.lax.complex(planes[0], planes[1])


def time_axes(plan: _sharding.Plan) -> tuple[str, ...]:
  """The mesh axes `plan` splits the sequence over (empty: none). An axis of
  size 1 counts: an Explicit-typed time axis needs the per-shard path even
  then."""
  return plan.axes.get("seq", ())


def splits_time(*arrays: jax.Array | None, axis: int = 1) -> bool:
  """Whether any of `arrays` has its time axis (`axis`) known to be split
  (`_sharding.placement`: over Explicit mesh axes, or over Auto ones for an
  array outside a trace): the call then takes the per-shard path. Read
  before an op plans its call, so a call whose time axis is whole keeps the
  op's usual path (and its usual freedom over the other axes)."""
  return any(x is not None and len(placed := _sharding.placement(x)) > axis
             and placed[axis] for x in arrays)


def run(plan: _sharding.Plan, chunk: Callable, out_layouts) -> Any:
  """`plan.run(chunk, out_layouts)`, the chunk's forward recomputed in the backward.

  The shard_map's residuals are then its inputs and the gathered summaries:
  the long-sequence case trades a second local forward pass for the [B, t,
  ...] intermediates, the backward gathers nothing again, and jaxlib 0.11's
  partitioner crashes on the zero-sized residuals that differentiating an
  associative scan leaves (fixed in 0.12).
  """
  policy = jax.checkpoint_policies.save_only_these_names(_GATHERED)
  return plan.run(jax.checkpoint(chunk, policy=policy), out_layouts)


def entering_states(step: Step, initial: Any, summary: Any, axes: tuple[str, ...], *,
                    reverse: bool = False) -> tuple[Any, Any]:
  """The state entering this device's chunk, and the state after the last chunk.

  Called per shard, inside a `jax.shard_map` manual over `axes`. The chunks
  are in the order of the devices' index along `axes` (the order
  `PartitionSpec(..., axes)` splits an array in).

  Args:
    step: the state leaving a chunk from the state entering it and the
      chunk's summary; any function (it need not be associative), run once
      per device.
    initial: the state entering the first chunk processed (the last chunk
      with `reverse`); the same on every device of `axes`.
    summary: this device's chunk summary, a pytree of arrays (for a diagonal
      recurrence its final state from zero and its total decay, [B, D] each).
    axes: the mesh axes the sequence is split over.
    reverse: the chunks are processed from the last device to the first.

  Returns:
    (entering, final): the state entering this device's chunk, and the state
    leaving the last chunk processed (the same on every device of `axes`).
  """
  if jax.lax.axis_size(axes) == 1:  # one chunk: nothing to exchange
    return initial, step(initial, summary)
  gathered = jax.lax.all_gather(summary, axes)  # each leaf [n, ...]: the only communication
  gathered = jax.tree.map(_saved, gathered)

  def over_devices(state, chunk):
    return step(state, chunk), state

  final, entering = jax.lax.scan(over_devices, initial, gathered, reverse=reverse)
  index = jax.lax.axis_index(axes)
  return jax.tree.map(lambda x: x[index], entering), final


class PackedChunk(NamedTuple):
  """Where one device's chunk of t tokens lies among packed sequences
  (`cu_seqlens` [S + 1]), read per shard inside the `shard_map` over `axes`."""
  first: jax.Array  # the chunk's first token
  starts: jax.Array  # [S] each sequence's first token
  ends: jax.Array  # [S] one past each sequence's last token
  carried: jax.Array  # [S] bool: the sequence open at the chunk's start, begun on a device before
  offsets: jax.Array  # [S + 1] the offsets cut to the chunk's tokens
  last: jax.Array  # the sequence holding the chunk's last token


def packed_chunk(cu_seqlens: jax.Array, axes: tuple[str, ...], tokens: int) -> PackedChunk:
  """This device's `PackedChunk`, its chunk `tokens` long."""
  first = jax.lax.axis_index(axes) * tokens
  cu = cu_seqlens.astype(jnp.int32)
  starts, ends = cu[:-1], cu[1:]
  return PackedChunk(first, starts, ends, (starts < first) & (ends > first),
                     jnp.clip(cu - first, 0, tokens),
                     jnp.argmax((starts < first + tokens) & (ends >= first + tokens)))


def collect_finals(chunk: PackedChunk, tokens: int, finals: jax.Array, initial: jax.Array,
                   axes: tuple[str, ...]) -> jax.Array:
  """Every sequence's final state [S, ...], the same on every device: each
  from the device holding its last token (`finals`, this device's [S, ...]),
  an empty sequence's its `initial` state."""
  last = chunk.ends - 1
  owned = (chunk.ends > chunk.starts) & (last >= chunk.first) & (last < chunk.first + tokens)
  per_sequence = lambda mask: mask.reshape(-1, *[1] * (finals.ndim - 1))
  finals = jax.lax.psum(jnp.where(per_sequence(owned), finals, 0.0), axes)
  return finals + jnp.where(per_sequence(chunk.ends == chunk.starts), initial, 0.0)
