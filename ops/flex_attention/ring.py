"""Ring attention: `flex_attention` with the sequence split over mesh axes.

Ring attention (Liu, Zaharia and Abbeel 2023, https://arxiv.org/abs/2310.01889)
is context parallelism for softmax attention. Each device keeps its queries;
the key/value shards travel around the ring of devices along the sequence
axes, one `ppermute` hop per step, and each step's block attention gives a
partial output and its log-sum-exp, merged into the running output. The
backward runs the ring again: each key/value shard travels with its dK/dV
accumulators, which one last hop brings home, while dQ stays put. Only shards
cross devices, never the sequence.

Causal balance (the zig-zag split of Llama 3's context parallelism): with the
sequence cut into 2n chunks, device d holds chunks d and 2n-1-d, so at every
step every device computes two quarter-size blocks (three at step 0), where
the contiguous split leaves device 0 idle after one step and keeps device
n-1 busy for n. The caller's arrays hold the contiguous split, so a causal
ring first moves q, k, v and the segment ids into zig-zag order (two
half-shard collective-permutes each) and the output back, which is each
shard sent once against the ring's 2 (n - 1) key/value shard hops.

Which blocks a device computes at each step is static: `schedule` lists them
from the causal and window masks, a block outside them is skipped, and the
ring stops after the last step any device needs. Masks, key lengths, segment
ids and the mods see global positions, and global batch and head indices
where those axes are split too.

A block runs on XLA (`reference.flex_attention_reference` with `indices`) or
on the Pallas kernels (`pallas.forward_with_lse`, `pallas.backward_with_lse`;
`Kernels`). The kernels take no global positions, and need none: over a
block whose keys start `shift` positions after its queries, s - t is the
local s' - t' plus `shift`, so the causal mask and the window are the local
window (left + shift, right - shift), a side that does not cut the block
dropped (`Schedule.windows`). Key lengths and segment ids become the
block's own. Only the mods see absolute positions: a call with a
`mask_mod` or `score_mod` runs on XLA blocks (`kernel_limit`).

Glossary of shapes: B batch, T query tokens, S key/value tokens, N query
heads, K key/value heads, H head size (B, N and K a device's share where
those axes are split too), n devices along the sequence axes, c tiles per
shard (2 zig-zag, else 1), tq = T / (n c) and tk = S / (n c) tokens per tile.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ops import _sequence_parallel
from ops import _sharding
from ops.flex_attention import configs
from ops.flex_attention import pallas
from ops.flex_attention import reference

_OP = "flex_attention"
_TOKENS = ("batch", "seq", "heads", None)  # q [B, T, N, H]; k, v [B, S, K, H]
_IDS = ("batch", "seq")  # segment ids [B, T] or [B, S]
_F32 = jnp.float32

CLOSED = 0  # the kind of a block no query of which sees a key: skipped


def _chunk(devices: int, device, tile: int):
  """The chunk that `device`'s tile `tile` holds: tile 0 chunk d, tile 1
  (zig-zag only) chunk 2n-1-d."""
  return 2 * devices - 1 - device if tile else device


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Which (query tile, key tile) blocks each device computes at each step.

  At step j device d holds the key/value shard of device (d - j) mod n. A
  shard is `tiles` tiles of consecutive positions: chunk d of n
  (contiguous), or chunks d and 2n-1-d of 2n (zig-zag).
  """
  devices: int  # n, the ring's length
  zigzag: bool
  # [n][steps][c][c] (device, step, query tile, key tile): CLOSED, or k >= 1
  # for a block computed with the local window `windows[k - 1]`.
  kinds: tuple
  windows: tuple  # (left, right) local windows (a None side: unbounded)

  @property
  def visits(self) -> tuple:
    """[n][steps][c][c] bools: whether a block is computed."""
    return _frozen(np.asarray(self.kinds) != CLOSED)

  @property
  def tiles(self) -> int:
    return 2 if self.zigzag else 1

  @property
  def steps(self) -> int:
    return len(self.visits[0])

  def chunk(self, device, tile: int):
    """The chunk (of n c) that `device`'s tile `tile` holds; `device` an int or an int array."""
    return _chunk(self.devices, device, tile)

  def busiest(self) -> float:
    """The ring's critical path in full shard-by-shard blocks: the steps run in
    lockstep, each as long as its busiest device."""
    work = np.asarray(self.visits).sum(axis=(2, 3)) / self.tiles ** 2  # [n, steps]
    return float(work.max(axis=0).sum())


