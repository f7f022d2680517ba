"""Mosaic GPU (Hopper) forward kernel of flex attention: TMA, wgmma, ping-pong.

The Triton forward (`triton.py`) runs a query tile's two matmuls and its
softmax one after the other in one group of warps. This kernel follows
FlashAttention-3 (https://arxiv.org/abs/2407.08608) instead:

- A CUDA block owns 2 x `block_q` query rows of one (batch, head) and has
  three warpgroups. One (the memory warpgroup) streams the key and value
  tiles into a ring of `max_concurrent_steps` shared-memory slots with TMA.
  The other two each own `block_q` rows and run `wgmma` on them.
- The two compute warpgroups take turns on the tensor cores: a shared
  barrier makes one issue its Q K^T while the other computes its softmax
  (the "schedule barrier"), so the exponentials of one overlap the matmuls
  of the other.
- P goes to the P V matmul straight from registers.
- With `fwd_softmax='first_tile_max'` (`triton.py`, "The first-tile
  maxima") a warpgroup's open key tiles after its first one run against that
  tile's row maxima: no maxima, no rescaling of the accumulator. Rows whose
  sums pass `masks.FROZEN_SUM_LIMIT` get a NaN lse for the Triton second pass.
- A work item is one block's query rows of one (batch, head). By default each
  item is a block of the grid. With `persistent` the grid has one block per
  SM, and the items are dealt to the blocks in rounds, alternately forward
  and backward. The ring's slots and barrier phases run on from item to
  item, so the memory warpgroup streams the next item's keys while the
  compute warpgroups finish the last one.

It writes the same outputs as the Triton forward, `out` and the base-2
log-sum-exp `lse` [B, N, Tp] (+inf for a query that sees no key), so the
Triton backward kernels run on them unchanged.

Masks are those of `static.Static` without segments or mods: causal, a
`(left, right)` window and key lengths, on tile indices. Each warpgroup walks
the block's key tiles in order: tiles outside its own range are waited for
and released but not computed (both warpgroups must see every slot of the
ring), partly masked tiles run a masked body, fully open ones a body without
mask arithmetic (`masks.key_tiles` gives the ranges, `masks.is_open` the
mask; the caller passes both).

Which calls take which walk (`configs.py`, `pallas.prepare`), what each
option measured on an H200 and the variants that lost: BUILD_NOTES.md,
"flex_attention".

The tiles are `configs.MosaicConfig`; the limits both Mosaic kernels share
live in `mosaic_tiles.py`.

Glossary: B batch, Tp / Sp padded query / key tokens, N query heads, K
key/value heads, G = N // K, Hp padded head size, WG warpgroup.
"""

import functools
import math
from typing import NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from ops import _pallas
from ops._mosaic_gpu import DTYPES
from ops._mosaic_gpu import num_sms
from ops._mosaic_gpu import swizzled
from ops.flex_attention import masks
from ops.flex_attention.configs import MosaicConfig
from ops.flex_attention.configs import NUM_COMPUTE_WGS
from ops.flex_attention.configs import SUM_COLUMNS
from ops.flex_attention.masks import FROZEN_SUM_LIMIT
from ops.flex_attention.masks import i32
from ops.flex_attention.mosaic_tiles import COMPUTE_REGISTERS
from ops.flex_attention.mosaic_tiles import config_limit
from ops.flex_attention.mosaic_tiles import HEAD_SIZES
from ops.flex_attention.mosaic_tiles import MEMORY_REGISTERS

_LOG2E = math.log2(math.e)

def takes(dtype, head_dim: int, seq_q: int, seq_kv: int,
          config: MosaicConfig, *, segments: bool, mods: bool) -> bool:
  """Whether this kernel runs a forward call (else the Triton kernel does).

  16-bit inputs at a padded head size it has, no segment ids or mods (not
  written here), and sequences that fill a block's query rows and a key tile
  (shorter ones would be mostly padding; Triton's tiles shrink to fit).
  """
  return (jnp.dtype(dtype) in DTYPES and not segments and not mods
          and seq_q >= config.rows_per_block and seq_kv >= config.block_k
          and _config_limit(config, head_dim) is None)


