"""What the Triton forward (`triton.py`) and backward (`triton_backward.py`) share.

`exp2` is the kernels' exponential; the rest build the block specs and
compiler parameters of their launches. Shapes as in `triton.py`'s glossary.
"""

import dataclasses
import math

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from ops.flex_attention import configs
from ops.flex_attention.static import Static

LOG2E = math.log2(math.e)


def exp2(st: Static, x):
  """2 ** x in f32: one MUFU.EX2 when compiled (flushing denormals to zero).

  `jnp.exp2` lowers to libdevice's `__nv_exp2f`, which adds denormal handling
  around the same instruction; at small head sizes the kernels are bound by
  this per-logit work, so the bare PTX instruction is worth having.
  """
  if st.interpret:
    return jnp.exp2(x)
  [y] = plgpu.elementwise_inline_asm(
      "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return y


def key_length_spec(kv_len, index_map):
  """The [B, 1] key lengths' block spec (None when the call has none)."""
  return None if kv_len is None else pl.BlockSpec((None, 1), index_map)


def whole_kv_spec(st: Static, seq_kv: int, hp: int):
  """K or V [B, Sp, K, Hp]: all keys of the head's group, for a (., b, n) grid."""
  return pl.BlockSpec((None, seq_kv, None, hp), lambda _, b, n: (b, 0, n // st.groups, 0))


def seg_specs(st, q_block, k_block, q_index, k_index):
  """The query and key segment ids' block specs ([None, None] without them)."""
  if not st.segments:
    return [None, None]
  return [pl.BlockSpec(q_block, q_index), pl.BlockSpec(k_block, k_index)]


def row_list_specs(lists, num_q_tiles: int):
  """Specs of the fwd/dQ tile lists ([B, N, nq, 1] counts, [B, N, nq, nk])."""
  if lists is None:
    return None
  rev = lambda i: num_q_tiles - 1 - i
  count = pl.BlockSpec((None, None, None, 1), lambda i, b, n: (b, n, rev(i), 0))
  index = pl.BlockSpec((None, None, None, lists[1].shape[-1]),
                       lambda i, b, n: (b, n, rev(i), 0))
  return (count, index, count, index)


@dataclasses.dataclass(frozen=True)
class QueryTileSpecs:
  """The block specs of a launch over query tiles, grid (i, b, n), the tiles
  in reverse order (under a causal mask the longest programs start first):
  the Triton forward's and dQ's."""
  num_q_tiles: int
  q: pl.BlockSpec  # a [bq, Hp] tile of q, out, dout
  rows: pl.BlockSpec  # its [bq] rows of lse, delta
  masks: tuple  # key lengths, query and key segment ids, the tile lists


def query_tile_specs(st: Static, kv_len, lists, *, seq_q: int, seq_kv: int,
                     block_q: int, hp: int) -> QueryTileSpecs:
  nq = seq_q // block_q
  rev = lambda i: nq - 1 - i
  return QueryTileSpecs(
      num_q_tiles=nq,
      q=pl.BlockSpec((None, block_q, None, hp), lambda i, b, n: (b, rev(i), n, 0)),
      rows=pl.BlockSpec((None, None, block_q), lambda i, b, n: (b, n, rev(i))),
      masks=(key_length_spec(kv_len, lambda i, b, n: (b, 0)),
             *seg_specs(st, (None, block_q), (None, seq_kv),
                        lambda i, b, n: (b, rev(i)), lambda i, b, n: (b, 0)),
             row_list_specs(lists, nq)))


def compiler_params(cfg: configs.TritonConfig):
  """A Triton launch's warps and pipeline stages."""
  return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