def schedule(devices: int, seq_q: int, seq_kv: int, *, is_causal: bool, window,
             zigzag: bool) -> Schedule:
  """The blocks the causal and window masks leave open, for a ring of
  `devices`, trimmed after the last step that any device uses."""
  tiles = 2 if zigzag else 1
  size_q, size_k = seq_q // (devices * tiles), seq_kv // (devices * tiles)
  left, right = window or (None, None)
  if is_causal:
    right = 0 if right is None else min(right, 0)

  windows = {}  # local window -> its kind

  def kind(q_chunk: int, k_chunk: int) -> int:
    q_start, k_start = q_chunk * size_q, k_chunk * size_k
    # Over the block, s - t takes every integer from `nearest` to `farthest`.
    nearest, farthest = k_start - (q_start + size_q - 1), k_start + size_k - 1 - q_start
    if not ((right is None or nearest <= right) and (left is None or farthest >= -left)):
      return CLOSED
    shift = k_start - q_start  # s - t = s' - t' + shift, (t', s') the block's own
    local = (None if left is None or nearest >= -left else left + shift,
             None if right is None or farthest <= right else right - shift)
    return windows.setdefault(local, len(windows) + 1)

  kinds = np.array([[[[kind(_chunk(devices, d, p), _chunk(devices, (d - j) % devices, r))
                       for r in range(tiles)] for p in range(tiles)] for j in range(devices)]
                    for d in range(devices)])  # [n, n, c, c]
  used = np.flatnonzero((kinds != CLOSED).any(axis=(0, 2, 3)))
  steps = int(used[-1]) + 1 if used.size else 1
  return Schedule(devices, zigzag, _frozen(kinds[:, :steps]), tuple(windows))


def _frozen(a: np.ndarray):
  """An array as nested tuples (hashable, for a static argument)."""
  return tuple(map(_frozen, a)) if a.ndim else a.item()


def choose_schedule(devices: int, seq_q: int, seq_kv: int, *, is_causal: bool,
                    window) -> Schedule:
  """Zig-zag where it shortens the ring's critical path (causal calls that
  the window does not already balance), else contiguous."""
  contiguous = schedule(devices, seq_q, seq_kv, is_causal=is_causal, window=window,
                        zigzag=False)
  if not is_causal or devices == 1 or seq_q % (2 * devices) or seq_kv % (2 * devices):
    return contiguous
  zigzag = schedule(devices, seq_q, seq_kv, is_causal=is_causal, window=window, zigzag=True)
  return zigzag if zigzag.busiest() < contiguous.busiest() else contiguous


@dataclasses.dataclass(frozen=True)
class Kernels:
  """Blocks on the Pallas kernels, launched as `config` (a `configs.FlexConfig`) says."""
  config: configs.FlexConfig
  interpret: bool


@dataclasses.dataclass(frozen=True)
class _Ring:
  """The static description of one call's ring."""
  schedule: Schedule
  axes: tuple[str, ...]  # the mesh axes the sequence is split over
  is_causal: bool
  scale: float
  window: tuple | None
  mask_mod: reference.MaskMod | None
  score_mod: reference.ScoreMod | None
  kernels: Kernels | None = None  # None: XLA blocks


def splits_sequence(q, k) -> str | None:
  """The argument ('q' or 'k') whose sequence axis (axis 1) is split over
  mesh axes (Explicit ones, or any of an array placed outside a trace), or
  None: such a call runs as ring attention."""
  return next((name for name, x in (("q", q), ("k", k))
               if _sequence_parallel.splits_time(x)), None)


