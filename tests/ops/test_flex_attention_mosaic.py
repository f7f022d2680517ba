"""flex attention's Mosaic GPU forward (`ops/flex_attention/mosaic.py`) on the
CPU in Mosaic GPU interpret mode, against reference.py; when `prepare` gives
it a call; its lowering for a Hopper GPU.

Interpret mode simulates the three warpgroups, the TMA ring, the barriers and
wgmma, so these tests check the kernel's indexing and masks: each warpgroup's
key-tile ranges inside the block's (causal, windows on one or both sides, key
lengths, an empty row), padding of T and S, GQA, and that its log-sum-exp is
the one the Triton backward expects (the gradients run through it). (Under
vmap it runs with the Mosaic GPU backward:
test_flex_attention_mosaic_backward.py::test_vmap_of_gradients.)
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import tolerances
from ops import flex_attention_reference
from ops._mosaic_gpu import SMEM_BUDGET
from ops.flex_attention import configs
from ops.flex_attention import mosaic
from ops.flex_attention import mosaic_tiles
from ops.flex_attention import pallas
from tests.ops.test_flex_attention import _inputs as flex_inputs
from tests.ops.test_flex_attention import _vjp

# Relative L2 error bounds by input dtype, as in test_flex_attention.py.
_TOL = tolerances.FLEX_ATTENTION

# 64-row key tiles keep the interpreted loops short; the ring has 2 slots.
_TILES = configs.MosaicConfig(block_q=64, block_k=64, max_concurrent_steps=2)
_CONFIG = dataclasses.replace(configs.get_config(64, jnp.bfloat16, interpret=True),
                              mosaic_fwd=_TILES)


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(b, t, s, n, kh, h, dtype, seed=0):
  """q [B, T, N, H], k, v [B, S, K, H] in `dtype`, the output cotangent w
  [B, T, N, H] in f32 (`test_flex_attention._inputs`: NumPy's draws)."""
  return flex_inputs((b, t, n, h), (b, s, kh, h), dtype, seed)


def _prepared(shape_q, shape_kv, dtype, **call):
  """`pallas.prepare` on q [shape_q] and k = v [shape_kv] in `dtype`, traced
  only (run eagerly, each pad compiles a program): (its static description,
  the padded q's shape, the padded k's)."""
  static = []
  def prepare(q, k):
    st, args = pallas.prepare(q, k, k, **call)
    static.append(st)
    return args[:2]
  q, k = jax.eval_shape(prepare, *(jax.ShapeDtypeStruct(shape, dtype)
                                   for shape in (shape_q, shape_kv)))
  return static[0], q.shape, k.shape


def _reference(**options):
  """The f32 reference on upcast inputs, with flex's options."""
  return lambda q, k, v: flex_attention_reference(
      q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), **options)


def _kernel(config, *, is_causal=False, local_window_size=None, key_value_seq_lengths=None,
            scale=None, interpret=True):
  """flex's kernel path on `config` (Mosaic GPU interpret mode by default)."""
  def fn(q, k, v):
    return pallas.flex_attention_pallas(
        q, k, v, scale=q.shape[-1] ** -0.5 if scale is None else scale,
        is_causal=is_causal, window=local_window_size, q_segment_ids=None,
        kv_segment_ids=None, key_value_seq_lengths=key_value_seq_lengths, interpret=interpret,
        config=config)
  return fn