def _config_limit(config: MosaicConfig, head_dim: int) -> str | None:
  return config_limit(config, head_dim, kernel="forward", head_sizes=HEAD_SIZES)


def check_config(config: MosaicConfig, head_dim: int) -> None:
  if (limit := _config_limit(config, head_dim)) is not None:
    raise ValueError(limit)


class _Item(NamedTuple):
  """One work item of the forward: `rows_per_block` query rows of one
  (batch, query head), and the key tiles each warpgroup needs."""
  batch: jax.Array
  head: jax.Array
  kv_head: jax.Array
  q0: jax.Array  # the item's first query row
  kv_len: jax.Array | int  # int: the static length of every row
  ranges: list  # per warpgroup: (lo, full_lo, full_hi, hi), `key_tiles`'s
  lo: jax.Array  # the key tiles the memory warpgroup loads: [lo, hi)
  hi: jax.Array


def _kernel(kv_len_gmem, q_gmem, k_gmem, v_gmem, out_gmem, lse_gmem, *, st,
            config: MosaicConfig, key_tiles, is_open, interpret: bool):
  """One block: one work item, or (`config.persistent`) its share of them."""
  bq, bk, steps = config.block_q, config.block_k, config.max_concurrent_steps
  batch_size, seq_q, num_heads, hp = q_gmem.shape
  dtype = q_gmem.dtype
  seq_kv = k_gmem.shape[1]
  wgs = NUM_COMPUTE_WGS
  num_q_tiles = seq_q // config.rows_per_block
  num_items = num_heads * num_q_tiles * batch_size
  sm, num_blocks = lax.axis_index("sm"), lax.axis_size("sm")
  c = st.scale * _LOG2E  # logits -> base-2 units
  # A right-bounded call walked persistently (`prepare` allows it only with
  # `persistent_right_bounded`) has items of unequal work: heaviest first.
  heaviest_first = config.persistent and st.right is not None
  sums_on_tensor_cores = config.tensor_core_sums

  def own_item(position):
    """The item this block walks at `position`: round `position` of
    `num_blocks` items, dealt forward in even rounds and backward in odd ones."""
    seat = jnp.where(lax.rem(position, 2) == 0, sm, num_blocks - 1 - sm)
    return position * num_blocks + seat

  # The last round may be partial: this block has an item there if its seat
  # in that round falls among the items left.
  last_round = lax.div(num_items, num_blocks)
  num_own = last_round + (lax.rem(own_item(last_round), num_blocks)
                          < lax.rem(num_items, num_blocks)).astype(jnp.int32)

  def item_of(index) -> _Item:
    if heaviest_first:
      # Query tiles slowest, from the last (under a causal mask, the heaviest).
      q_tile = lax.div(index, batch_size * num_heads)
      rest = lax.rem(index, batch_size * num_heads)
      batch, head = lax.rem(rest, batch_size), lax.div(rest, batch_size)
    else:
      # Batch fastest, then query tiles in reverse order (under a causal mask
      # the last ones have the most key tiles, and blocks start in grid order),
      # then heads: the blocks that run at once share a few heads' keys and
      # values in L2, which heads fastest would spread over more heads.
      batch = lax.rem(index, batch_size)
      rest = lax.div(index, batch_size)
      q_tile, head = lax.rem(rest, num_q_tiles), lax.div(rest, num_q_tiles)
    q0 = (num_q_tiles - 1 - q_tile) * config.rows_per_block
    kv_len = masks.key_length(st, kv_len_gmem, batch)
    ranges = [key_tiles(q0 + wg * bq, bq, bk, kv_len, seq_kv) for wg in range(wgs)]
    lo = functools.reduce(jnp.minimum, [i32(r[0]) for r in ranges])
    hi = functools.reduce(jnp.maximum, [i32(r[3]) for r in ranges])
    return _Item(batch, head, lax.div(head, jnp.int32(st.groups)), q0, kv_len, ranges,
                 lo, jnp.maximum(hi, lo))

  def over_items(body):
    """body(position, item, base) -> base, over this block's items; `base`
    counts the key tiles the ring has held before the item."""
    def visit(position, base):
      return body(position, item_of(own_item(position)), base)
    return lax.fori_loop(0, num_own, visit, jnp.int32(0))

  def item_slot(item, base, j):  # the ring slot that holds the item's key tile j
    return lax.rem(base + j - item.lo, steps)

  def scoped(q_smem2, out_smem2, k_smem, v_smem, lse_smem2, p_smem2, ones_smem2, k_ready,
             v_ready, q_ready, k_free, v_free, turn):
    wg = lax.axis_index("wg")

    # The ping-pong turns; without them (`ping_pong=False`) no-ops.
    def arrive_turn():
      if config.ping_pong:
        plgpu.barrier_arrive(turn)

    def wait_turn():
      if config.ping_pong:
        plgpu.barrier_wait(turn)

    def take_turn():
      arrive_turn()
      wait_turn()

    def compute_item(position, item, base, *, wg, query_slot, lse_smem, out_smem, load_q):
      q0 = item.q0 + wg * bq
      kv_len = item.kv_len
      lo, full_lo, full_hi, hi = (  # this warpgroup's ranges
          functools.reduce(lambda picked, i: jnp.where(wg == i, i32(per_wg[i]), picked),
                           range(1, wgs), i32(per_wg[0]))
          for per_wg in zip(*item.ranges))
      # (A window can put lo past hi, and past the block's last tile.)
      lo = jnp.clip(lo, item.lo, item.hi)
      hi = jnp.clip(hi, lo, item.hi)
      full_lo = jnp.clip(full_lo, lo, hi)
      full_hi = jnp.clip(full_hi, full_lo, hi)
      ring_slot = functools.partial(item_slot, item, base)
      q_smem, q_arrived = query_slot(position)
      plgpu.barrier_wait(q_arrived)
      has_next = position + 1 < num_own
      if config.query_slots > 1:  # the next item's query tile, under this walk
        pl.when(has_next)(functools.partial(load_q, position + 1))

      row = plgpu.Layout.WGMMA.reduce(1)
      m = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row)
      if sums_on_tensor_cores:  # each row's sum SUM_COLUMNS times: P @ ones
        l = plgpu.layout_cast(jnp.zeros((bq, SUM_COLUMNS), jnp.float32), plgpu.Layout.WGMMA)
      else:
        l = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row)
      acc = plgpu.layout_cast(jnp.zeros((bq, hp), jnp.float32), plgpu.Layout.WGMMA)

      # The second warpgroup starts half a step behind the first.
      pl.when(wg == 1)(take_turn)

      def over_tiles(start, masked_fn, open_fn, carry, frozen_fn=None,
                     masked_frozen_fn=None):
        """Key tiles [start, hi) of this warpgroup: partly masked ones through
        `masked_fn`, fully open ones through `open_fn`, or with `frozen_fn`
        the first open one through `open_fn` and the others through it; with
        `masked_frozen_fn` the partly masked ones after an open one through
        that (`MosaicConfig.frozen_masked_tiles`)."""
        open_lo, open_hi = start, hi
        if st.any_mask:
          open_lo = jnp.maximum(start, full_lo)
          open_hi = jnp.maximum(open_lo, full_hi)
          carry = lax.fori_loop(start, open_lo, masked_fn, carry)
        if frozen_fn is None:
          carry = lax.fori_loop(open_lo, open_hi, open_fn, carry)
        else:
          first_hi = jnp.minimum(open_lo + 1, open_hi)
          carry = lax.fori_loop(open_lo, first_hi, open_fn, carry)
          carry = lax.fori_loop(first_hi, open_hi, frozen_fn, carry)
        if st.any_mask:
          online_from = open_hi
          if masked_frozen_fn is not None:
            # Maxima are kept once an open tile has run; else these tiles
            # are the row's first keys.
            online_from = jnp.where(open_lo < open_hi, hi, open_hi)
            carry = lax.fori_loop(open_hi, online_from, masked_frozen_fn, carry)
          carry = lax.fori_loop(online_from, hi, masked_fn, carry)
        return carry

      def softmax(s, j, m, l, masked, frozen=False):
        """Key tile j's logits s [bq, bk] -> (P in the input dtype, the new
        running max, the new running sum, the factor for the accumulator).
        `frozen`: against the row maxima m as they are (`triton.py`, "The
        first-tile maxima"): no maxima, no factor (None)."""
        if masked:
          layout = plgpu.Layout.WGMMA
          q_idx = q0 + plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=layout)
          k_idx = j * bk + plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=layout)
          s = jnp.where(is_open(q_idx, k_idx, kv_len), s, -jnp.inf)
        if frozen:  # (a masked key: exp2(-inf) = 0)
          p = jnp.exp2(s * c - lax.broadcast_in_dim(m, s.shape, [0]))
          return p.astype(dtype), m, add_row_sums(l, p), None
        m_new = jnp.maximum(m, s.max(axis=1) * c)
        if masked:
          # A row with nothing open so far: keep exp2 away from inf - inf.
          m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        else:
          m_use = m_new
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
        return p.astype(dtype), m_new, add_row_sums(rescale(l, alpha), p), alpha

      def add_row_sums(l, p):
        # With `tensor_core_sums` P V's wgmma adds them (`add_pv`).
        return l if sums_on_tensor_cores else l + p.sum(axis=1)

      def rescale(acc, alpha):
        if alpha is None:
          return acc
        if acc.ndim == 1:
          return acc * alpha
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

      def logits(slot):
        """Q K^T of the key tile in `slot`; the turn passes while it runs."""
        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          take_turn()
          return acc_ref[...]
        return pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))

      def add_pv(acc, l, p16, slot):
        """acc + P V and, with `tensor_core_sums`, l + P @ ones."""
        p_smem = None if p_smem2 is None else p_smem2.at[wg]
        if not sums_on_tensor_cores:
          return _add_product(acc, p16, v_smem.at[slot], p_smem), l
        return _add_products((acc, l), p16, (v_smem.at[slot], ones_smem2.at[wg]), p_smem)

      def body(j, carry, masked, frozen=False):
        acc, m, l = carry
        slot = ring_slot(j)
        plgpu.barrier_wait(k_ready.at[slot])
        s = logits(slot)
        plgpu.barrier_arrive(k_free.at[slot])
        p16, m_new, l, alpha = softmax(s, j, m, l, masked, frozen)
        acc = rescale(acc, alpha)
        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
        arrive_turn()  # softmax done
        plgpu.barrier_wait(v_ready.at[slot])
        wait_turn()  # the tensor cores are ours again

        acc, l = add_pv(acc, l, p16, slot)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

      def skip(j, carry):
        # Not this warpgroup's tile: see the slot through, keep the turns.
        slot = ring_slot(j)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        take_turn()
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        take_turn()
        return carry

      frozen_fn = masked_frozen_fn = None
      if st.config.keeps_first_tile_max:
        frozen_fn = functools.partial(body, masked=False, frozen=True)
        if config.frozen_masked_tiles:
          masked_frozen_fn = functools.partial(body, masked=True, frozen=True)
      carry = lax.fori_loop(item.lo, lo, skip, (acc, m, l))
      carry = over_tiles(lo, functools.partial(body, masked=True),
                         functools.partial(body, masked=False), carry, frozen_fn,
                         masked_frozen_fn=masked_frozen_fn)
      acc, m, l = lax.fori_loop(hi, item.hi, skip, carry)
      pl.when(wg == 0)(take_turn)

      if config.query_slots == 1:  # the walk's matmuls are done with q_smem
        pl.when(has_next)(functools.partial(load_q, position + 1))

      if sums_on_tensor_cores:  # (the SUM_COLUMNS copies are equal)
        l = l.sum(axis=1) * (1 / SUM_COLUMNS)
      empty = l == 0.0
      inv = 1.0 / jnp.where(empty, 1.0, l)
      if config.persistent:  # the last item's stores must be done reading
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      out_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
      # Base-2 log-sum-exp of the scaled logits; +inf marks a row that sees no
      # key, so that the backward's exp2(s * c - lse) is exactly 0 there.
      lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)) * (1 / math.log(2)))
      if st.config.keeps_first_tile_max:  # NaN: rows for the refresh
        lse = jnp.where(l < FROZEN_SUM_LIMIT, lse, jnp.nan)
      lse_smem[...] = lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[item.batch, pl.ds(q0, bq), item.head])
      plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[item.batch, item.head, pl.ds(q0, bq)])
      return base + item.hi - item.lo

    @pl.when(wg < wgs)
    def _compute():
      plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
      lse_smem = lse_smem2.at[wg]
      out_smem = q_smem2.at[wg] if out_smem2 is None else out_smem2.at[wg]
      if sums_on_tensor_cores:
        ones_smem2.at[wg][...] = plgpu.layout_cast(
            jnp.ones((bk, SUM_COLUMNS), dtype), plgpu.Layout.WGMMA)
        plgpu.commit_smem()  # before wgmma reads them

      def query_slot(position):
        """This warpgroup's query buffer for the item at `position`, and
        the barrier its load arrives on."""
        index = wg
        if config.query_slots > 1:
          index = lax.rem(position, config.query_slots) * wgs + wg
        return q_smem2.at[index], q_ready.at[index]

      def load_q(position):
        item = item_of(own_item(position))
        q_smem, q_arrived = query_slot(position)
        plgpu.copy_gmem_to_smem(q_gmem.at[item.batch, pl.ds(item.q0 + wg * bq, bq), item.head],
                                q_smem, q_arrived)

      load_q(jnp.int32(0))  # (a grid never has more blocks than items)
      over_items(functools.partial(compute_item, wg=wg, query_slot=query_slot,
                                   lse_smem=lse_smem, out_smem=out_smem, load_q=load_q))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == wgs)
    def _memory():
      plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

      def memory_item(position, item, base):
        del position
        @pl.loop(item.lo, item.hi)
        def _load(j):
          slot = item_slot(item, base, j)
          @pl.when(base + j - item.lo >= steps)
          def _wait_free():  # the tile `steps` before, in this slot
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
          tile = (item.batch, pl.ds(j * bk, bk), item.kv_head)
          plgpu.copy_gmem_to_smem(k_gmem.at[tile], k_smem.at[slot], k_ready.at[slot])
          plgpu.copy_gmem_to_smem(v_gmem.at[tile], v_smem.at[slot], v_ready.at[slot])
        return base + item.hi - item.lo

      total = over_items(memory_item)
      # Wait until the last tiles are released: every thread must see every
      # phase of a barrier it waits on (Mosaic GPU interpret mode checks).
      @pl.loop(jnp.maximum(total - steps, 0), total)
      def _drain(g):
        slot = lax.rem(g, steps)
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])

  transforms = swizzled(dtype, hp)
  pl.run_scoped(
      scoped,
      plgpu.SMEM((config.query_slots * wgs, bq, hp), dtype, transforms=transforms),
      # The output's (else q's).
      plgpu.SMEM((wgs, bq, hp), dtype, transforms=transforms) if config.persistent else None,
      plgpu.SMEM((steps, bk, hp), dtype, transforms=transforms),
      plgpu.SMEM((steps, bk, hp), dtype, transforms=transforms),
      plgpu.SMEM((wgs, bq), jnp.float32),
      # P's staging buffer, interpret mode only (see `_add_products`).
      (plgpu.SMEM((wgs, bq, bk), dtype, transforms=swizzled(dtype, bk))
       if interpret else None),
      (plgpu.SMEM((wgs, bk, SUM_COLUMNS), dtype, transforms=swizzled(dtype, SUM_COLUMNS))
       if sums_on_tensor_cores else None),
      plgpu.Barrier(num_barriers=steps),
      plgpu.Barrier(num_barriers=steps),
      plgpu.Barrier(num_barriers=config.query_slots * wgs),
      plgpu.Barrier(num_arrivals=wgs, num_barriers=steps),
      plgpu.Barrier(num_arrivals=wgs, num_barriers=steps),
      plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS),  # the ping-pong turn (two)
      collective_axes="wg",
  )


