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


# The cases that recompute rows in the forward kernel (`in_kernel`, one
# without and one with mask_mod's tile lists); the others take the second
# launch (`frozen`), which test_second_pass_recomputes_only_flagged_tiles_in_groups
# also runs with key lengths and a mask_mod. Each case runs once.
_IN_KERNEL_CASES = ("window_lengths_gqa_bf16", "documents_f32")


def _check_triton_case(name):
  b, t, s, n, kh, h, dtype, options = _CASES[name]
  options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
             for k, v in options.items()}
  flex_tests._check(b, t, s, n, kh, h, dtype, **options)


@pytest.mark.parametrize("name", [name for name in _CASES if name not in _IN_KERNEL_CASES])
def test_triton_forward_matches_reference(name, frozen):
  _check_triton_case(name)


# Each way the walk meets the kept maxima once: masked tiles after them
# online, with the row sums in registers (128 rows, causal) and on the tensor
# cores (the turns, a window, key lengths); masked tiles on them
# (`frozen_masked_tiles`) with either sums; no masked tile at all
# (persistent, full attention). (The online walks' own options:
# test_flex_attention_mosaic.py; the diagonal tiles on the kept maxima at 64
# rows: test_far_key_on_the_diagonal_is_recomputed.)
@pytest.mark.parametrize("tiles, options", [
    # The H64 entry's walk: one block per SM, full attention, GQA.
    (configs.MosaicConfig(block_q=64, block_k=64, persistent=True), {}),
    # The H32 entry's: 128 rows per warpgroup, free-running, causal; the
    # diagonal tiles after the kept-maxima ones run online.
    (configs.MosaicConfig(block_q=128, block_k=64, ping_pong=False),
     dict(is_causal=True)),
    # The row sums on the tensor cores, with the ping-pong turns: the window's
    # masked tiles after the kept-maxima ones run online and must rescale the
    # sums' accumulator.
    (configs.MosaicConfig(block_q=64, block_k=64, tensor_core_sums=True),
     dict(local_window_size=(150, 100), key_value_seq_lengths=np.array([200]))),
    # `frozen_masked_tiles`: a window's right edge and the key lengths' last
    # tile on the kept maxima, their closed keys at p = 0. The window's
    # left-edge tiles come first and stay online: there rows 255 and up see
    # no key (their window starts at key 64), so the open tile after them
    # must run online too.
    (configs.MosaicConfig(block_q=64, block_k=64, tensor_core_sums=True,
                          frozen_masked_tiles=True),
     dict(local_window_size=(191, 100), key_value_seq_lengths=np.array([200]))),
    # The H64 entry's short causal walk: persistent, heaviest items first,
    # the next query tile prefetched, with the turns; the causal diagonal
    # tiles on the kept maxima, the row sums in registers.
    (configs.MosaicConfig(block_q=64, block_k=64, persistent=True,
                          persistent_right_bounded=True, frozen_masked_tiles=True,
                          prefetch_query=True), dict(is_causal=True)),
], ids=["persistent", "free_128_rows_causal", "tensor_core_sums_turns_window_lengths",
        "frozen_masked_sums_masked_tile_first", "frozen_masked_persistent_causal_prefetch"])
def test_mosaic_forward_matches_reference(tiles, options, monkeypatch):
  # Without the second pass: no row here passes the sum limit, so the walk's
  # own tiles must be exact (a row whose first tile kept an -inf maximum would
  # otherwise be hidden by the refresh).
  monkeypatch.setattr(flex_triton, "refresh_frozen", lambda *args: args[-2:])
  options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
             for k, v in options.items()}
  config = dataclasses.replace(mosaic_tests._CONFIG, mosaic_fwd=tiles,
                               fwd_softmax="first_tile_max")
  q, k, v, w = mosaic_tests._inputs(1, 256, 256, 2, 1, 64, jnp.bfloat16)
  st, _, _ = mosaic_tests._prepared(
      q.shape, k.shape, jnp.bfloat16, scale=1.0, is_causal=options.get("is_causal", False),
      window=options.get("local_window_size"), q_segment_ids=None, kv_segment_ids=None,
      key_value_seq_lengths=None, interpret=True, config=config)
  assert st.config.mosaic_fwd is not None and st.config.fwd_softmax == "first_tile_max"
  out, grads = jax.jit(functools.partial(
      flex_tests._vjp, mosaic_tests._kernel(config, **options)))(q, k, v, w)
  out_r, grads_r = jax.jit(functools.partial(
      flex_tests._vjp, mosaic_tests._reference(**options)))(q, k, v, w)
  for name, x, x_r in [("out", out, out_r), *zip(("dq", "dk", "dv"), grads, grads_r)]:
    assert mosaic_tests._rel(x, x_r) < mosaic_tests._TOL[jnp.bfloat16], name