# b, t, s, n, kh, h, dtype, options: causal and not, windows (one and both
# sides), key lengths (one of them 0: a batch row of empty rows), GQA 4:2 and
# MQA 2:1, cross attention with T and S padded, H 32, 80 (padded to 128), 128.
# (H64, whose tiles take H128's swizzle: the lse's test below, the walks of
# test_flex_attention_first_tile_max.py and the vmap test of
# test_flex_attention_mosaic_backward.py.)
_CASES = {
    "cross_padded_lengths_h80_f16": (2, 200, 300, 2, 1, 80, jnp.float16,
                                     dict(key_value_seq_lengths=np.array([0, 250]))),
    "window_causal_gqa4to2_h128_bf16": (1, 256, 256, 4, 2, 128, jnp.bfloat16,
                                        dict(is_causal=True, local_window_size=(40, 0))),
    "window_both_sides_lengths_h32_bf16": (1, 128, 192, 2, 2, 32, jnp.bfloat16,
                                           dict(local_window_size=(30, 20),
                                                key_value_seq_lengths=np.array([150]))),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_forward_and_gradients_match_reference(name):
  b, t, s, n, kh, h, dtype, options = _CASES[name]
  options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
             for k, v in options.items()}
  q, k, v, w = _inputs(b, t, s, n, kh, h, dtype)
  st, _, _ = _prepared(q.shape, k.shape, dtype, scale=1.0,
                       is_causal=options.get("is_causal", False),
                       window=options.get("local_window_size"), q_segment_ids=None,
                       kv_segment_ids=None, key_value_seq_lengths=None, interpret=True,
                       config=_CONFIG)
  assert st.config.mosaic_fwd == _TILES  # this call runs the Mosaic forward
  out, grads = jax.jit(functools.partial(_vjp, _kernel(_CONFIG, **options)))(q, k, v, w)
  out_r, grads_r = jax.jit(functools.partial(_vjp, _reference(**options)))(q, k, v, w)
  assert out.dtype == dtype and out.shape == (b, t, n, h)
  tol = _TOL[dtype]
  for name_, x, x_r in [("out", out, out_r), *zip(("dq", "dk", "dv"), grads, grads_r)]:
    assert not np.isnan(np.asarray(x, np.float32)).any(), name_
    assert _rel(x, x_r) < tol, (name_, _rel(x, x_r))
  lengths = options.get("key_value_seq_lengths")
  if lengths is not None and int(lengths[0]) == 0:  # sees no key: zeros
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)


def test_128_row_tiles_match_reference():
  """The head-size-32 entry's tiles for causal calls: 128 rows per warpgroup
  (two wgmma row tiles each), 128-row key tiles, the warpgroups running
  freely; T padded to two blocks. (The turns, which do not depend on the
  rows: the other walks.)"""
  config = dataclasses.replace(_CONFIG, mosaic_fwd=configs.MosaicConfig(
      block_q=128, block_k=128, max_concurrent_steps=2, ping_pong=False))
  q, k, v, _ = _inputs(1, 300, 300, 2, 1, 32, jnp.bfloat16, seed=2)
  got = jax.jit(_kernel(config, is_causal=True))(q, k, v)
  want = jax.jit(_reference(is_causal=True))(q, k, v)
  assert _rel(got, want) < _TOL[jnp.bfloat16]


def _check_tiles_against_reference(tiles, options, *, seed, seq_q=200, seq_kv=230):
  """The Mosaic forward on `tiles` (the Triton backward after it) against the
  reference, B 2, T `seq_q`, S `seq_kv`, GQA 2:1, H 32, bf16: output and every
  gradient; a batch row whose key length is 0 gives zeros."""
  options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
             for k, v in options.items()}
  config = dataclasses.replace(_CONFIG, mosaic_fwd=tiles)
  q, k, v, w = _inputs(2, seq_q, seq_kv, 2, 1, 32, jnp.bfloat16, seed=seed)
  st, _, _ = _prepared(q.shape, k.shape, jnp.bfloat16, scale=1.0,
                       is_causal=options.get("is_causal", False),
                       window=options.get("local_window_size"), q_segment_ids=None,
                       kv_segment_ids=None, key_value_seq_lengths=None, interpret=True,
                       config=config)
  assert st.config.mosaic_fwd is not None  # the Mosaic forward takes the call
  out, grads = jax.jit(functools.partial(_vjp, _kernel(config, **options)))(q, k, v, w)
  out_r, grads_r = jax.jit(functools.partial(_vjp, _reference(**options)))(q, k, v, w)
  for name, x, x_r in [("out", out, out_r), *zip(("dq", "dk", "dv"), grads, grads_r)]:
    assert _rel(x, x_r) < _TOL[jnp.bfloat16], (name, _rel(x, x_r))
  if "key_value_seq_lengths" in options:  # batch row 0 sees no key: zeros
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)