def _add_products(accs, lhs, rhs_smems, lhs_smem=None):
  """Each acc + lhs @ its rhs_smem with wgmma, lhs [M, K] from registers;
  the products issued together and waited for once.

  Compiled, the accumulators are the running values themselves (`ACC.init`).
  Interpret mode (jax 0.11.2) has no rule for `run_state` and its wgmma
  reads both operands from shared memory, so there (`lhs_smem` given) lhs
  goes through `lhs_smem` and each product into a fresh zero accumulator.
  """
  if lhs_smem is not None:
    lhs_smem[...] = lhs
    plgpu.commit_smem()
    def product(rhs_smem, acc_ref):
      plgpu.wgmma(acc_ref, lhs_smem, rhs_smem)
      return acc_ref[...]
    return tuple(
        acc + pl.run_scoped(functools.partial(product, rhs_smem),
                            plgpu.ACC(acc.shape, jnp.float32))
        for acc, rhs_smem in zip(accs, rhs_smems))

  def accumulate(acc_refs):
    for acc_ref, rhs_smem in zip(acc_refs, rhs_smems):
      plgpu.wgmma(acc_ref, lhs, rhs_smem)
  return pl.run_state(accumulate)(tuple(plgpu.ACC.init(acc) for acc in accs))


def _add_product(acc, lhs, rhs_smem, lhs_smem=None):
  """acc + lhs @ rhs_smem: `_add_products` of one."""
  (acc,) = _add_products((acc,), lhs, (rhs_smem,), lhs_smem)
  return acc