def kernel_limit(call) -> str | None:
  """Why ring attention on the kernels cannot take `call` (an `ops.flex_attention`
  call's q, k, mask_mod and score_mod); None when it can, or when the
  sequence is whole."""
  if call["mask_mod"] is None and call["score_mod"] is None:
    return None
  name = splits_sequence(call["q"], call["k"])
  if name is None:
    return None
  return (f"`{name}` is split along its sequence axis (axis 1) over mesh axes (ring "
          "attention), and `mask_mod` and `score_mod` see global positions, which the "
          "kernels do not take; implementation='xla' runs the ring on XLA blocks")


def _call_schedule(call) -> Schedule | None:
  """The ring's schedule for an `ops.flex_attention` call; None when its
  sequence is whole."""
  q, k = call["q"], call["k"]
  split = plan(q, k, call["v"], call["q_ids"], call["kv_ids"], call["key_value_seq_lengths"])
  if split is None:
    return None
  return choose_schedule(split.size("seq"), q.shape[1], k.shape[1],
                         is_causal=call["is_causal"], window=call["window"])


def block_lengths(call) -> tuple[int, int]:
  """(T, S) of the attention blocks a call runs: the whole call's, or the
  ring's tiles where its sequence is split."""
  q, k = call["q"], call["k"]
  sched = _call_schedule(call)
  cut = 1 if sched is None else sched.devices * sched.tiles
  return q.shape[1] // cut, k.shape[1] // cut


def plan(q, k, v, q_ids, kv_ids, key_value_seq_lengths) -> _sharding.Plan | None:
  """How a call splits over the mesh when its sequence axis is split; None when
  no argument's sequence axis is split over an Explicit mesh axis.

  Raises:
    ValueError: naming the argument and the axis, when the arguments split
      their sequence (or batch, or head) axes differently, when a length
      cannot be cut evenly alike, or when the head size is split.
  """
  if not _sequence_parallel.splits_time(q, k, v, q_ids, kv_ids):
    return None
  return _sharding.plan(_OP, (
      ("q", q, _TOKENS), ("k", k, _TOKENS), ("v", v, _TOKENS),
      ("segment_ids", q_ids, _IDS), ("segment_ids", kv_ids, _IDS),
      ("key_value_seq_lengths", key_value_seq_lengths, ("batch",))),
      split=("batch", "seq", "heads"))


def _tile(x, tile: int, tiles: int, axis: int = 1):
  """Tile `tile` of `tiles` along `axis` (None stays None)."""
  if x is None or tiles == 1:
    return x
  size = x.shape[axis] // tiles
  return jax.lax.slice_in_dim(x, tile * size, (tile + 1) * size, axis=axis)


def _join(tiles: list, axis: int = 1) -> jax.Array:
  return tiles[0] if len(tiles) == 1 else jnp.concatenate(tiles, axis=axis)


def _block(ring: _Ring, window, q, k, v, q_ids, kv_ids, lengths, indices):
  """(out [B, tq, N, H] f32, lse [B, N, tq]) of one query tile against one key
  tile: on XLA (`window` unused), or on the kernels with the block's local
  `window` (`Schedule.windows`)."""
  if ring.kernels is not None:
    return pallas.forward_with_lse(
        q, k, v, **_kernel_options(ring, window, q_ids, kv_ids, lengths, indices))
  return reference.flex_attention_reference(
      q.astype(_F32), k.astype(_F32), v.astype(_F32), is_causal=ring.is_causal,
      scale=ring.scale, segment_ids=None if q_ids is None else (q_ids, kv_ids),
      local_window_size=ring.window, key_value_seq_lengths=lengths,
      mask_mod=ring.mask_mod, score_mod=ring.score_mod, return_lse=True, indices=indices)


