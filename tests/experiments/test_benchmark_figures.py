"""The performance page's derived ratios come from the same file's medians."""

import pytest

from experiments import benchmark_figures


def test_peer_ratios_pair_rows_of_the_same_configuration():
  rows = [
      {"model": "t", "attention": "default", "mode": "fwd", "median_ms": 3.0},
      {"model": "t", "attention": "cudnn", "mode": "fwd", "median_ms": 4.0},
      {"model": "t", "attention": "xla", "mode": "fwd", "median_ms": 12.0},
      {"model": "t", "attention": "default", "mode": "step", "median_ms": 9.0},
      {"model": "t", "attention": "cudnn", "mode": "step", "median_ms": 10.0},
      {"model": "t", "attention": "default", "mode": "oom", "status": "OOM"},
  ]
  out = benchmark_figures.peer_ratios(rows)
  assert out[0]["attention_vs_cudnn"] == pytest.approx(0.75)
  assert out[0]["attention_vs_xla"] == pytest.approx(0.25)
  assert out[2]["attention_vs_cudnn"] == pytest.approx(3.0)
  assert out[3]["attention_vs_cudnn"] == pytest.approx(0.9)
  assert "attention_vs_xla" not in out[3]      # no XLA row at this mode
  assert "attention_vs_cudnn" not in out[1]    # a peer is not compared with itself
  assert "attention_vs_cudnn" not in out[5]    # no time, no ratio
  assert "attention_vs_cudnn" not in rows[0]   # the input rows are left alone


def test_tuning_columns_do_not_split_a_configuration():
  rows = [
      {"op": "scan", "impl": "pallas", "blocks": "b64", "median_ms": 2.0},
      {"op": "scan", "impl": "xla", "blocks": None, "median_ms": 8.0},
  ]
  assert benchmark_figures.peer_ratios(rows)[0]["impl_vs_xla"] == pytest.approx(0.25)
