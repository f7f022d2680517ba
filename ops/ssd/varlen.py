"""Variable-length packed batches for the chunked ops (`ssd`, `gated_delta_rule`).

A packed batch holds S sequences one after another on the time axis of a
batch of one, delimited by `cu_seqlens` [S + 1] (the convention of
flash-attention and flash-linear-attention): sequence s is tokens
`cu_seqlens[s]` to `cu_seqlens[s + 1] - 1`, each starting from its own initial
state and ending in its own final state.

The chunked tiers lay every sequence out on whole chunks of its own (at least
one; padded with steps that leave the state unchanged: zero q, k, v, beta and
log-decay 0), so no chunk holds two sequences and every chunk's parallel work
is unchanged. Only the walk over the chunks knows the sequences: before the
first chunk of sequence s its state becomes `initial_state[s]`, and after its
last chunk the state is `final_state[s]` (the reverse walk of a gradient
likewise takes `d final_state[s]` at the last chunk and gives
`d initial_state[s]` at the first). No log-decay of -inf and no division
appears, so neither the values nor the gradients can turn into NaN.

Glossary of shapes: T packed time, S sequences, C chunks of the layout, L
tokens per chunk, P = C L padded time.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import numpy as np

from ops import _shapes


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the packed tokens go on the chunk grid (int32 arrays)."""
  source: jax.Array  # [P] the packed token at each padded position
  valid: jax.Array   # [P] bool: the position holds a token (else padding)
  target: jax.Array  # [T] the padded position of each packed token
  inside: jax.Array  # [T] bool: the token lies in a sequence
  starts: jax.Array  # [C] the sequence starting at each chunk, else -1
  ends: jax.Array    # [C] the sequence ending at each chunk, else -1


def num_chunks(time: int, num_seqs: int, chunk: int) -> int:
  """Chunks of the layout: each sequence takes max(1, ceil(len / L)) <= len // L + 1."""
  return time // chunk + num_seqs


def check(op: str, cu_seqlens, batch: int, time: int, initial_state, state_shape) -> None:
  """ValueErrors naming `cu_seqlens` (int [S + 1], S >= 1, with a batch of one;
  when its values are known: 0 first, T last, nondecreasing) or
  `initial_state` ([S, *state_shape])."""
  _shapes.check_arrays(op, (("cu_seqlens", cu_seqlens),))
  if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
    raise ValueError(f"{op}: `cu_seqlens` must be [S + 1] with S >= 1 sequences, got "
                     f"shape {cu_seqlens.shape}")
  if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
    raise ValueError(f"{op}: `cu_seqlens` must be integers, got {cu_seqlens.dtype}")
  if batch != 1:
    raise ValueError(f"{op}: with `cu_seqlens` the sequences are packed on the time "
                     f"axis of a batch of one, got B = {batch}")
  num_seqs = cu_seqlens.shape[0] - 1
  if initial_state is not None and initial_state.shape != (num_seqs, *state_shape):
    raise ValueError(f"{op}: with `cu_seqlens` `initial_state` must be [S, N, K, V] = "
                     f"{(num_seqs, *state_shape)}, got {initial_state.shape}")
  if isinstance(cu_seqlens, jax.core.Tracer):
    return  # its values are checked where they are known
  values = np.asarray(cu_seqlens)
  if values[0] != 0 or values[-1] != time or np.any(np.diff(values) < 0):
    raise ValueError(f"{op}: `cu_seqlens` must rise from 0 to T = {time} without "
                     f"decreasing, got {values.tolist()}")