def test_tensor_core_sums_match_reference():
  """`tensor_core_sums=True`: the row sums come from P @ ones beside P V (a
  [block_q, 16] accumulator rescaled with the output's on the online tiles),
  read back once at the end. The H32 table's full-attention walk (256-key
  tiles, free-running, persistent) on 128 rows per warpgroup, with key
  lengths: a batch row that sees no key (its sums stay 0: zeros, +inf lse)
  and one that ends inside the second tile. GQA 2:1, T and S padded, forward
  and gradients. (The sums with a window's masked tiles on both sides of the
  open ones, and with the turns: test_flex_attention_first_tile_max.py.)"""
  tiles = configs.MosaicConfig(block_q=128, block_k=256, max_concurrent_steps=2,
                               ping_pong=False, persistent=True, tensor_core_sums=True)
  _check_tiles_against_reference(tiles, dict(key_value_seq_lengths=np.array([0, 257])),
                                 seed=7, seq_q=300, seq_kv=300)


@pytest.mark.parametrize("options, extra", [
    (dict(local_window_size=(70, None), key_value_seq_lengths=np.array([0, 180])),
     dict(ping_pong=False, max_concurrent_steps=3, prefetch_query=True)),
    (dict(is_causal=True), dict(persistent_right_bounded=True)),
], ids=["left_window_lengths_empty_row_free_prefetch_query", "causal_heaviest_first"])
def test_persistent_blocks_match_reference(options, extra):
  """`persistent=True`: three blocks (interpret mode's grid) walk the 2 x 2 x 2
  items in rounds dealt back and forth, so the ring's slots and barrier phases
  run on across items, each warpgroup loads its next query tile under the
  last item's epilogue (with `prefetch_query`, into its other query buffer
  under the walk: a block's items alternate between the two), and the output
  goes through its own buffer. A left-only window with key lengths (batch
  row 0: no key) on the free-running walk with a ring of three slots and the
  query tiles prefetched; causal with the turns and the items heaviest first
  (`persistent_right_bounded`). (Full attention, persistent: the row sums'
  walk above.) GQA 2:1, T and S padded, forward and gradients."""
  tiles = dict(block_q=64, block_k=64, max_concurrent_steps=2, persistent=True)
  _check_tiles_against_reference(configs.MosaicConfig(**{**tiles, **extra}), options,
                                 seed=6)


@pytest.mark.parametrize("is_causal, window, right_bounded_too, persistent", [
    (False, None, False, True), (False, (70, None), False, True),
    (True, None, False, False), (False, (70, 10), False, False), (True, None, True, True)])
def test_persistent_only_without_a_right_bound(is_causal, window, right_bounded_too,
                                               persistent):
  """Right-bounded calls (causal, a window with a right side) give items of
  unequal work: `prepare` runs them with one block per item, unless the
  tiles say `persistent_right_bounded`."""
  tiles = configs.MosaicConfig(persistent=True,
                               persistent_right_bounded=right_bounded_too)
  config = dataclasses.replace(_CONFIG, mosaic_fwd=tiles)
  st, _, _ = _prepared((1, 256, 2, 64), (1, 256, 1, 64), jnp.bfloat16, scale=1.0,
                       is_causal=is_causal, window=window, q_segment_ids=None,
                       kv_segment_ids=None, key_value_seq_lengths=None, interpret=True,
                       config=config)
  assert st.config.mosaic_fwd == dataclasses.replace(tiles, persistent=persistent)