def _kernel_options(ring: _Ring, window, q_ids, kv_ids, lengths, indices) -> dict:
  """The kernels' arguments for a block: its local window (the causal mask
  included), its own key lengths and segment ids."""
  if lengths is not None:  # global lengths -> this key tile's
    lengths = jnp.clip(lengths - indices[3][0], 0, indices[3].shape[0])
  return dict(scale=ring.scale, is_causal=False,
              window=None if window == (None, None) else window, q_segment_ids=q_ids,
              kv_segment_ids=kv_ids, key_value_seq_lengths=lengths,
              interpret=ring.kernels.interpret, config=ring.kernels.config)


def _computed(ring: _Ring, kind, block, skipped):
  """`block(window)` where the block is open (`kind` traced), else
  `skipped()`: on XLA one branch for every open block, on the kernels one
  per local window."""
  if ring.kernels is None:
    return jax.lax.cond(kind != CLOSED, lambda: block(None), skipped)
  return jax.lax.switch(kind, [skipped] + [functools.partial(block, window)
                                           for window in ring.schedule.windows])


def _merge(out, lse, out_b, lse_b):
  """The attention over two key sets from each one's (out [B, tq, N, H], lse [B, N, tq])."""
  top = jnp.maximum(lse, lse_b)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  weight, weight_b = jnp.exp(lse - top), jnp.exp(lse_b - top)
  total = weight + weight_b
  safe = jnp.where(total == 0, 1.0, total)
  per_row = lambda w: jnp.swapaxes(w / safe, 1, 2)[..., None]  # [B, tq, N, 1]
  return (out * per_row(weight) + out_b * per_row(weight_b),
          jnp.where(total == 0, -jnp.inf, top + jnp.log(safe)))


def _shift(x, ring: _Ring, by: int):
  """`x` (a pytree) sent from each device to the one `by` further along the ring."""
  devices = ring.schedule.devices
  if by % devices == 0:
    return x
  return jax.lax.ppermute(x, ring.axes, [(d, (d + by) % devices) for d in range(devices)])


def _walk(ring: _Ring, compute, shard, sums, state):
  """`(sums, state) = compute(step, shard, sums, state)` at every step, the
  key/value `shard` and its `sums` then passed one hop along the ring.

  Returns the last step's (sums, state): the sums of the shard of device
  (d - steps + 1) mod n."""
  def step(carry, j):
    shard, sums, state = carry
    after = _shift(shard, ring, 1)  # does not wait on the step's blocks: they may overlap
    sums, state = compute(j, shard, sums, state)
    return (after, _shift(sums, ring, 1), state), None

  steps = ring.schedule.steps
  if steps > 1:
    (shard, sums, state), _ = jax.lax.scan(step, (shard, sums, state), jnp.arange(steps - 1))
  return compute(steps - 1, shard, sums, state)


def _blocks(ring: _Ring, where, step, q, k):
  """Each (query tile p, key tile r, its kind at `step` on this device, the
  block's global (b, n, t, s) indices)."""
  sched = ring.schedule
  device, first_row, first_head = where[0], where[1], where[2]
  source = (device - step) % sched.devices
  size_q, size_k = q.shape[1] // sched.tiles, k.shape[1] // sched.tiles
  kinds = jnp.asarray(sched.kinds, jnp.int32)
  for p in range(sched.tiles):
    for r in range(sched.tiles):
      yield p, r, kinds[device, step, p, r], (
          first_row + jnp.arange(q.shape[0]), first_head + jnp.arange(q.shape[2]),
          sched.chunk(device, p) * size_q + jnp.arange(size_q),
          sched.chunk(source, r) * size_k + jnp.arange(size_k))