def layout(cu_seqlens: jax.Array, time: int, chunk: int) -> Layout:
  """The chunk layout of the packed sequences (`num_chunks` chunks of `chunk`)."""
  cu = cu_seqlens.astype(jnp.int32)
  num_seqs = cu.shape[0] - 1
  chunks = num_chunks(time, num_seqs, chunk)
  lengths = cu[1:] - cu[:-1]                                         # [S]
  owned = jnp.maximum(1, _shapes.cdiv(lengths, chunk))              # chunks per sequence
  first = jnp.cumsum(owned) - owned                                  # [S]
  seq_ids = jnp.arange(num_seqs, dtype=jnp.int32)
  starts = jnp.full((chunks,), -1, jnp.int32).at[first].set(seq_ids)
  ends = jnp.full((chunks,), -1, jnp.int32).at[first + owned - 1].set(seq_ids)
  position = jnp.arange(chunks * chunk, dtype=jnp.int32)
  chunk_seq = jnp.clip(jnp.searchsorted(first, position // chunk, side="right") - 1,
                       0, num_seqs - 1)
  local = position - first[chunk_seq] * chunk
  valid = local < lengths[chunk_seq]
  source = jnp.clip(cu[chunk_seq] + local, 0, time - 1)
  token = jnp.arange(time, dtype=jnp.int32)
  token_seq = jnp.clip(jnp.searchsorted(cu, token, side="right") - 1, 0, num_seqs - 1)
  target = jnp.clip(first[token_seq] * chunk + token - cu[token_seq], 0,
                    chunks * chunk - 1)
  inside = (token >= cu[0]) & (token < cu[-1])
  return Layout(source, valid, target, inside, starts, ends)


def on_chunks(cu_seqlens, chunk: int, *arrays):
  """(the layout, `arrays` [1, T, ...] each laid out on it); (None, `arrays`)
  without `cu_seqlens`."""
  if cu_seqlens is None:
    return None, arrays
  lay = layout(cu_seqlens, arrays[0].shape[1], chunk)
  return lay, tuple(to_chunks(x, lay) for x in arrays)


def off_chunks(y: jax.Array, lay: Layout | None, time: int) -> jax.Array:
  """[B, Tp, ...] -> [B, T, ...]: the first T rows, or with a layout each
  packed token's row."""
  return y[:, :time] if lay is None else from_chunks(y, lay)


def num_states(batch: int, cu_seqlens) -> int:
  """Initial and final states: one per batch row, or per packed sequence."""
  return batch if cu_seqlens is None else cu_seqlens.shape[0] - 1


def to_chunks(x: jax.Array, lay: Layout) -> jax.Array:
  """[1, T, ...] -> [1, P, ...] on the layout, zeros at the padding."""
  x = jnp.take(x, lay.source, axis=1)
  return jnp.where(lay.valid.reshape((1, -1) + (1,) * (x.ndim - 2)), x, 0)


def from_chunks(y: jax.Array, lay: Layout) -> jax.Array:
  """[1, P, ...] -> [1, T, ...]: each packed token's row (zeros outside the sequences)."""
  y = jnp.take(y, lay.target, axis=1)
  return jnp.where(lay.inside.reshape((1, -1) + (1,) * (y.ndim - 2)), y, 0)


def token_layout(cu_seqlens: jax.Array, time: int) -> tuple[jax.Array, jax.Array]:
  """(starts, ends) [T] for a walk over tokens (the references): the
  sequence starting and ending at each token, else -1 (empty sequences have
  neither: their final state is their initial one)."""
  cu = cu_seqlens.astype(jnp.int32)
  num_seqs = cu.shape[0] - 1
  seq_ids = jnp.arange(num_seqs, dtype=jnp.int32)
  empty = cu[1:] == cu[:-1]
  # Index T is out of range: the scatter drops empty sequences.
  starts = jnp.full((time,), -1, jnp.int32).at[jnp.where(empty, time, cu[:-1])].set(
      seq_ids, mode="drop")
  ends = jnp.full((time,), -1, jnp.int32).at[jnp.where(empty, time, cu[1:] - 1)].set(
      seq_ids, mode="drop")
  return starts, ends


def scan_with_resets(step, xs, starts, ends, initial_states):
  """`lax.scan` of `step(state, x) -> (state, y)` over axis 0 of `xs`, the
  state [1, ...] restarting as `initial_states[s]` before step `c` where
  `starts[c] = s` and read as sequence `ends[c]`'s final state after it.

  Returns (ys, final states [S, ...] float32; a sequence with no step keeps
  its initial state)."""
  def body(carry, inputs):
    state, finals = carry
    start, end, x = inputs
    state = jnp.where(start >= 0, initial_states[jnp.maximum(start, 0)][None], state)
    state, y = step(state, x)
    slot = jnp.maximum(end, 0)
    finals = finals.at[slot].set(jnp.where(end >= 0, state[0], finals[slot]))
    return (state, finals), y

  initial_states = initial_states.astype(jnp.float32)
  init = (jnp.zeros_like(initial_states[:1]), initial_states)
  (_, finals), ys = jax.lax.scan(body, init, (starts, ends, xs))
  return ys, finals


def _entry(ref, c):
  """`ref[c]` of an int32 [C] ref inside a walk kernel, as a scalar."""
  return jnp.sum(ref[pl.ds(c, 1)])


def enter(resets_ref, inits_ref, c, state):
  """Inside a walk kernel: the float32 state entering chunk `c`, which is
  `inits_ref[s]` where sequence `s = resets_ref[c]` enters there, else `state`."""
  seq = _entry(resets_ref, c)
  return jax.lax.cond(seq >= 0, lambda: inits_ref[jnp.maximum(seq, 0)].astype(jnp.float32),
                      lambda: state)


def leave(exits_ref, outs_ref, c, state) -> None:
  """Inside a walk kernel: stores `state`, the state leaving chunk `c`, as
  `outs_ref[s]` where sequence `s = exits_ref[c]` leaves there."""
  seq = _entry(exits_ref, c)

  @pl.when(seq >= 0)
  def _():
    outs_ref[jnp.maximum(seq, 0)] = state.astype(outs_ref.dtype)


def per_chunk_spec(chunks: int) -> pl.BlockSpec:
  """The BlockSpec of a walk's [C] starts or ends (whole, on any grid)."""
  return pl.BlockSpec((chunks,), lambda *_: (0,))
