"""The measured dispatch tables (`ops._measured`) and the tables committed."""

import json

import pytest

from ops import _measured

_POINTS = [
    dict(dtype="bfloat16", variant="full", head_dim=64, length=1024, ms=dict(a=1.0, b=2.0)),
    dict(dtype="bfloat16", variant="full", head_dim=128, length=1024, ms=dict(a=2.0, b=1.0)),
    dict(dtype="bfloat16", variant="full", head_dim=128, length=8192, ms=dict(a=3.0, b=1.0)),
    dict(dtype="bfloat16", variant="causal", head_dim=64, length=1024, ms=dict(a=3.0, b=1.0)),
    dict(dtype="float32", variant="full", head_dim=64, length=1024, ms=dict(a=1.0)),
]


@pytest.fixture
def table(monkeypatch):
  tables = dict(t=dict(keys=["dtype", "variant"], axes=["head_dim", "length"], points=_POINTS))
  monkeypatch.setattr(_measured, "load", tables.get)


def _fastest(candidates=("a", "b"), **call):
  call = dict(dict(dtype="bfloat16", variant="full", head_dim=64, length=1024), **call)
  return _measured.fastest("t", candidates, **call)


@pytest.mark.parametrize("call, expected", [
    (dict(), "a"),                                 # a measured point
    (dict(head_dim=80), "b"),                      # judged by H 128, L 1024
    (dict(head_dim=32, length=77), "a"),           # the smallest point covers it
    (dict(head_dim=128, length=3000), "b"),        # judged by L 8192
    (dict(head_dim=256, length=100000), "b"),      # past the grid: its largest point
    (dict(variant="causal"), "b"),
    (dict(variant="gqa"), "a"),                    # no 'gqa' point: the variant is dropped
    (dict(variant="gqa", head_dim=128), "b"),
])
def test_the_covering_point_decides(table, call, expected):
  del table
  assert _fastest(**call) == expected


def test_the_nearest_point_stands_in_where_the_covering_one_was_not_timed(table):
  # Covering sizes H 64, L 8192: not timed; H 128, L 8192 is nearer than H 64, L 1024.
  del table
  assert _fastest(head_dim=64, length=5000) == "b"


def test_nothing_decided(table):
  del table
  assert _fastest(candidates=("b",), dtype="float32") is None   # 'b' not timed there
  assert _fastest(candidates=(), dtype="bfloat16") is None
  assert _fastest(dtype="float16") is None                      # no point has that dtype
  assert _measured.fastest("absent", ("a",), length=1) is None  # no table


def test_only_candidates_are_chosen(table):
  del table
  assert _fastest(candidates=("b",)) == "b"


def test_a_table_without_keys(monkeypatch):
  table = dict(keys=[], axes=["length"],
               points=[dict(length=100, ms=dict(a=1.0, b=2.0)),
                       dict(length=1000, ms=dict(a=2.0, b=1.0))])
  monkeypatch.setattr(_measured, "load", lambda name: table)
  assert _measured.fastest("t", ("a", "b"), length=50) == "a"
  assert _measured.fastest("t", ("a", "b"), length=101) == "b"


@pytest.mark.parametrize("name", ["attention", "moe", "ssd", "gated_delta_rule",
                                  "selective_scan", "linear_scan"])
def test_committed_tables_are_well_formed(name):
  table = _measured.load(name)
  assert table is not None, f"ops/dispatch_tables/{name}.json is missing"
  assert table["table"] == name and table["mode"] == "fwd+bwd" and table["sources"]
  for point in table["points"]:
    assert set(point) == {*table["keys"], *table["axes"], "ms"}, point
    assert len(point["ms"]) >= 2 and all(ms > 0 for ms in point["ms"].values()), point
  json.dumps(table)