def test_register_split():
  """The memory warpgroup's 40 registers per thread and the two compute
  warpgroups' share fit the block's pool of three warpgroups (504)."""
  assert mosaic_tiles.COMPUTE_REGISTERS == 232
  pool = configs.register_pool(configs.NUM_COMPUTE_WGS + 1)
  assert pool == 504
  assert 2 * mosaic_tiles.COMPUTE_REGISTERS + mosaic_tiles.MEMORY_REGISTERS <= pool


def test_log_sum_exp_is_the_triton_forwards():
  """The backward reads the forward's base-2 lse; +inf where a row is empty."""
  q, k, v, _ = _inputs(2, 128, 128, 2, 1, 64, jnp.bfloat16, seed=3)
  lengths = jnp.array([0, 77])
  def forwards(q, k, v):  # the Mosaic forward's (out, lse) and the Triton one's
    st, args = pallas.prepare(q, k, v, scale=0.125, is_causal=True, window=None,
                              q_segment_ids=None, kv_segment_ids=None,
                              key_value_seq_lengths=lengths, interpret=True, config=_CONFIG)
    triton = dataclasses.replace(st, config=dataclasses.replace(st.config, mosaic_fwd=None))
    return pallas._forward(st, *args[:6]), pallas._forward(triton, *args[:6])
  (out, lse), (out_t, lse_t) = jax.jit(forwards)(q, k, v)
  assert lse.shape == lse_t.shape == (2, 2, 128)
  assert np.all(np.isinf(np.asarray(lse[0])))
  np.testing.assert_allclose(np.asarray(lse[1]), np.asarray(lse_t[1]), rtol=1e-5, atol=1e-5)
  assert _rel(out, out_t) < 1e-2


