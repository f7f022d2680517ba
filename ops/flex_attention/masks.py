"""Which (query, key) tiles a flex-attention call's mask opens, and the loops
that visit them. Shared by the Triton kernels (`triton.py`,
`triton_backward.py`) and, through the callables `pallas` hands them, the
Mosaic GPU ones.

`st` is the call's static description (`static.Static`): `left`, `right`
(the window; causal is right = 0), `kv_mask` (key lengths), `key_length`, `segments`,
`mask_mod` and `any_mask` are what these functions read. Tiles are in three
classes: fully open (no mask arithmetic), partly masked (masked body), and
closed (never visited). Loop bounds are computed from block indices, or with a
`mask_mod`, taken from per-program lists built once per call in XLA
(`tile_lists`).
"""

import functools

from jax import lax
import jax.numpy as jnp


# With the first tile's row maxima frozen (`triton.py`, "The first-tile
# maxima"), a row sum at or past this (p up to 2^64 / S; inf or NaN on
# overflow) marks the row for the online softmax's second pass. It keeps
# acc = sum p v inside f32 for |v| < 2^64.
FROZEN_SUM_LIMIT = 2.0 ** 64


def div(a, b: int):
  """Floor division of a non-negative traced (or static) int by a static int."""
  if isinstance(a, int):
    return a // b
  return lax.div(a, jnp.int32(b))


def cdiv(a, b: int):
  return div(a + (b - 1), b)


def i32(x):
  return jnp.asarray(x, jnp.int32)