def _one_far_key(seed, seq_q, seq_kv, head_dim, far_key, along_q, dtype=np.float32):
  """q [1, T, 1, H], k, v [1, S, 1, H] in `dtype`: q standard normal but
  `along_q` in its first component, k 0.1 x standard normal but 100 in the
  first component of key `far_key`, v standard normal (NumPy's draws)."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((1, seq_q, 1, head_dim), np.float32)
  q[..., 0] = along_q
  k = 0.1 * rng.standard_normal((1, seq_kv, 1, head_dim), np.float32)
  k[0, far_key, 0, 0] = 100.0
  v = rng.standard_normal((1, seq_kv, 1, head_dim), np.float32)
  return tuple(jnp.asarray(x.astype(dtype)) for x in (q, k, v))


def _far_above_the_first_tile():
  """Keys small but key 40 (an open tile after the first) along q, with a logit ~500 base-2 units above
  the first tile's maxima: its p overflows, and the rows need the second pass."""
  return _one_far_key(7, 40, 80, 64, far_key=40, along_q=30.0)


def _forward(q, k, v):
  st, args = pallas.prepare(q, k, v, scale=q.shape[-1] ** -0.5, is_causal=False,
                            window=None, q_segment_ids=None, kv_segment_ids=None,
                            key_value_seq_lengths=None, interpret=True)
  return pallas._forward(st, *args)[0][:, :q.shape[1]]


def _with_unrefreshed(forward, monkeypatch):
  """`forward` jitted, returning also the (out, lse) that the forward kernel
  wrote before the second pass: the refreshed rows and the rows the kernel
  lost come from one program, so the kernel compiles once."""
  written = []
  refresh = flex_triton.refresh_frozen
  def recorded(*args):
    written.append(args[-2:])
    return refresh(*args)
  monkeypatch.setattr(flex_triton, "refresh_frozen", recorded)
  return jax.jit(lambda *args: (forward(*args), written[-1]))


def _jitted_reference(q, k, v, **options):
  """reference.py's output, compiled as one program."""
  return jax.jit(lambda q, k, v: flex_tests.flex_attention_reference(q, k, v, **options))(
      q, k, v)


def test_rows_past_their_frozen_maxima_are_recomputed(frozen, monkeypatch):
  q, k, v = _far_above_the_first_tile()
  out, (unrefreshed, _) = _with_unrefreshed(_forward, monkeypatch)(q, k, v)
  expected = _jitted_reference(q, k, v)
  assert flex_tests._rel(out, expected) < flex_tests._TOL[jnp.float32]
  # Without the second pass these rows are lost (NaN or inf).
  assert not np.isfinite(np.asarray(unrefreshed[:, :q.shape[1]])).all()


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
  q, k, v = _one_far_key(5, 256, 256, 32, far_key=200, along_q=24.0, dtype=jnp.bfloat16)
  def forward(q, k, v):  # the forward alone
    st, args = pallas.prepare(q, k, v, scale=32 ** -0.5, is_causal=True, window=None,
                              q_segment_ids=None, kv_segment_ids=None,
                              key_value_seq_lengths=None, interpret=True, config=config)
    assert st.config.mosaic_fwd == tiles
    return pallas._forward(st, *args)[0]
  out, (unrefreshed, _) = _with_unrefreshed(forward, monkeypatch)(q, k, v)
  expected = _jitted_reference(q, k, v, is_causal=True)
  assert mosaic_tests._rel(out, expected) < mosaic_tests._TOL[jnp.bfloat16]
  unrefreshed = np.asarray(unrefreshed, np.float32)
  # Rows 200-255 see the far key; only with it on the kept maxima are they lost.
  assert np.isfinite(unrefreshed[:, :200]).all()
  assert np.isfinite(unrefreshed[:, 200:]).all() != frozen_masked_tiles


