"""`ops.registry`: names, aliases, sequences, reasons and the measured default."""

import pytest

from ops import _backend
from ops import _measured
from ops import registry


def _registry(monkeypatch, *, on_gpu, fastest=None):
  monkeypatch.setattr(_backend, "on_nvidia_gpu", lambda: on_gpu)
  asked = []
  def fake_fastest(table, candidates, **call):
    asked.append((table, tuple(candidates), call))
    return fastest(table, candidates) if fastest else None
  monkeypatch.setattr(_measured, "fastest", fake_fastest)
  small = lambda call: None if call["size"] <= 128 else f"`x` size {call['size']} must be <= 128"
  ops_registry = registry.Registry("op", table="op")
  ops_registry.register("xla", lambda size: "xla")
  ops_registry.register("triton", lambda size: "triton", supports=small, kernel=True,
                        measured_as="pallas")
  ops_registry.register("mosaic", lambda size: "mosaic", kernel=True,
                        measured_range=lambda call: None if call["size"] <= 64 else "not timed")
  ops_registry.alias("pallas", ("mosaic", "triton"))
  return ops_registry, asked


def test_a_name_runs_or_raises_its_reason(monkeypatch):
  ops_registry, _ = _registry(monkeypatch, on_gpu=False)
  assert ops_registry.choose("triton", {"size": 8}).run(size=8) == "triton"
  with pytest.raises(ValueError, match=r"op\(implementation='triton'\): `x` size 256 must be"):
    ops_registry.choose("triton", {"size": 256})


def test_a_sequence_is_tried_in_order_and_reports_every_reason(monkeypatch):
  ops_registry, _ = _registry(monkeypatch, on_gpu=False)
  assert ops_registry.choose(("triton", "xla"), {"size": 256}).name == "xla"
  assert ops_registry.choose(["triton", "xla"], {"size": 8}).name == "triton"
  assert ops_registry.choose("pallas", {"size": 256}).name == "mosaic"  # the alias, in order
  refuse = lambda call: "never"
  ops_registry.register("cudnn", lambda size: None, supports=refuse)
  with pytest.raises(ValueError, match="triton: `x` size 256 .*; cudnn: never"):
    ops_registry.choose(("triton", "cudnn"), {"size": 256})
  ops_registry.register("cuda", lambda size: None, supports=ops_registry["triton"].supports)
  with pytest.raises(ValueError, match=r"implementation=\('triton', 'cuda'\)\): `x` size 256 "
                                       r"must be <= 128$"):  # one reason, said once
    ops_registry.choose(("triton", "cuda"), {"size": 256})


@pytest.mark.parametrize("bad", ["cuda", (), ("xla", "cuda"), 3, [None]])
def test_unknown_names_raise_naming_the_argument(monkeypatch, bad):
  ops_registry, _ = _registry(monkeypatch, on_gpu=False)
  with pytest.raises(ValueError, match=r"`implementation` must be None, one of \('xla'"):
    ops_registry.choose(bad, {"size": 8})
  with pytest.raises(ValueError, match="`impl` must be"):
    ops_registry.check(bad, "impl")
  ops_registry.check(None)
  ops_registry.check(("pallas", "xla"))


def test_default_off_gpu_is_established_without_measuring(monkeypatch):
  ops_registry, asked = _registry(monkeypatch, on_gpu=False, fastest=lambda t, c: c[0])
  assert ops_registry.choose(None, {"size": 8}).name == "xla"
  assert not asked


def test_default_on_gpu_asks_the_table_among_what_fits(monkeypatch):
  ops_registry, asked = _registry(monkeypatch, on_gpu=True,
                                  fastest=lambda t, c: "pallas" if "pallas" in c else None)
  assert ops_registry.choose(None, {"size": 8}, length=4).name == "triton"
  assert asked == [("op", ("xla", "pallas", "mosaic"), {"length": 4})]
  asked.clear()
  # Outside triton's limit and mosaic's measured range only XLA is a candidate.
  assert ops_registry.choose(None, {"size": 256}, length=4).name == "xla"
  assert asked == [("op", ("xla",), {"length": 4})]


def test_default_on_gpu_without_data_is_established(monkeypatch):
  ops_registry, _ = _registry(monkeypatch, on_gpu=True)
  assert ops_registry.choose(None, {"size": 8}).name == "xla"


def test_an_implementation_timed_in_its_own_table_is_judged_there_first(monkeypatch):
  ops_registry, asked = _registry(
      monkeypatch, on_gpu=True, fastest=lambda t, c: "decode" if t == "decode_table" else None)
  ops_registry.register("decode", lambda size: "decode", kernel=True, table="decode_table")
  assert ops_registry.choose(None, {"size": 8}).name == "decode"
  assert asked[0] == ("decode_table", ("decode", "xla"), {})


def test_a_name_registered_twice_raises(monkeypatch):
  ops_registry, _ = _registry(monkeypatch, on_gpu=False)
  with pytest.raises(ValueError, match="registered twice"):
    ops_registry.register("xla", lambda size: None)