def test_prepare_gives_it_only_the_calls_it_takes():
  def chosen(shape_q, shape_kv, dtype=jnp.bfloat16, **kw):
    options = dict(scale=1.0, is_causal=False, window=None, q_segment_ids=None,
                   kv_segment_ids=None, key_value_seq_lengths=None, interpret=True,
                   config=_CONFIG)
    options.update(kw)
    st, q_shape, k_shape = _prepared(shape_q, shape_kv, dtype, **options)
    return st.config.mosaic_fwd, q_shape, k_shape

  tiles, q_shape, k_shape = chosen((1, 200, 2, 80), (1, 300, 2, 80))
  assert tiles == _TILES
  # T padded to the block's 128 rows, S to the key tile, H to 128.
  assert q_shape == (1, 256, 2, 128) and k_shape == (1, 320, 2, 128)
  assert chosen((1, 256, 2, 64), (1, 256, 2, 64), jnp.float16)[0] == _TILES
  segments = jnp.zeros((1, 256), jnp.int32)
  for shapes, kw in [
      (((1, 256, 2, 64), (1, 256, 2, 64), jnp.float32), {}),      # not 16-bit
      (((1, 256, 2, 16), (1, 256, 2, 16)), {}),                    # head size 16
      (((1, 100, 2, 64), (1, 256, 2, 64)), {}),                    # T < 128 rows
      (((1, 256, 2, 64), (1, 40, 2, 64)), {}),                     # S < one key tile
      (((1, 256, 2, 64), (1, 256, 2, 64)),
       dict(q_segment_ids=segments, kv_segment_ids=segments)),     # segments
      (((1, 256, 2, 64), (1, 256, 2, 64)), dict(mask_mod=lambda b, n, t, s: t >= s)),
      (((1, 256, 2, 64), (1, 256, 2, 64)), dict(score_mod=lambda x, b, n, t, s: x)),
  ]:
    assert chosen(*shapes, **kw)[0] is None, (shapes, kw)
  shapes = ((1, 256, 2, 32), (1, 256, 2, 32))
  # Other tiles for right-bounded calls (`mosaic_fwd_bounded`, the H32
  # entry's): causal or a window with a right side take them, full attention
  # and left-only windows take `mosaic_fwd`'s; `forward_on` puts every call
  # on one set.
  bounded_tiles = configs.MosaicConfig(block_q=128, block_k=64, ping_pong=False)
  bounded = dataclasses.replace(_CONFIG, mosaic_fwd_bounded=bounded_tiles)
  for kw, want in ((dict(is_causal=True), bounded_tiles), (dict(window=(8, 4)), bounded_tiles),
                   ({}, _TILES), (dict(window=(8, None)), _TILES)):
    assert chosen(*shapes, config=bounded, **kw)[0] == want, kw
    assert chosen(*shapes, config=bounded.forward_on(_TILES), **kw)[0] == _TILES, kw
    assert chosen(*shapes, config=bounded.forward_on(None), **kw)[0] is None, kw
  # Score limits (B x N x T x S; 2 x 256 x 256 = 131072 here): shorter calls
  # take the Triton forward, or the Mosaic one without its tensor-core sums;
  # `forward_on` lifts both.
  sums_tiles = dataclasses.replace(_TILES, tensor_core_sums=True)
  scores = 2 * 256 * 256
  for limits, want in (
      (dict(mosaic_fwd_min_scores=scores), sums_tiles),
      (dict(mosaic_fwd_min_scores=scores + 1), None),
      (dict(tensor_core_sums_min_scores=scores), sums_tiles),
      (dict(tensor_core_sums_min_scores=scores + 1), _TILES)):
    limited = dataclasses.replace(_CONFIG, mosaic_fwd=sums_tiles, **limits)
    assert chosen(*shapes, config=limited)[0] == want, limits
    assert chosen(*shapes, config=limited.forward_on(sums_tiles))[0] == sums_tiles, limits
  # Right-bounded calls keep the Mosaic forward under the score limit.
  limited = dataclasses.replace(_CONFIG, mosaic_fwd=_TILES, mosaic_fwd_min_scores=scores + 1)
  assert chosen(*shapes, config=limited, is_causal=True)[0] == _TILES
  # Short right-bounded calls on their own tiles (the H64 entry's): below
  # `mosaic_fwd_bounded_min_scores`, causal calls and windows with a right
  # side take `mosaic_fwd_short_bounded`, full attention keeps `mosaic_fwd`;
  # `forward_on` lifts that too.
  short_tiles = dataclasses.replace(_TILES, frozen_masked_tiles=True)
  for limit, want in ((scores, bounded_tiles), (scores + 1, short_tiles)):
    limited = dataclasses.replace(_CONFIG, mosaic_fwd_bounded=bounded_tiles,
                                  mosaic_fwd_short_bounded=short_tiles,
                                  mosaic_fwd_bounded_min_scores=limit)
    for kw in (dict(is_causal=True), dict(window=(8, 4))):
      assert chosen(*shapes, config=limited, **kw)[0] == want, (limit, kw)
      assert chosen(*shapes, config=limited.forward_on(_TILES), **kw)[0] == _TILES, limit
    assert chosen(*shapes, config=limited)[0] == _TILES, limit
  for name in ("mosaic_fwd_min_scores", "mosaic_fwd_bounded_min_scores"):
    with pytest.raises(ValueError, match=name):
      dataclasses.replace(_CONFIG, **{name: -1})
  # Tiles over the shared-memory budget at this head size (256-row key tiles
  # at H128): the Triton forward, not a compile error.
  too_big = dataclasses.replace(_CONFIG, mosaic_fwd=configs.MosaicConfig(block_k=256))
  assert chosen((1, 512, 2, 128), (1, 512, 2, 128), config=too_big)[0] is None
  assert chosen((1, 512, 2, 64), (1, 512, 2, 64), config=too_big)[0] == too_big.mosaic_fwd


