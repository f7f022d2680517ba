"""Tuned kernel configurations, as data: one JSON file per op, one loader.

Each op keeps its backends' configuration classes in `ops/<op>/configs.py`,
named the same way everywhere (`TritonConfig`, `MosaicConfig`, ...), and the
tuned values in `ops/<op>/tuned.json`; kernel files hold no tile constants.
A file maps each class name to a list of entries, tried in order; an entry's
keys other than "fields" are conditions on the call (the device kind, the
padded head size, the dtype, interpret mode, ...), except "source" (where
the values were measured), and the first entry whose
conditions all hold gives the fields. The last entry of a list, with no
conditions (or only "device": "*"), is the default:

  {"TritonConfig": [
     {"device": "NVIDIA H200", "head_dim": 64, "fields": {"block_q": 128, ...}},
     {"fields": {"block_q": 64, ...}}]}

A field that is itself a configuration dataclass is given as an object of
its fields, or null where the class allows None; a tuple of them, as a list
of objects. How each table was measured: BUILD_NOTES.md, under the op's
section.
"""

import dataclasses
import functools
import importlib.resources
import json
import types
import typing
from typing import Any, TypeVar

import jax

T = TypeVar("T")
ANY_DEVICE = "*"
_NOT_CONDITIONS = {"fields", "source"}
# The classes whose unconditional entry `fill_unset` is building: the fields
# that entry leaves null stay None in it rather than being filled again.
_BUILDING_DEFAULTS: set[type] = set()


@functools.cache
def _read(op: str) -> dict:
  path = importlib.resources.files("ops").joinpath(op, "tuned.json")
  return json.loads(path.read_text())


def device_kind() -> str:
  """The default device's kind ('NVIDIA H200', 'cpu', ...): what an
  entry's "device" condition is compared with."""
  return jax.devices()[0].device_kind


def entries(op: str, cls: type) -> list[dict]:
  """`cls`'s entries in `ops/<op>/tuned.json` (a KeyError naming both when
  there are none)."""
  table = _read(op)
  if cls.__name__ not in table:
    raise KeyError(f"ops/{op}/tuned.json has no entries for {cls.__name__}")
  return table[cls.__name__]


def tuned(op: str, cls: type[T], *, device: str | None = None, **call: Any) -> T:
  """The tuned `cls` for a call: the first matching entry (module docstring).

  Args:
    op: the op's package name ('ssd', 'flex_attention', ...).
    cls: the configuration dataclass.
    device: the device kind to match; None: this process's default device.
    **call: the call's value for every condition the entries may name.
  """
  device = device_kind() if device is None else device
  for entry in entries(op, cls):
    conditions = {k: v for k, v in entry.items() if k not in _NOT_CONDITIONS}
    wanted_device = conditions.pop("device", ANY_DEVICE)
    if wanted_device not in (ANY_DEVICE, device):
      continue
    unknown = set(conditions) - set(call)
    if unknown:
      raise KeyError(f"ops/{op}/tuned.json: {cls.__name__} entry names {sorted(unknown)}, "
                     f"which the call does not give (it gives {sorted(call)})")
    if all(call[k] == v for k, v in conditions.items()):
      return build(cls, entry["fields"])
  raise LookupError(f"ops/{op}/tuned.json: no {cls.__name__} entry matches {call} on {device}")


def fill_unset(config, op: str) -> None:
  """Sets each of `config`'s fields that is None from its class's
  unconditional entry for this device (the last, usually), so that
  `TritonConfig(chunk=16)` is the tuned configuration with one field changed.
  A field that entry gives as null stays None (for a class where None means
  something). For a frozen dataclass's `__post_init__`."""
  cls = type(config)
  unset = [f.name for f in dataclasses.fields(cls) if getattr(config, f.name) is None]
  if not unset or cls in _BUILDING_DEFAULTS:
    return
  device = device_kind()
  for entry in entries(op, cls):
    conditions = set(entry) - _NOT_CONDITIONS - {"device"}
    if not conditions and entry.get("device", ANY_DEVICE) in (ANY_DEVICE, device):
      _BUILDING_DEFAULTS.add(cls)
      try:
        tuned_config = build(cls, entry["fields"])
      finally:
        _BUILDING_DEFAULTS.discard(cls)
      for name in unset:
        object.__setattr__(config, name, getattr(tuned_config, name))
      return
  raise LookupError(f"ops/{op}/tuned.json: no unconditional {cls.__name__} entry on {device}")


def build(cls: type[T], fields: dict | None) -> T | None:
  """`cls(**fields)`, building nested configuration dataclasses from dicts."""
  if fields is None:
    return None
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for name, value in fields.items():
    nested = _dataclass_in(hints[name])
    if nested and isinstance(value, dict):
      value = build(nested, value)
    elif nested and isinstance(value, list):
      value = tuple(build(nested, v) for v in value)
    kwargs[name] = value
  return cls(**kwargs)


def _dataclass_in(hint) -> type | None:
  """The dataclass a field's type names (`C`, `C | None` or `tuple[C, ...]`),
  else None."""
  if dataclasses.is_dataclass(hint):
    return hint
  if isinstance(hint, types.UnionType) or typing.get_origin(hint) in (typing.Union, tuple):
    return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)
  return None