def forward(st, q, k, v, kv_len, *, config: MosaicConfig, key_tiles,
            is_open, interpret: bool = False):
  """q [B, Tp, N, Hp], k/v [B, Sp, K, Hp] 16-bit -> out [B, Tp, N, Hp], lse [B, N, Tp].

  Args:
    st: `static.Static` (scale, window, key-length mask, groups); no segments
      or mods.
    kv_len: [B] int32 key lengths (<= Sp), or None: every row has `st.key_length`.
    config: the tiles; Tp must be a multiple of 2 x block_q, Sp of block_k.
    key_tiles: `(q0, bq, bk, kv_len, seq_kv) -> (lo, full_lo, full_hi, hi)`,
      the key-tile ranges of a query tile (`masks.key_tiles` for `st`).
    is_open: `(q_idx, k_idx, kv_len) -> bool` on index tiles, the mask
      (`masks.is_open` for `st`).
    interpret: run in Mosaic GPU interpret mode (the CPU).
  """
  batch, seq_q, num_heads, hp = q.shape
  seq_kv = k.shape[1]
  check_config(config, hp)
  if seq_q % config.rows_per_block or seq_kv % config.block_k:
    raise ValueError(f"mosaic.forward: Tp = {seq_q} must be a multiple of "
                     f"{config.rows_per_block} and Sp = {seq_kv} of {config.block_k}")
  kernel = functools.partial(_kernel, st=st, config=config, key_tiles=key_tiles,
                             is_open=is_open,
                             interpret=interpret)
  lengths, kernel = masks.key_length_operand(kv_len, kernel)
  out_type = (jax.ShapeDtypeStruct(q.shape, q.dtype),
              jax.ShapeDtypeStruct((batch, num_heads, seq_q), jnp.float32))
  num_items = num_heads * (seq_q // config.rows_per_block) * batch
  if config.persistent:  # interpret mode: three blocks still walk several items each
    num_blocks = min(num_items, 3 if interpret else num_sms())
  else:
    num_blocks = num_items
  return _pallas.mosaic_kernel(
      kernel, out_type=out_type, grid=(num_blocks,), grid_names=("sm",),
      num_threads=NUM_COMPUTE_WGS + 1, thread_name="wg",
      kernel_name="flex_attention_mosaic_fwd",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(*lengths, q, k, v)
