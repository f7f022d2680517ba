"""The forwards' first-tile maxima (`FlexConfig.fwd_softmax='first_tile_max'`).

Interpret mode on CPU, against reference.py: forward and gradients with the
row maxima of each program's first open key tile kept for its other open
tiles, in the Triton forward (masks, segments, mask_mod) and the Mosaic GPU one
(the table's walks); the second pass that recomputes rows whose logits pass
their frozen maxima by far; and the calls that keep the online softmax.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.flex_attention import configs
from ops.flex_attention import pallas
from ops.flex_attention import triton as flex_triton
from tests.ops import test_flex_attention as flex_tests
from tests.ops import test_flex_attention_mosaic as mosaic_tests

_INTERPRET = configs.get_config(32, jnp.float32, interpret=True)
_FROZEN = dataclasses.replace(_INTERPRET, fwd_softmax="first_tile_max")
_IN_KERNEL = dataclasses.replace(_FROZEN, refresh="in_kernel")


@pytest.fixture
def frozen(monkeypatch):
  """Every call in the test takes the interpret-mode tiles (32 x 32: two or
  more key tiles, so frozen ones) with the first tile's maxima."""
  monkeypatch.setattr(configs, "get_config", lambda *a, **kw: _FROZEN)


# b, t, s, n, kh, h, dtype, options; all but the segments case (whose tiles
# are all partly masked) have programs with two or more fully open tiles.
_CASES = {
    # An empty batch row (key length 0), a window on both sides, GQA 4:2.
    "window_lengths_gqa_bf16": (2, 128, 128, 4, 2, 32, jnp.bfloat16,
                                dict(local_window_size=(80, 40),
                                     key_value_seq_lengths=np.array([128, 0]))),
    "causal_cross_f32": (1, 100, 120, 2, 1, 64, jnp.float32, dict(is_causal=True)),
    "segments_bf16": (1, 100, 100, 2, 2, 32, jnp.bfloat16, dict(segment_ids=np.repeat(
        np.arange(2), [30, 70])[None])),
    "documents_f32": (1, 128, 128, 2, 1, 16, jnp.float32,
                      dict(mask_mod=lambda b, n, t, s: (t // 64) == (s // 64))),
    "prefix_lm_bf16": (1, 128, 128, 4, 2, 32, jnp.bfloat16,
                       dict(mask_mod=lambda b, n, t, s: (s < 48) | (s <= t))),
}


@pytest.fixture
def in_kernel(monkeypatch):
  """As `frozen`, with rows past the limit recomputed inside the forward
  kernel: the second launch must not run."""
  monkeypatch.setattr(configs, "get_config", lambda *a, **kw: _IN_KERNEL)
  def no_launch(*args):
    raise AssertionError("refresh='in_kernel' launched `refresh_frozen`")
  monkeypatch.setattr(flex_triton, "refresh_frozen", no_launch)


@pytest.mark.parametrize("name", list(_CASES))
def test_triton_forward_matches_reference(name, frozen):
  b, t, s, n, kh, h, dtype, options = _CASES[name]
  options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
             for k, v in options.items()}
  flex_tests._check(b, t, s, n, kh, h, dtype, **options)


@pytest.mark.parametrize("tiles, options", [
    # The H64 entry's walk: one block per SM, full attention, GQA.
    (configs.MosaicConfig(block_q=64, block_k=64, persistent=True), {}),
    # The H32 entry's: 128 rows per warpgroup, free-running, causal.
    (configs.MosaicConfig(block_q=128, block_k=64, ping_pong=False),
     dict(is_causal=True)),
    # Ping-pong turns, a window on both sides and key lengths.
    (configs.MosaicConfig(block_q=64, block_k=64),
     dict(local_window_size=(150, 100), key_value_seq_lengths=np.array([256, 200]))),
    # The row sums on the tensor cores: the window's masked tiles after the
    # kept-maxima ones run online and must rescale the sums' accumulator.
    (configs.MosaicConfig(block_q=64, block_k=64, tensor_core_sums=True),
     dict(local_window_size=(150, 100), key_value_seq_lengths=np.array([256, 200]))),
    # `frozen_masked_tiles`: the causal diagonal tiles, a window's right edge
    # and the key lengths' last tile on the kept maxima, their closed keys
    # at p = 0; the window's left-edge tiles come first and stay online.
    (configs.MosaicConfig(block_q=128, block_k=64, ping_pong=False,
                          frozen_masked_tiles=True), dict(is_causal=True)),
    (configs.MosaicConfig(block_q=64, block_k=64, tensor_core_sums=True,
                          frozen_masked_tiles=True),
     dict(local_window_size=(150, 100), key_value_seq_lengths=np.array([256, 200]))),
    # A masked tile first, where rows 255 and up see no key (their window
    # starts at key 64), and an open one next: that one must run online.
    (configs.MosaicConfig(block_q=64, block_k=64, frozen_masked_tiles=True),
     dict(local_window_size=(191, 100), key_value_seq_lengths=np.array([256, 200]))),
    # The H64 entry's short causal walk: persistent, heaviest items first,
    # the next query tile prefetched, with the turns.
    (configs.MosaicConfig(block_q=64, block_k=64, persistent=True,
                          persistent_right_bounded=True, frozen_masked_tiles=True,
                          prefetch_query=True), dict(is_causal=True)),
], ids=["persistent", "free_128_rows_causal", "turns_window_lengths",
        "tensor_core_sums_window_lengths", "frozen_masked_causal",
        "frozen_masked_sums_window_lengths", "frozen_masked_masked_tile_first",
        "frozen_masked_persistent_causal_prefetch"])
def test_mosaic_forward_matches_reference(tiles, options, monkeypatch):
  # Without the second pass: no row here passes the sum limit, so the walk's
  # own tiles must be exact (a row whose first tile kept an -inf maximum would
  # otherwise be hidden by the refresh).
  monkeypatch.setattr(flex_triton, "refresh_frozen", lambda *args: args[-2:])
  options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
             for k, v in options.items()}
  config = dataclasses.replace(mosaic_tests._CONFIG, mosaic_fwd=tiles,
                               fwd_softmax="first_tile_max")
  q, k, v, w = mosaic_tests._inputs(2, 256, 256, 4, 2, 64, jnp.bfloat16)
  st, _ = pallas.prepare(q, k, v, scale=1.0, is_causal=options.get("is_causal", False),
                         window=options.get("local_window_size"), q_segment_ids=None,
                         kv_segment_ids=None, key_value_seq_lengths=None, interpret=True,
                         config=config)
  assert st.config.mosaic_fwd is not None and st.config.fwd_softmax == "first_tile_max"
  out, grads = jax.jit(functools.partial(
      flex_tests._vjp, mosaic_tests._kernel(config, **options)))(q, k, v, w)
  out_r, grads_r = jax.jit(functools.partial(
      flex_tests._vjp, mosaic_tests._reference(**options)))(q, k, v, w)
  for name, x, x_r in [("out", out, out_r), *zip(("dq", "dk", "dv"), grads, grads_r)]:
    assert mosaic_tests._rel(x, x_r) < mosaic_tests._TOL[jnp.bfloat16], name


def _far_above_the_first_tile():
  """Keys small but key 40 (an open tile after the first) along q, with a logit ~500 base-2 units above
  the first tile's maxima: its p overflows, and the rows need the second pass."""
  keys = jax.random.split(jax.random.PRNGKey(7), 3)
  q = jax.random.normal(keys[0], (1, 40, 1, 64)).at[..., 0].set(30.0)
  k = 0.1 * jax.random.normal(keys[1], (1, 80, 1, 64))
  k = k.at[0, 40, 0, 0].set(100.0)
  v = jax.random.normal(keys[2], (1, 80, 1, 64))
  return q, k, v


def _forward(q, k, v):
  st, args = pallas.prepare(q, k, v, scale=q.shape[-1] ** -0.5, is_causal=False,
                            window=None, q_segment_ids=None, kv_segment_ids=None,
                            key_value_seq_lengths=None, interpret=True)
  return pallas._forward(st, *args)[0][:, :q.shape[1]]


def test_rows_past_their_frozen_maxima_are_recomputed(frozen, monkeypatch):
  q, k, v = _far_above_the_first_tile()
  expected = flex_tests.flex_attention_reference(q, k, v)
  assert flex_tests._rel(_forward(q, k, v), expected) < flex_tests._TOL[jnp.float32]
  # Without the second pass these rows are lost (NaN or inf).
  monkeypatch.setattr(flex_triton, "refresh_frozen", lambda *args: args[-2:])
  assert not np.isfinite(np.asarray(_forward(q, k, v))).all()


@pytest.mark.parametrize("frozen_masked_tiles", [False, True])
def test_far_key_on_the_diagonal_is_recomputed(frozen_masked_tiles, monkeypatch):
  """A causal Mosaic call whose key 200 (on a diagonal tile) is ~400 base-2
  units above every other logit of the rows that see it: online there (the
  default), the walk absorbs it; on the kept maxima (`frozen_masked_tiles`)
  those rows overflow and the second pass recomputes them."""
  tiles = configs.MosaicConfig(block_q=64, block_k=64, ping_pong=False,
                               frozen_masked_tiles=frozen_masked_tiles)
  config = dataclasses.replace(mosaic_tests._CONFIG, mosaic_fwd=tiles,
                               fwd_softmax="first_tile_max")
  keys = jax.random.split(jax.random.PRNGKey(5), 3)
  q = jax.random.normal(keys[0], (1, 256, 1, 32), jnp.bfloat16).at[..., 0].set(24.0)
  k = (0.1 * jax.random.normal(keys[1], (1, 256, 1, 32))).at[0, 200, 0, 0].set(100.0)
  k = k.astype(jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, 256, 1, 32), jnp.bfloat16)
  def forward():  # the forward alone, not cached: the second call runs without the pass
    st, args = pallas.prepare(q, k, v, scale=32 ** -0.5, is_causal=True, window=None,
                              q_segment_ids=None, kv_segment_ids=None,
                              key_value_seq_lengths=None, interpret=True, config=config)
    assert st.config.mosaic_fwd == tiles
    return pallas._forward(st, *args)[0]
  expected = flex_tests.flex_attention_reference(q, k, v, is_causal=True)
  assert mosaic_tests._rel(forward(), expected) < mosaic_tests._TOL[jnp.bfloat16]
  monkeypatch.setattr(flex_triton, "refresh_frozen", lambda *args: args[-2:])
  out = np.asarray(forward(), np.float32)
  # Rows 200-255 see the far key; only with it on the kept maxima are they lost.
  assert np.isfinite(out[:, :200]).all()
  assert np.isfinite(out[:, 200:]).all() != frozen_masked_tiles


