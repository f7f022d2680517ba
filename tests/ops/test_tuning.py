"""`ops.tuning`: the one loader of the kernels' tuned configurations."""

import dataclasses
import importlib
import pathlib

import pytest

from ops import tuning

_OPS = pathlib.Path(tuning.__file__).parent


@dataclasses.dataclass(frozen=True)
class Tiles:
  block: int
  warps: int = 4


@dataclasses.dataclass(frozen=True)
class TwoLaunches:
  forward: Tiles
  backward: Tiles | None = None
  stages: int | None = None

  def __post_init__(self):
    tuning.fill_unset(self, "fake_op")


@dataclasses.dataclass(frozen=True)
class Candidates:
  tiles: tuple[Tiles, ...]


@dataclasses.dataclass(frozen=True)
class Split:
  block: int | None = None
  split: int | None = None  # None: no split

  def __post_init__(self):
    tuning.fill_unset(self, "fake_op")


_TABLE = {
    "Tiles": [
        {"device": "NVIDIA H200", "head_dim": 64, "fields": {"block": 128, "warps": 8}},
        {"device": "*", "head_dim": 64, "source": "a sweep", "fields": {"block": 64}},
        {"fields": {"block": 32}},
    ],
    "TwoLaunches": [
        {"device": "NVIDIA H200", "fields": {"forward": {"block": 128}, "backward": None,
                                             "stages": 3}},
        {"fields": {"forward": {"block": 16}, "backward": {"block": 32, "warps": 2},
                    "stages": 1}},
    ],
    "Split": [{"fields": {"block": 16, "split": None}}],
    "Candidates": [{"fields": {"tiles": [{"block": 128}, {"block": 64, "warps": 8}]}}],
}


@pytest.fixture(autouse=True)
def fake_table(monkeypatch):
  real = tuning._read
  monkeypatch.setattr(tuning, "_read", lambda op: _TABLE if op == "fake_op" else real(op))


def test_the_first_matching_entry_wins():
  assert tuning.tuned("fake_op", Tiles, device="NVIDIA H200", head_dim=64) == Tiles(128, 8)
  assert tuning.tuned("fake_op", Tiles, device="NVIDIA H100", head_dim=64) == Tiles(64)
  assert tuning.tuned("fake_op", Tiles, device="NVIDIA H200", head_dim=128) == Tiles(32)


def test_nested_configurations_and_none_are_built():
  h200 = tuning.tuned("fake_op", TwoLaunches, device="NVIDIA H200")
  assert h200 == TwoLaunches(Tiles(128), None, 3)
  other = tuning.tuned("fake_op", TwoLaunches, device="cpu")
  assert other == TwoLaunches(Tiles(16), Tiles(32, 2), 1)


def test_a_tuple_of_configurations_is_built_from_a_list():
  assert tuning.tuned("fake_op", Candidates) == Candidates((Tiles(128), Tiles(64, 8)))


def test_a_null_in_the_default_entry_leaves_the_field_none():
  assert Split().block == 16 and Split().split is None
  assert Split(split=2).split == 2


def test_unset_fields_take_the_tuned_values_for_this_device():
  config = TwoLaunches(Tiles(8))  # on this process's device: the unconditional entry
  assert config.stages == 1 and config.backward == Tiles(32, 2)
  assert TwoLaunches(Tiles(8), stages=5).stages == 5


def test_a_condition_the_call_does_not_give_is_an_error():
  with pytest.raises(KeyError, match=r"names \['head_dim'\]"):
    tuning.tuned("fake_op", Tiles, device="NVIDIA H200")
  with pytest.raises(KeyError, match="no entries for str"):
    tuning.tuned("fake_op", str)


def _tuned_ops():
  return sorted(p.parent.name for p in _OPS.glob("*/tuned.json"))


@pytest.mark.parametrize("op", _tuned_ops())
def test_every_committed_entry_builds(op):
  configs = importlib.import_module(f"ops.{op}.configs")
  for name, entries in tuning._read(op).items():
    cls = getattr(configs, name)
    for entry in entries:
      assert isinstance(tuning.build(cls, entry["fields"]), cls), (op, name, entry)