# The second pass's tile lists with the keys' static length (S = 80, padded
# to the key tiles), and key lengths without lists.
@pytest.mark.parametrize("options", [
    dict(mask_mod=lambda b, n, t, s: s != 64 + t // 32),  # a key closed per query tile
    dict(key_value_seq_lengths=np.array([57, 80])),
], ids=["mask_mod", "key_lengths"])
def test_second_pass_recomputes_only_flagged_tiles_in_groups(options, frozen, monkeypatch):
  """Twelve query tiles in groups of four per program of the second pass, two
  batch rows, GQA 2:1; query tiles 0 and 6 of batch row 1 pass their frozen
  maxima (their p overflow), and only they are recomputed."""
  grouped = dataclasses.replace(_FROZEN, refresh_tiles_per_program=4)
  monkeypatch.setattr(configs, "get_config", lambda *a, **kw: grouped)
  rng = np.random.default_rng(3)
  q = rng.standard_normal((2, 384, 2, 32), np.float32)
  far = np.zeros(384, bool)
  far[0:32] = far[192:224] = True
  q[..., 0] = 0.0
  q[1, far, :, 0] = 6.0
  # Keys 40-47 and 64-79 share one far logit: the far rows' outputs average
  # them, so a key the mask closes there still counts.
  k = 0.1 * rng.standard_normal((2, 80, 1, 32), np.float32)
  k[:, 40:48, 0, 0] = k[:, 64:, 0, 0] = 100.0
  v = rng.standard_normal((2, 80, 1, 32), np.float32)
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  options = {key: jnp.asarray(x) if isinstance(x, np.ndarray) else x
             for key, x in options.items()}
  def forward(q, k, v):  # the forward alone
    st, args = pallas.prepare(q, k, v, scale=32 ** -0.5, is_causal=False, window=None,
                              q_segment_ids=None, kv_segment_ids=None, interpret=True,
                              key_value_seq_lengths=options.get("key_value_seq_lengths"),
                              mask_mod=options.get("mask_mod"))
    *args, lists = args
    return pallas._forward(st, *args, None if lists is None else lists["fwd"])[0]
  out, (_, unrefreshed_lse) = _with_unrefreshed(forward, monkeypatch)(q, k, v)
  expected = _jitted_reference(q, k, v, **options)
  assert flex_tests._rel(out, expected) < flex_tests._TOL[jnp.float32]
  # [B, T]: the forward kernel's NaN lse in both heads
  flagged = np.isnan(np.asarray(unrefreshed_lse)).all(axis=1)
  np.testing.assert_array_equal(flagged, np.stack([np.zeros(384, bool), far]))


def test_rows_past_their_frozen_maxima_are_recomputed_in_the_kernel(in_kernel):
  """The same rows, rerun online at the end of the forward kernel (the
  fixture fails the test if the second launch runs)."""
  q, k, v = _far_above_the_first_tile()
  expected = _jitted_reference(q, k, v)
  assert flex_tests._rel(jax.jit(_forward)(q, k, v), expected) < flex_tests._TOL[jnp.float32]


@pytest.mark.parametrize("name", _IN_KERNEL_CASES)
def test_in_kernel_refresh_leaves_other_calls_alone(name, in_kernel):
  """Masks, key lengths, an empty row and a mask_mod, where no row passes the limit."""
  _check_triton_case(name)


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
  shape = (1, 256, 2, 64)
  st, _, _ = mosaic_tests._prepared(
      shape, shape, dtype, scale=0.2, is_causal=False, window=None, q_segment_ids=None,
      kv_segment_ids=None, key_value_seq_lengths=None, interpret=True, config=config, **mods)
  assert st.config.fwd_softmax == expected


def test_prepare_keeps_every_config_field():
  """`prepare` fits the tiles and decides the softmax and the refresh; the
  config's other fields pass through."""
  config = dataclasses.replace(_FROZEN, refresh="in_kernel")
  shape = (1, 64, 2, 32)
  st, _, _ = mosaic_tests._prepared(
      shape, shape, jnp.bfloat16, scale=0.2, is_causal=False, window=None, q_segment_ids=None,
      kv_segment_ids=None, key_value_seq_lengths=None, interpret=True, config=config)
  assert st.config == config


@pytest.mark.parametrize("batch, seq_kv, expected", [
    (2, 128, "in_kernel"),
    (1, _FROZEN.in_kernel_refresh_max_scores // (2 * 64), "in_kernel"),  # at the limit
    (1, _FROZEN.in_kernel_refresh_max_scores // (2 * 64) + 1, "launch"),  # one key more
    (2, _FROZEN.in_kernel_refresh_max_scores // (2 * 64), "launch"),
])
def test_auto_refresh_follows_the_number_of_scores(batch, seq_kv, expected):
  config = dataclasses.replace(_FROZEN, refresh="auto")
  st, _, _ = mosaic_tests._prepared(
      (batch, 64, 2, 32), (batch, seq_kv, 2, 32), jnp.bfloat16, scale=0.2, is_causal=False,
      window=None, q_segment_ids=None, kv_segment_ids=None, key_value_seq_lengths=None,
      interpret=True, config=config)
  assert st.config.refresh == expected


def test_vmap(frozen):
  """vmap batches the forward and its second pass (out, lse aliased)."""
  q, k, v, _ = flex_tests._inputs((3, 1, 96, 2, 32), (3, 1, 96, 2, 32), jnp.float32)
  fn = lambda q, k, v: pallas.flex_attention_pallas(
      q, k, v, scale=0.2, is_causal=True, window=None, q_segment_ids=None,
      kv_segment_ids=None, key_value_seq_lengths=None, interpret=True, config=_FROZEN)
  expected = jax.jit(jax.vmap(lambda q, k, v: flex_tests.flex_attention_reference(
      q, k, v, is_causal=True, scale=0.2)))(q, k, v)
  got = jax.jit(jax.vmap(fn))(q, k, v)
  assert flex_tests._rel(got, expected) < flex_tests._TOL[jnp.float32]


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
