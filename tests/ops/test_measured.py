"""The measured dispatch tables (`ops._measured`) and the tables committed.

The device kind and JAX release are faked (`_measured.platform`), so the rule
that a kernel needs a passing check and a measurement on this device kind
runs on a CPU.
"""

import json

import pytest

from ops import _backend
from ops import _measured

_POINTS = [
    dict(dtype="bfloat16", variant="full", head_dim=64, length=1024, ms=dict(a=1.0, b=2.0)),
    dict(dtype="bfloat16", variant="full", head_dim=128, length=1024, ms=dict(a=2.0, b=1.0)),
    dict(dtype="bfloat16", variant="full", head_dim=128, length=8192, ms=dict(a=3.0, b=1.0)),
    dict(dtype="bfloat16", variant="causal", head_dim=64, length=1024, ms=dict(a=3.0, b=1.0)),
    dict(dtype="float32", variant="full", head_dim=64, length=1024, ms=dict(a=1.0)),
]
GPU = ("NVIDIA H200", "0.11")


def measured_table(points, keys=(), axes=(), kernels=(), checked=None, device=GPU[0],
                   jax="0.11.2"):
  """A table of one device kind's `points`, its `kernels` checked where
  `checked` (default: all of them) says."""
  checked = {k: "2026-12-07T00:00:00" for k in kernels} if checked is None else checked
  return dict(keys=list(keys), axes=list(axes), kernels=list(kernels),
              devices=[dict(device=device, jax=jax, sources=["x.json"], checked=checked,
                            points=points)])


def kernel_measured_faster(**sizes):
  """A table with one point at `sizes` where the kernel ('pallas', checked)
  took half XLA's time."""
  return measured_table([dict(sizes, ms=dict(pallas=1.0, xla=2.0))], axes=tuple(sizes),
                        kernels=("pallas",))


def fake_gpu(monkeypatch, tables: dict):
  """This process as an NVIDIA GPU of kind `GPU` whose dispatch tables are
  `tables` (name -> table; the others absent)."""
  monkeypatch.setattr(_backend, "on_nvidia_gpu", lambda: True)
  monkeypatch.setattr(_measured, "platform", lambda: GPU)
  monkeypatch.setattr(_measured, "load", tables.get)


@pytest.fixture
def table(monkeypatch):
  tables = dict(t=measured_table(_POINTS, ("dtype", "variant"), ("head_dim", "length")))
  monkeypatch.setattr(_measured, "load", tables.get)
  monkeypatch.setattr(_measured, "platform", lambda: GPU)


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
  table = measured_table([dict(length=100, ms=dict(a=1.0, b=2.0)),
                          dict(length=1000, ms=dict(a=2.0, b=1.0))], axes=("length",))
  monkeypatch.setattr(_measured, "load", lambda name: table)
  monkeypatch.setattr(_measured, "platform", lambda: GPU)
  assert _measured.fastest("t", ("a", "b"), length=50) == "a"
  assert _measured.fastest("t", ("a", "b"), length=101) == "b"


_KERNEL_FASTER = [dict(length=100, ms=dict(pallas=1.0, xla=2.0))]


@pytest.mark.parametrize("platform, checked, expected", [
    (GPU, None, "pallas"),                          # checked and faster here
    (GPU, {}, "xla"),                               # measured, never checked: not a candidate
    (("NVIDIA A100", "0.11"), None, None),          # another device kind: no data
    (("NVIDIA H200", "0.12"), None, None),          # another JAX release: no data
    (("NVIDIA H200", "0.11"), dict(other="x"), "xla"),  # another kernel's check does not count
])
def test_a_kernel_counts_only_checked_and_measured_on_this_device_kind(
    monkeypatch, platform, checked, expected):
  table = measured_table(_KERNEL_FASTER, axes=("length",), kernels=("pallas",), checked=checked)
  monkeypatch.setattr(_measured, "load", lambda name: table)
  monkeypatch.setattr(_measured, "platform", lambda: platform)
  assert _measured.fastest("t", ("pallas", "xla"), length=100) == expected


def test_the_data_of_the_running_device_kind_decides(monkeypatch):
  table = measured_table(_KERNEL_FASTER, axes=("length",), kernels=("pallas",))
  table["devices"].append(dict(device="NVIDIA L4", jax="0.11.2, 0.12.0", sources=[],
                               checked=dict(pallas="t"),
                               points=[dict(length=100, ms=dict(pallas=3.0, xla=2.0))]))
  monkeypatch.setattr(_measured, "load", lambda name: table)
  for platform, expected in ((GPU, "pallas"), (("NVIDIA L4", "0.12"), "xla")):
    monkeypatch.setattr(_measured, "platform", lambda platform=platform: platform)
    assert _measured.fastest("t", ("pallas", "xla"), length=100) == expected


def test_a_gpu_without_data_says_once_what_runs_and_how_to_measure_it(monkeypatch):
  said = []
  monkeypatch.setattr(_measured.logging, "warning", lambda msg, *args: said.append(msg % args))
  _measured._say_once.cache_clear()
  table = measured_table(_KERNEL_FASTER, axes=("length",), kernels=("pallas",))
  monkeypatch.setattr(_measured, "load", lambda name: table)
  monkeypatch.setattr(_measured, "platform", lambda: ("NVIDIA B200", "0.11"))
  for _ in range(3):
    assert _measured.fastest("t", ("pallas", "xla"), length=100) is None
  assert len(said) == 1
  assert "NVIDIA B200" in said[0] and "cuDNN" in said[0] and "XLA" in said[0]
  assert "python -m experiments.gpu_check" in said[0]
  assert "python -m experiments.dispatch_tables" in said[0]
  _measured._say_once.cache_clear()


@pytest.mark.parametrize("name", ["attention", "moe", "ssd", "gated_delta_rule",
                                  "selective_scan", "linear_scan"])
def test_committed_tables_are_well_formed(name):
  table = _measured.load(name)
  assert table is not None, f"ops/dispatch_tables/{name}.json is missing"
  assert table["table"] == name and table["mode"] in ("fwd", "fwd+bwd") and table["kernels"]
  assert table["devices"]
  for data in table["devices"]:
    assert data["device"] and data["jax"] and data["sources"]
    assert set(data["checked"]) <= set(table["kernels"])
    for point in data["points"]:
      assert set(point) == {*table["keys"], *table["axes"], "ms"}, point
      assert len(point["ms"]) >= 2 and all(ms > 0 for ms in point["ms"].values()), point
  json.dumps(table)