def _forward(ring: _Ring, q, k, v, q_ids, kv_ids, lengths, where):
  """(out [B, T/n, N, H] f32, lse [B, N, T/n]) of this device's queries."""
  c = ring.schedule.tiles
  rows = [(jnp.zeros(_tile(q, p, c).shape, _F32),
           jnp.full((q.shape[0], q.shape[2], q.shape[1] // c), -jnp.inf, _F32))
          for p in range(c)]

  def compute(step, shard, sums, rows):
    k, v, kv_ids = shard
    rows = list(rows)
    for p, r, kind, indices in _blocks(ring, where, step, q, k):
      out, lse = rows[p]
      empty = lambda: (jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf))
      block = functools.partial(
          _block, ring, q=_tile(q, p, c), k=_tile(k, r, c), v=_tile(v, r, c),
          q_ids=_tile(q_ids, p, c), kv_ids=_tile(kv_ids, r, c), lengths=lengths,
          indices=indices)
      rows[p] = _merge(out, lse, *_computed(ring, kind, block, empty))
    return sums, rows

  _, rows = _walk(ring, compute, (k, v, kv_ids), (), rows)
  return _join([o for o, _ in rows]), _join([l for _, l in rows], axis=2)


def _block_grads(ring: _Ring, window, q, k, v, q_ids, kv_ids, lengths, indices, out, lse,
                 dout):
  """(dq, dk, dv) f32 of one block, from its rows' whole out, lse and dout.

  On XLA: a row's output is sum_b exp(lse_b - lse) out_b over its blocks b,
  so a block's (out_b, lse_b) receive the cotangents w_b dout and
  w_b sum_h dout (out_b - out), with w_b = exp(lse_b - lse). The kernels'
  backward takes the whole row's out and lse as they are."""
  if ring.kernels is not None:
    return pallas.backward_with_lse(
        q, k, v, out, lse, dout, **_kernel_options(ring, window, q_ids, kv_ids, lengths, indices))
  (out_b, lse_b), pull = jax.vjp(
      lambda q, k, v: _block(ring, window, q, k, v, q_ids, kv_ids, lengths, indices),
      q.astype(_F32), k.astype(_F32), v.astype(_F32))
  weight = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - lse), 0.0)  # [B, N, tq]
  d_lse = weight * jnp.swapaxes(jnp.sum(dout * (out_b - out), axis=-1), 1, 2)
  return pull((dout * jnp.swapaxes(weight, 1, 2)[..., None], d_lse))


def _backward(ring: _Ring, q, k, v, q_ids, kv_ids, lengths, where, out, lse, dout):
  """(dq, dk, dv) f32 of this device's shards; dk and dv travel with k and v."""
  c = ring.schedule.tiles

  def compute(step, shard, sums, dq):
    k, v, kv_ids = shard
    dq = list(dq)
    dk, dv = [_tile(sums[0], r, c) for r in range(c)], [_tile(sums[1], r, c) for r in range(c)]
    for p, r, kind, indices in _blocks(ring, where, step, q, k):
      tiles = (_tile(q, p, c), _tile(k, r, c), _tile(v, r, c))
      grads = _computed(ring, kind, functools.partial(
          _block_grads, ring, q=tiles[0], k=tiles[1], v=tiles[2], q_ids=_tile(q_ids, p, c),
          kv_ids=_tile(kv_ids, r, c), lengths=lengths, indices=indices,
          out=_tile(out, p, c), lse=_tile(lse, p, c, axis=2), dout=_tile(dout, p, c)),
          lambda: tuple(jnp.zeros(x.shape, _F32) for x in tiles))
      dq[p], dk[r], dv[r] = dq[p] + grads[0], dk[r] + grads[1], dv[r] + grads[2]
    return (_join(dk), _join(dv)), dq

  sums = (jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
  dq = [jnp.zeros(_tile(q, p, c).shape, _F32) for p in range(c)]
  sums, dq = _walk(ring, compute, (k, v, kv_ids), sums, dq)
  dk, dv = _shift(sums, ring, 1 - ring.schedule.steps)  # home to the shard's device
  return _join(dq), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, q_ids, kv_ids, lengths, where):
  """This device's output [B, T/n, N, H] f32 (`where`: its index along the
  sequence axes, its first batch row and first head, int32 [3])."""
  return _forward(ring, q, k, v, q_ids, kv_ids, lengths, where)[0]