@pytest.mark.parametrize("options", [
    {},
    dict(mask_mod=lambda b, n, t, s: s != 64 + t // 32),  # a key closed per query tile
    dict(key_value_seq_lengths=np.array([57, 80])),
])
def test_second_pass_recomputes_only_flagged_tiles_in_groups(options, frozen, monkeypatch):
  """Twelve query tiles in groups of four per program of the second pass, two
  batch rows, GQA 2:1; query tiles 0 and 6 of batch row 1 pass their frozen
  maxima (their p overflow), and only they are recomputed."""
  grouped = dataclasses.replace(_FROZEN, refresh_tiles_per_program=4)
  monkeypatch.setattr(configs, "get_config", lambda *a, **kw: grouped)
  keys = jax.random.split(jax.random.PRNGKey(3), 3)
  q = jax.random.normal(keys[0], (2, 384, 2, 32))
  far = jnp.zeros(384, bool).at[0:32].set(True).at[192:224].set(True)
  q = q.at[:, :, :, 0].set(0.0).at[1, :, :, 0].set(jnp.where(far[:, None], 6.0, 0.0))
  # Keys 40-47 and 64-79 share one far logit: the far rows' outputs average
  # them, so a key the mask closes there still counts.
  k = (0.1 * jax.random.normal(keys[1], (2, 80, 1, 32))).at[:, 40:48, 0, 0].set(100.0)
  k = k.at[:, 64:, 0, 0].set(100.0)
  v = jax.random.normal(keys[2], (2, 80, 1, 32))
  options = {key: jnp.asarray(x) if isinstance(x, np.ndarray) else x
             for key, x in options.items()}
  def fn():  # the forward alone, not cached: the second call runs without the pass
    st, args = pallas.prepare(q, k, v, scale=32 ** -0.5, is_causal=False, window=None,
                              q_segment_ids=None, kv_segment_ids=None, interpret=True,
                              key_value_seq_lengths=options.get("key_value_seq_lengths"),
                              mask_mod=options.get("mask_mod"))
    *args, lists = args
    return pallas._forward(st, *args, None if lists is None else lists["fwd"])
  expected = flex_tests.flex_attention_reference(q, k, v, **options)
  assert flex_tests._rel(fn()[0], expected) < flex_tests._TOL[jnp.float32]
  monkeypatch.setattr(flex_triton, "refresh_frozen", lambda *args: args[-2:])
  flagged = np.isnan(np.asarray(fn()[1])).all(axis=1)  # [B, T]: NaN lse in both heads
  np.testing.assert_array_equal(flagged, np.stack([np.zeros(384, bool), np.asarray(far)]))


def test_rows_past_their_frozen_maxima_are_recomputed_in_the_kernel(in_kernel):
  """The same rows, rerun online at the end of the forward kernel (the
  fixture fails the test if the second launch runs)."""
  q, k, v = _far_above_the_first_tile()
  expected = flex_tests.flex_attention_reference(q, k, v)
  assert flex_tests._rel(_forward(q, k, v), expected) < flex_tests._TOL[jnp.float32]


@pytest.mark.parametrize("name", ["window_lengths_gqa_bf16", "documents_f32"])
def test_in_kernel_refresh_leaves_other_calls_alone(name, in_kernel):
  """Masks, key lengths, an empty row and a mask_mod, where no row passes the limit."""
  test_triton_forward_matches_reference(name, None)


@pytest.mark.parametrize("dtype, mosaic_fwd, mods, expected", [
    (jnp.bfloat16, None, {}, "first_tile_max"),
    (jnp.float32, None, {}, "first_tile_max"),
    (jnp.float16, None, {}, "online"),  # P in float16 overflows at 2^16
    (jnp.bfloat16, configs.MosaicConfig(block_q=64, block_k=64, ping_pong=False,
                                        max_concurrent_steps=3),
     {}, "first_tile_max"),  # the Mosaic forward too
    # A score_mod may lift later keys far above the first tile (ALiBi).
    (jnp.bfloat16, None, dict(score_mod=flex_tests._alibi), "online"),
    (jnp.bfloat16, None, dict(mask_mod=lambda b, n, t, s: s <= t), "first_tile_max"),
])
def test_which_calls_take_the_first_tile_max(dtype, mosaic_fwd, mods, expected):
  config = dataclasses.replace(_FROZEN, mosaic_fwd=mosaic_fwd)
  q = jnp.zeros((1, 256, 2, 64), dtype)
  st, _ = pallas.prepare(q, q, q, scale=0.2, is_causal=False, window=None,
                         q_segment_ids=None, kv_segment_ids=None, key_value_seq_lengths=None,
                         interpret=True, config=config, **mods)
  assert st.config.fwd_softmax == expected


def test_prepare_keeps_every_config_field():
  """`prepare` fits the tiles and decides the softmax and the refresh; the
  config's other fields pass through."""
  config = dataclasses.replace(_FROZEN, refresh="in_kernel")
  q = jnp.zeros((1, 64, 2, 32), jnp.bfloat16)
  st, _ = pallas.prepare(q, q, q, scale=0.2, is_causal=False, window=None,
                         q_segment_ids=None, kv_segment_ids=None, key_value_seq_lengths=None,
                         interpret=True, config=config)
  assert st.config == config


@pytest.mark.parametrize("batch, seq_kv, expected", [
    (2, 128, "in_kernel"),
    (1, _FROZEN.in_kernel_refresh_max_scores // (2 * 64), "in_kernel"),  # at the limit
    (1, _FROZEN.in_kernel_refresh_max_scores // (2 * 64) + 1, "launch"),  # one key more
    (2, _FROZEN.in_kernel_refresh_max_scores // (2 * 64), "launch"),
])
def test_auto_refresh_follows_the_number_of_scores(batch, seq_kv, expected):
  config = dataclasses.replace(_FROZEN, refresh="auto")
  q = jnp.zeros((batch, 64, 2, 32), jnp.bfloat16)
  kv = jnp.zeros((batch, seq_kv, 2, 32), jnp.bfloat16)
  st, _ = pallas.prepare(q, kv, kv, scale=0.2, is_causal=False, window=None,
                         q_segment_ids=None, kv_segment_ids=None, key_value_seq_lengths=None,
                         interpret=True, config=config)
  assert st.config.refresh == expected


def test_vmap(frozen):
  """vmap batches the forward and its second pass (out, lse aliased)."""
  q, k, v, _ = flex_tests._inputs((3, 1, 96, 2, 32), (3, 1, 96, 2, 32), jnp.float32)
  fn = lambda q, k, v: pallas.flex_attention_pallas(
      q, k, v, scale=0.2, is_causal=True, window=None, q_segment_ids=None,
      kv_segment_ids=None, key_value_seq_lengths=None, interpret=True, config=_FROZEN)
  expected = jax.vmap(lambda q, k, v: flex_tests.flex_attention_reference(
      q, k, v, is_causal=True, scale=0.2))(q, k, v)
  assert flex_tests._rel(jax.vmap(fn)(q, k, v), expected) < flex_tests._TOL[jnp.float32]


def test_config_names_the_softmax():
  with pytest.raises(ValueError, match="fwd_softmax"):
    dataclasses.replace(_INTERPRET, fwd_softmax="maximum")
  with pytest.raises(ValueError, match="refresh"):
    dataclasses.replace(_INTERPRET, refresh="later")


@pytest.mark.parametrize("dtype, refresh, extra", [
    (jnp.bfloat16, "launch", {}), (jnp.float32, "launch", {}), (jnp.bfloat16, "in_kernel", {}),
    # The second pass's row slices of segment ids and of mask_mod's lists.
    (jnp.bfloat16, "launch", dict(q_segment_ids=jnp.zeros((2, 512), jnp.int32),
                                  kv_segment_ids=jnp.zeros((2, 512), jnp.int32))),
    (jnp.bfloat16, "launch", dict(mask_mod=lambda b, n, t, s: s != t + 1)),
])
def test_triton_forward_lowers_for_hopper(dtype, refresh, extra, hopper_lowering):
  """The frozen walk, the row sums' dot and the second pass (a launch, or a
  branch of the forward kernel) lower for sm90."""
  config = dataclasses.replace(configs.get_config(
      32, jnp.bfloat16, interpret=False, generation="sm90").forward_on(None),
                               fwd_softmax="first_tile_max", refresh=refresh)
  spec = jax.ShapeDtypeStruct((2, 512, 4, 32), dtype)
  options = dict(dict(q_segment_ids=None, kv_segment_ids=None), **extra)
  fn = lambda q, k, v: pallas.flex_attention_pallas(
      q, k, v, scale=0.17, is_causal=True, window=None, key_value_seq_lengths=None,
      interpret=False, config=config, **options)
  text = jax.jit(fn).trace(spec, spec, spec).lower(lowering_platforms=("cuda",)).as_text()
  # The forward and the second pass, or the forward alone.
  assert text.count("__gpu$xla.gpu.triton") == (2 if refresh == "launch" else 1)