def clip(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def key_length(st, lengths_ref, index):
  """The key length of a batch row: entry `index` of the kernel's key-length
  operand, or, when the call has no `key_value_seq_lengths` (and so no such operand:
  nothing to build or load per call), the static S of every row."""
  return st.key_length if lengths_ref is None else lengths_ref[index]


def key_length_operand(kv_len, kernel):
  """(operands, kernel) for a Mosaic GPU kernel whose first input is the [B]
  key lengths: `kv_len` as int32, or none and the kernel given None."""
  if kv_len is None:
    return (), functools.partial(kernel, None)
  return (kv_len.astype(jnp.int32),), kernel


def is_open(st, q_idx, k_idx, kv_len, q_seg, k_seg, b=None, n=None):
  """Boolean tile (broadcast of q_idx and k_idx): may query q_idx see k_idx?"""
  ok = None
  conj = lambda a, b: b if a is None else jnp.logical_and(a, b)
  if st.right is not None:
    ok = conj(ok, k_idx <= q_idx + st.right)
  if st.left is not None:
    ok = conj(ok, k_idx >= q_idx - st.left)
  if st.kv_mask:
    ok = conj(ok, k_idx < kv_len)
  if st.segments:
    ok = conj(ok, q_seg == k_seg)
  if st.mask_mod is not None:
    ok = conj(ok, st.mask_mod(b, n, q_idx, k_idx))
  return ok


def key_tiles(st, q0, bq: int, bk: int, kv_len, seq_kv: int):
  """Key-tile ranges of the query tile at q0: lo <= full_lo <= full_hi <= hi.

  Tiles [lo, full_lo) and [full_hi, hi) are partly masked, [full_lo, full_hi)
  fully open, the rest fully masked (skipped).
  """
  kv_end = kv_len if st.kv_mask else seq_kv
  lo = 0 if st.left is None else div(jnp.maximum(q0 - st.left, 0), bk)
  hi_key = kv_end
  if st.right is not None:
    hi_key = jnp.minimum(hi_key, q0 + bq + st.right)
  hi = cdiv(hi_key, bk)
  if st.segments:
    return lo, lo, lo, hi
  full_lo = 0 if st.left is None else cdiv(jnp.maximum(q0 + bq - 1 - st.left, 0), bk)
  full_key = kv_end
  if st.right is not None:
    full_key = jnp.minimum(full_key, q0 + st.right + 1)
  full_hi = div(full_key, bk)
  full_lo = clip(full_lo, lo, hi)
  full_hi = clip(full_hi, full_lo, hi)
  return lo, full_lo, full_hi, hi


def query_tiles(st, k0, bq: int, bk: int, kv_len, seq_q: int):
  """Query-tile ranges of the key tile at k0 (same layout as `key_tiles`)."""
  lo = 0 if st.right is None else div(jnp.maximum(k0 - st.right, 0), bq)
  hi_q = seq_q if st.left is None else jnp.minimum(seq_q, k0 + bk + st.left)
  hi = cdiv(hi_q, bq)
  if st.kv_mask:
    # A key tile past the length: no work. (Scalar `where` operands must be
    # typed: the Triton lowering gives a weak literal the predicate's type.)
    hi = jnp.where(k0 < kv_len, i32(hi), i32(lo))
  if st.segments:
    return lo, lo, lo, hi
  full_lo = 0 if st.right is None else cdiv(jnp.maximum(k0 + bk - 1 - st.right, 0), bq)
  full_hi = seq_q // bq if st.left is None else div(k0 + st.left + 1, bq)
  if st.kv_mask:
    full_hi = jnp.where(k0 + bk <= kv_len, i32(full_hi), i32(0))
  full_lo = clip(full_lo, lo, hi)
  full_hi = clip(full_hi, full_lo, hi)
  return lo, full_lo, full_hi, hi


def _at(group: int | None):
  """Index of entry i of this program's lists (row `group` of [R, .] lists)."""
  return (lambda i: (i,)) if group is None else (lambda i: (group, i))


def _open_range(st, ranges):
  """`ranges` with [full_lo, full_hi) all of [lo, hi) when nothing is masked."""
  lo, full_lo, full_hi, hi = ranges
  return (lo, lo, hi, hi) if not st.any_mask else (lo, full_lo, full_hi, hi)


def tile_loop(st, ranges, lists, body, carry, group: int | None = None):
  """Visits the tiles: from the mask's ranges, or from `mask_mod`'s lists.

  Runs body(index, carry, masked) over the fully open tiles, then over the
  partly masked ones (`masked_tile_loop`). `lists` (refs) holds, for this
  program, the count and the indices of the fully open tiles and of the
  partly masked ones (computed in XLA from the dense mask, `tile_lists`);
  tiles on neither list are never visited. `group` selects the row of
  [R, .] lists (dK/dV: one row per query head; the forward's second pass
  holds a (batch, head)'s lists of every query tile, a row per tile).
  """
  open_body = functools.partial(body, masked=False)
  if lists is None:
    _, full_lo, full_hi, _ = _open_range(st, ranges)
    carry = lax.fori_loop(full_lo, full_hi, open_body, carry)
  else:
    count, tile = open_tiles(st, ranges, lists, group)
    carry = lax.fori_loop(0, count, lambda t, c: open_body(tile(t), c), carry)
  return masked_tile_loop(st, ranges, lists, body, carry, group)


def open_tiles(st, ranges, lists, group: int | None = None):
  """(count, tile): the fully open key tiles of this program are tile(i) for
  i in [0, count), in the order `tile_loop` visits them."""
  if lists is None:
    _, full_lo, full_hi, _ = _open_range(st, ranges)
    return full_hi - full_lo, lambda i: full_lo + i
  at = _at(group)
  full_count, full_index = lists[:2]
  return full_count[at(0)], lambda i: full_index[at(i)]


def masked_tile_loop(st, ranges, lists, body, carry, group: int | None = None):
  """Runs body(index, carry, masked=True) over the partly masked tiles only
  (the rest of `tile_loop`'s walk after the open tiles)."""
  masked = functools.partial(body, masked=True)
  if lists is None:
    if not st.any_mask:
      return carry
    lo, full_lo, full_hi, hi = ranges
    carry = lax.fori_loop(lo, full_lo, masked, carry)
    return lax.fori_loop(full_hi, hi, masked, carry)
  at = _at(group)
  part_count, part_index = lists[2:]
  return lax.fori_loop(0, part_count[at(0)], lambda t, c: masked(part_index[at(t)], c), carry)


def tile_lists(dense, bq: int, bk: int, batch: int, num_heads: int, *,
               groups: int | None = None):
  """Per-program lists of open and partly masked tiles, from the dense mask.

  Args:
    dense: [B or 1, N or 1, Tp, Sp] bool, the whole mask.
    bq, bk: the kernel's tiles.
    batch, num_heads: B and N to broadcast to.
    groups: None for the query-tile kernels (forward, dQ): lists over key
      tiles per query tile, [B, N, nq, .]. G for dK/dV: lists over query tiles
      per key tile, [B, K, G, nk, .].

  Returns:
    (full_count [..., 1], full_index [..., n], part_count, part_index) int32;
    the first `count` entries of an index row are the tiles to visit.
  """
  b_, n_, tp, sp = dense.shape
  tiles = dense.reshape(b_, n_, tp // bq, bq, sp // bk, bk)
  any_open, all_open = tiles.any(axis=(3, 5)), tiles.all(axis=(3, 5))
  if groups is not None:
    any_open, all_open = (jnp.swapaxes(x, 2, 3) for x in (any_open, all_open))
  out = []
  for flag in (all_open, any_open & ~all_open):
    flag = jnp.broadcast_to(flag, (batch, num_heads) + flag.shape[2:])
    out.append(jnp.sum(flag, axis=-1, keepdims=True, dtype=jnp.int32))
    out.append(jnp.argsort(~flag, axis=-1, stable=True).astype(jnp.int32))
  if groups is not None:
    out = [x.reshape(batch, num_heads // groups, groups, *x.shape[2:]) for x in out]
  return tuple(out)