def _ring_fwd(ring, q, k, v, q_ids, kv_ids, lengths, where):
  out, lse = _forward(ring, q, k, v, q_ids, kv_ids, lengths, where)
  return out, (q, k, v, q_ids, kv_ids, lengths, where, out, lse)


def _ring_bwd(ring, residuals, dout):
  q, k, v, q_ids, kv_ids, lengths, where, out, lse = residuals
  dq, dk, dv = _backward(ring, q, k, v, q_ids, kv_ids, lengths, where, out, lse, dout)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _holder(devices: int, chunk: int) -> int:
  """The device holding `chunk` (of 2n) in zig-zag order."""
  return chunk if chunk < devices else 2 * devices - 1 - chunk


def _zigzag(x, ring: _Ring, device):
  """This device's contiguous share [B, L/n, ...] (chunks 2d and 2d+1 of 2n)
  -> its zig-zag tiles (chunks d and 2n-1-d); None stays None."""
  if x is None:
    return None
  n = ring.schedule.devices
  to_holder = lambda half: [(d, _holder(n, 2 * d + half)) for d in range(n)]
  even = jax.lax.ppermute(_tile(x, 0, 2), ring.axes, to_holder(0))
  odd = jax.lax.ppermute(_tile(x, 1, 2), ring.axes, to_holder(1))
  # Chunk d has d's parity, chunk 2n-1-d the other.
  return jnp.where(device % 2 == 0, _join([even, odd]), _join([odd, even]))


def _unzigzag(x, ring: _Ring, device):
  """The inverse of `_zigzag`."""
  n = ring.schedule.devices
  from_holder = lambda half: [(_holder(n, 2 * d + half), d) for d in range(n)]
  mine, mirrored = _tile(x, 0, 2), _tile(x, 1, 2)
  even_first = device % 2 == 0
  first = jax.lax.ppermute(jnp.where(even_first, mine, mirrored), ring.axes, from_holder(0))
  second = jax.lax.ppermute(jnp.where(even_first, mirrored, mine), ring.axes, from_holder(1))
  return _join([first, second])


def flex_attention_ring(split: _sharding.Plan, *, q, k, v, is_causal, scale, window, q_ids,
                        kv_ids, key_value_seq_lengths, mask_mod, score_mod,
                        kernels: Kernels | None = None, **_) -> jax.Array:
  """`flex_attention` on `split`'s arrays ([B, T, N, H] q, [B, S, K, H] k and
  v), the sequence split over its mesh axes, its blocks on XLA or on the
  kernels (`kernels`, where `kernel_limit` admits the call); [B, T, N, H] in
  q's dtype, split as q is."""
  axes = _sequence_parallel.time_axes(split)
  ring = _Ring(choose_schedule(split.size("seq"), q.shape[1], k.shape[1], is_causal=is_causal,
                               window=window),
               axes, is_causal, scale, window, mask_mod, score_mod, kernels)
  assert kernels is None or (mask_mod is None and score_mod is None), "kernel_limit declines mods"
  batch_axes, head_axes = split.axes.get("batch", ()), split.axes.get("heads", ())
  zigzag = ring.schedule.zigzag
  shared_ids = q_ids is kv_ids  # one [B, T] array for queries and keys

  def shard(q, k, v, q_ids, kv_ids, lengths):
    device = jax.lax.axis_index(axes)
    first = lambda axes, size: jax.lax.axis_index(axes) * size if axes else 0
    where = jnp.stack([device, first(batch_axes, q.shape[0]),
                       first(head_axes, q.shape[2])]).astype(jnp.int32)
    if zigzag:
      q, k, v, q_ids = (_zigzag(x, ring, device) for x in (q, k, v, q_ids))
      kv_ids = q_ids if shared_ids else _zigzag(kv_ids, ring, device)
    out = _ring(ring, q, k, v, q_ids, kv_ids, lengths, where)
    if zigzag:
      out = _unzigzag(out, ring, device)
    return out.astype(q.dtype)

  return split.run(shard, _TOKENS)
