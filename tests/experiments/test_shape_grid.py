"""experiments.shape_grid: the grid holds exactly the shape values issue 55
lists, at the sizes its docstring states, and its subsets cover it."""

import itertools

import pytest

from experiments import shape_grid as sg

HEAD_SIZES = {16, 32, 64, 80, 96, 128, 192, 256}
LENGTHS = {77, 512, 1000, 3000, 4096, 8192}
VARIANTS = {"full", "causal", "sliding_window", "gqa", "cross"}


def test_attention_grid_is_the_issues_cross_product_in_bf16_and_a_few_f32_points():
  grid = sg.attention_grid("full")
  bf16 = [p for p in grid if p.dtype == "bfloat16"]
  f32 = [p for p in grid if p.dtype == "float32"]
  assert len(bf16) == len(HEAD_SIZES) * len(LENGTHS) * len(VARIANTS) == 240
  assert {(p.head_dim, p.length, p.variant) for p in bf16} == set(
      itertools.product(HEAD_SIZES, LENGTHS, VARIANTS))
  assert 0 < len(f32) <= 8
  assert {(p.head_dim, p.length, p.variant) for p in f32} <= {
      (p.head_dim, p.length, p.variant) for p in bf16}
  assert len({p.name for p in grid}) == len(grid)  # names are unique row keys


def test_chunked_moe_and_scan_grids_are_the_issues_values():
  chunked = sg.chunked_grid("full")
  assert sorted((p.key_dim, p.length) for p in chunked) == sorted(
      itertools.product([32, 64, 96, 128, 256], [100, 1000, 5000]))
  assert all(p.shape[3] == p.shape[4] == p.key_dim for p in chunked)  # K = V
  moe = sg.moe_grid("full")
  widths = [256, 512, 1024, 2048]
  assert sorted((p.experts, p.top_k, p.d_model, p.d_hidden) for p in moe) == sorted(
      (e, k, d, f) for (e, k), d, f in itertools.product([(8, 2), (64, 8), (128, 8)],
                                                         widths, widths))
  assert sorted(p.state for p in sg.scan_grid("full")) == [16, 24, 64, 128]


def test_every_point_holds_about_16k_tokens():
  for p in sg.attention_grid("full"):
    assert 0.9 <= p.batch * p.length / sg.TOKENS <= 1.1, p
  for p in sg.chunked_grid("full"):
    batch, time = p.shape[:2]
    assert 0.9 <= batch * time / sg.TOKENS <= 1.1, p
  for p in sg.moe_grid("full"):
    assert p.tokens == sg.TOKENS and p.rows == sg.TOKENS * p.top_k
  for p in sg.scan_grid("full"):
    assert p.batch * p.length == sg.TOKENS


def test_attention_variants_mean_what_their_names_say():
  points = {p.variant: p for p in sg.attention_grid("full")
            if p.head_dim == 64 and p.length == 4096 and p.dtype == "bfloat16"}
  full, causal, window = points["full"], points["causal"], points["sliding_window"]
  gqa, cross = points["gqa"], points["cross"]
  assert (full.is_causal, full.window, full.kv_heads, full.q_len) == (False, None, 16, 4096)
  assert (causal.is_causal, causal.window) == (True, None)
  assert (window.is_causal, window.window) == (True, (sg.SLIDING_WINDOW, 0))
  assert gqa.heads == 8 * gqa.kv_heads and gqa.is_causal
  assert not cross.is_causal and cross.kv_len == 4096 and cross.q_len == 256
  for p in sg.attention_grid("full"):
    if p.variant == "cross":
      assert 4 * p.q_len <= p.kv_len, p  # T << S, at 77 too
  # The FLOP counts count the scores the mask keeps.
  t, per_score = 4096, 4 * full.batch * full.heads * full.head_dim
  assert full.flops("fwd") == per_score * t * t
  assert causal.flops("fwd") == per_score * t * (t + 1) // 2
  left = sg.SLIDING_WINDOW
  assert window.flops("fwd") == per_score * (t * (left + 1) - left * (left + 1) // 2)
  assert full.flops("fwd+bwd") == 3.5 * full.flops("fwd")


def test_quick_subset_covers_every_value_of_the_grid():
  quick = sg.attention_grid("quick")
  full = set(sg.attention_grid("full"))
  assert set(quick) <= full
  assert {p.head_dim for p in quick} == HEAD_SIZES
  assert {p.length for p in quick} == LENGTHS
  assert {p.variant for p in quick} == VARIANTS
  assert {p.dtype for p in quick} == {"bfloat16", "float32"}
  moe = sg.moe_grid("quick")
  assert set(moe) <= set(sg.moe_grid("full"))
  assert {(p.experts, p.top_k) for p in moe} == {(8, 2), (64, 8), (128, 8)}
  assert sg.chunked_grid("quick") == sg.chunked_grid("full")
  assert sg.scan_grid("quick") == sg.scan_grid("full")
  for grid in sg.GRIDS.values():  # smoke points are small and few
    assert 1 <= len(grid("smoke")) <= 3


def test_offsets_of_a_stride_partition_the_grid():
  grid = sg.attention_grid("full")
  parts = [sg.select(grid, 7, i) for i in range(7)]
  assert sorted(itertools.chain(*parts), key=grid.index) == list(grid)
  assert sum(map(len, parts)) == len(grid)
  assert sg.select(grid) == grid


@pytest.mark.parametrize("make, message", [
    (lambda: sg.AttentionPoint(64, 100, "diagonal"), "`variant`"),
    (lambda: sg.AttentionPoint(64, 100, "full", "float16"), "`dtype`"),
    (lambda: sg.AttentionPoint(0, 100, "full"), "`head_dim`"),
    (lambda: sg.AttentionPoint(64, 100, "gqa", heads=12), "multiple of 8"),
    (lambda: sg.MoePoint(8, 16, 256, 256), "`top_k`"),
    (lambda: sg.ChunkedPoint(32, -1), "`length`"),
    (lambda: sg.attention_grid("most"), "`subset`"),
    (lambda: sg.select((1, 2, 3), 0), "`stride`"),
    (lambda: sg.select((1, 2, 3), 2, 2), "`offset`"),
])
def test_bad_arguments_raise_naming_them(make, message):
  with pytest.raises(ValueError, match=message):
    make()