def test_table_and_config_checks():
  for h in (32, 64, 128, 256):  # measured faster than the Triton forward on an H200
    config = configs.get_config(h, jnp.bfloat16, interpret=False, generation="sm90")
    for tiles in (config.mosaic_fwd, config.mosaic_fwd_bounded or config.mosaic_fwd,
                  config.mosaic_fwd_short_bounded or config.mosaic_fwd):
      assert tiles is not None and tiles.smem_bytes(h) <= SMEM_BUDGET
  # float32 at H256 has its own, smaller tiles: halving the 16-bit entry's key
  # tiles overflowed the dQ kernel's shared memory on an H200.
  f32, bf16 = (configs.get_config(256, d, interpret=False, generation="sm90")
               for d in (jnp.float32, jnp.bfloat16))
  assert f32.dq.block_q * f32.dq.block_k < bf16.dq.block_q * bf16.dq.block_k // 2
  assert configs.get_config(128, jnp.float32, interpret=False,
                            generation="sm90").mosaic_fwd is None
  assert configs.get_config(128, jnp.bfloat16, interpret=False,
                            generation="sm80").mosaic_fwd is None
  assert configs.get_config(128, jnp.bfloat16, interpret=True).mosaic_fwd is None
  with pytest.raises(ValueError, match="block_q"):
    configs.MosaicConfig(block_q=32)
  with pytest.raises(ValueError, match="max_concurrent_steps"):
    configs.MosaicConfig(max_concurrent_steps=1)
  with pytest.raises(ValueError, match="head sizes"):
    mosaic.check_config(_TILES, 16)
  with pytest.raises(ValueError, match="shared memory"):
    mosaic.check_config(configs.MosaicConfig(block_k=256, max_concurrent_steps=4), 256)
  # The row sums on the tensor cores: each compute warpgroup's [block_k, 16]
  # ones in shared memory.
  sums = configs.MosaicConfig(block_k=128, tensor_core_sums=True)
  assert sums.smem_bytes(32) - configs.MosaicConfig(block_k=128).smem_bytes(32) == (
      2 * 128 * 16 * 2)


def test_prefetch_query_buffers():
  """`prefetch_query` doubles the query buffers of a persistent walk only
  (one block per item has no next query tile), and counts them in the
  shared memory that `config_limit` checks."""
  walk = configs.MosaicConfig(block_q=64, block_k=128, persistent=True)
  prefetch = dataclasses.replace(walk, prefetch_query=True)
  assert (walk.query_slots, prefetch.query_slots) == (1, 2)
  assert prefetch.smem_bytes(128) - walk.smem_bytes(128) == 2 * 64 * 128 * 2
  one_per_item = dataclasses.replace(prefetch, persistent=False)
  assert one_per_item.query_slots == 1
  assert (one_per_item.smem_bytes(128)
          == dataclasses.replace(walk, persistent=False).smem_bytes(128))


# The table's H32 entry: causal on its right-bounded tiles (128 rows per
# warpgroup, no ping-pong turns), full attention on its other walk (256-key
# tiles, persistent, the row sums on the tensor cores).
@pytest.mark.parametrize("head_dim, is_causal",
                         [(32, True), (32, False), (64, True), (128, False)])
def test_lowers_to_mosaic_gpu_for_hopper(head_dim, is_causal, hopper_lowering):
  """Interpret mode does not run the Mosaic GPU compiler; lowering for CUDA
  does (registers as the P operand, layouts, TMA shapes), without a GPU. The
  backward lowers in the same program: the table's Mosaic GPU backward at
  each of these head sizes (its other tiles:
  test_flex_attention_mosaic_backward.py)."""
  del hopper_lowering
  config = configs.get_config(head_dim, jnp.bfloat16, interpret=False, generation="sm90")
  attention = _kernel(config, is_causal=is_causal, scale=0.1, interpret=False)
  def loss(q, k, v):
    return jnp.sum(attention(q, k, v).astype(jnp.float32))
  # 2 x 4 x 4096^2 scores: long enough for the H32 entry's Mosaic forward
  # (`FlexConfig.mosaic_fwd_min_scores`); shorter calls take the Triton one.
  spec_q = jax.ShapeDtypeStruct((2, 4096, 4, head_dim), jnp.bfloat16)
  spec_kv = jax.ShapeDtypeStruct((2, 4096, 2, head_dim), jnp.bfloat16)
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
      spec_q, spec_kv, spec_kv).lower(lowering_platforms=("cuda",)).as_text()
  assert "flex_attention_mosaic_fwd" in text
  # The backward: the table's Mosaic one (it has one at each head size here).
  assert config.mosaic_bwd is not None
  assert "flex_attention_mosaic_bwd" in text and "flex_attention_dkdv" not in text


def test_frozen_masked_tiles_lower_for_hopper(hopper_lowering):
  """Causal calls with the diagonal tiles on the kept maxima
  (`frozen_masked_tiles`), on the H32 entry's bounded walk: Mosaic GPU's
  checks."""
  del hopper_lowering
  base = configs.get_config(32, jnp.bfloat16, interpret=False, generation="sm90")
  tiles = configs.MosaicConfig(block_q=128, block_k=128, ping_pong=False,
                               frozen_masked_tiles=True)
  spec = jax.ShapeDtypeStruct((2, 512, 4, 32), jnp.bfloat16)
  fn = _kernel(base.forward_on(tiles), is_causal=True, scale=0.1, interpret=False)
  text = jax.jit(fn).trace(spec, spec, spec).lower(lowering_platforms=("cuda",)).as_text()
  assert "flex_attention_mosaic_fwd" in text


@pytest.mark.parametrize("seq_len", [1024, 4096])
def test_h64_causal_table_walks_lower_for_hopper(seq_len, hopper_lowering):
  """The H64 entry's causal calls: from 2^30 scores on 256-key tiles with the
  turns, shorter ones walked persistently on 128-key tiles with the next
  query tile prefetched; both with the partly masked tiles on the kept
  maxima."""
  del hopper_lowering
  config = configs.get_config(64, jnp.bfloat16, interpret=False, generation="sm90")
  long_call = 4 * 16 * seq_len**2 >= config.mosaic_fwd_bounded_min_scores
  assert long_call is (seq_len == 4096)
  tiles = config.mosaic_fwd_bounded if long_call else config.mosaic_fwd_short_bounded
  assert tiles.frozen_masked_tiles
  assert long_call or (tiles.persistent_right_bounded and tiles.query_slots == 2)
  spec = jax.ShapeDtypeStruct((4, seq_len, 16, 64), jnp.bfloat16)
  fn = _kernel(config, is_causal=True, scale=0.1, interpret=False)
  text = jax.jit(fn).trace(spec, spec, spec).lower(lowering_platforms=("cuda",)).as_text()
  assert "flex_attention_mosaic_fwd" in text


@pytest.mark.parametrize(
    "block_q, persistent, ping_pong, tensor_core_sums, prefetch_query",
    [(128, False, False, False, False), (64, True, True, False, False),
     (128, True, False, True, False), (64, True, False, True, True)])
def test_walk_variants_lower_for_hopper(block_q, persistent, ping_pong, tensor_core_sums,
                                        prefetch_query, hopper_lowering):
  """Walks the table runs at other head sizes or tiles, at head size 32 on
  full attention (free-running with 128 rows per warpgroup, persistent with
  the turns, the row sums on the tensor cores: a 16-column wgmma from a
  32-byte swizzle, persistent with the query tiles prefetched): Mosaic GPU's
  checks."""
  del hopper_lowering
  base = configs.get_config(32, jnp.bfloat16, interpret=False, generation="sm90")
  config = base.forward_on(configs.MosaicConfig(
      block_q=block_q, block_k=128, max_concurrent_steps=2, ping_pong=ping_pong,
      persistent=persistent, prefetch_query=prefetch_query,
      tensor_core_sums=tensor_core_sums))
  spec = jax.ShapeDtypeStruct((2, 512, 4, 32), jnp.bfloat16)
  fn = _kernel(config, scale=0.1, interpret=False)
  text = jax.jit(fn).trace(spec, spec, spec).lower(lowering_platforms=("cuda",)).as_text()
  assert "flex_attention_mosaic_fwd" in text
