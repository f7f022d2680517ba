"""Each op's implementations by name, and the one rule that chooses among them.

An op registers its implementations in a `Registry` in its `api.py`, one line
each: a name ('xla', 'triton', 'mosaic'; for attention also 'cudnn' and
'decode'), the function that runs it, `supports(call) -> None | reason`, and
the class of its tuned configuration where it has one. The op validates its
arguments once, then asks `Registry.choose` which implementation runs:

  implementation=None       the measured choice: on NVIDIA GPUs the fastest
                            implementation that supports the call at the
                            dispatch-table point that judges it, where this
                            device kind's data has it checked and timed
                            (`ops/_measured.py`); elsewhere, or where nothing
                            was measured, the op's established path (the
                            first of `established` that supports the call).
                            Never raises for a valid call.
  implementation='triton'   that one; a ValueError with its reason when it
                            does not support the call.
  implementation=('mosaic', 'triton', 'xla')
                            the first that supports the call, in order; a
                            ValueError with every reason when none does.

Aliases name a sequence: 'pallas' is every op's GPU kernels (interpret mode
off NVIDIA GPUs), so code written against 'pallas' / 'xla' keeps working.
The `reason` strings are what a user reads when a named implementation
declines, so they name the argument and the limit it breaks.
"""

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from ops import _backend
from ops import _measured

Call = Mapping[str, Any]
# A name, a sequence of names tried in order, or None (the measured choice).
Choice = str | Sequence[str] | None


def on_nvidia_gpu() -> bool:
  """Whether this library's kernels compile here: the default device is an
  NVIDIA GPU (elsewhere they run in Pallas interpret mode)."""
  return _backend.on_nvidia_gpu()


def always(call: Call) -> None:
  """`supports` of an implementation that takes every valid call."""
  del call


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One way to compute an op.

  Attributes:
    name: what `implementation=` calls it.
    run: `run(**call)` computes the op on the validated call.
    supports: `supports(call)` is None when `run` takes the call, else the
      reason it does not (a sentence naming the argument and the limit).
    kernel: this library's Pallas kernel: compiled on NVIDIA GPUs, interpret
      mode elsewhere, chosen by default only where measured.
    config: the dataclass of its tuned configuration, or None.
    table: the dispatch table that times it (None: the registry's).
    measured_as: its name in that table (None: `name`).
    measured_range: for the default only: None when the call lies where the
      dispatch data timed this implementation, else why not (the default
      then leaves it out; asked for by name, it still runs).
  """
  name: str
  run: Callable[..., Any]
  supports: Callable[[Call], str | None] = always
  kernel: bool = False
  config: type | None = None
  table: str | None = None
  measured_as: str | None = None
  measured_range: Callable[[Call], str | None] = always

  @property
  def timed_name(self) -> str:
    return self.measured_as or self.name


class Registry:
  """The implementations of one op, and the rule that chooses among them.

  Args:
    op: the op's public name, for messages.
    table: its dispatch table's name (`ops/dispatch_tables/<table>.json`), or
      None when nothing is measured for it.
    established: the names the default falls back to, in order, where no
      measurement decides; the last must support every valid call.
  """

  def __init__(self, op: str, *, table: str | None = None,
               established: Sequence[str] = ("xla",)):
    self.op = op
    self.table = table
    self.established = tuple(established)
    self._implementations: dict[str, Implementation] = {}
    self._aliases: dict[str, tuple[str, ...]] = {}

  def register(self, name: str, run: Callable[..., Any], **fields) -> Implementation:
    """Adds implementation `name` (fields as `Implementation`'s) and returns it."""
    if name in self._implementations or name in self._aliases:
      raise ValueError(f"{self.op}: implementation {name!r} is registered twice")
    implementation = Implementation(name, run, **fields)
    self._implementations[name] = implementation
    return implementation

  def alias(self, name: str, names: Sequence[str]) -> None:
    """`implementation=name` stands for `names`, tried in order."""
    self._aliases[name] = tuple(names)

  def __getitem__(self, name: str) -> Implementation:
    return self._implementations[name]

  @property
  def implementations(self) -> tuple[Implementation, ...]:
    """The registered implementations, in order (aliases not included)."""
    return tuple(self._implementations.values())

  @property
  def names(self) -> tuple[str, ...]:
    """Every name `implementation=` takes, aliases last."""
    return tuple(self._implementations) + tuple(self._aliases)

  def check(self, implementation: Choice, name: str = "implementation") -> None:
    """A ValueError naming `name` unless `implementation` is None, one of
    `names` or a non-empty sequence of them (for a model to check up front)."""
    if implementation is not None:
      self._expand(implementation, name)

  def _expand(self, implementation: Choice, name: str = "implementation") -> tuple[str, ...]:
    """The names `implementation` asks for, in order (a ValueError naming
    the argument when it is not a name, an alias or a sequence of them)."""
    asked = (implementation,) if isinstance(implementation, str) else implementation
    valid = isinstance(asked, (tuple, list)) and asked and all(
        isinstance(n, str) and n in self.names for n in asked)
    if not valid:
      raise ValueError(f"{self.op}: `{name}` must be None, one of {self.names} or a "
                       f"sequence of them, got {implementation!r}")
    expanded = []
    for name in asked:
      for n in self._aliases.get(name, (name,)):
        if n not in expanded:
          expanded.append(n)
    return tuple(expanded)

  def choose(self, implementation: Choice, call: Call, **measured_at) -> Implementation:
    """The implementation that runs `call` (module docstring).

    Args:
      implementation: the user's choice (None, a name or a sequence of names).
      call: the op's validated arguments, as `run` and `supports` take them.
      **measured_at: the call's value for every key and axis of the dispatch
        table (`ops/_measured.py`; key_dim and length for ssd, say).
    """
    if implementation is not None:
      names = self._expand(implementation)
      reasons = {}
      for name in names:
        reasons[name] = self._implementations[name].supports(call)
        if reasons[name] is None:
          return self._implementations[name]
      distinct = set(reasons.values())
      why = distinct.pop() if len(distinct) == 1 else "; ".join(
          f"{name}: {reason}" for name, reason in reasons.items())
      raise ValueError(f"{self.op}(implementation={implementation!r}): {why}")
    on_gpu = on_nvidia_gpu()
    fits = [impl for impl in self._implementations.values()
            if (on_gpu or not impl.kernel) and impl.supports(call) is None
            and impl.measured_range(call) is None]
    established = [impl for name in self.established for impl in fits if impl.name == name]
    if on_gpu:
      chosen = self._measured_choice(fits, established, measured_at)
      if chosen is not None:
        return chosen
    if not established:  # e.g. a split sequence with what only one device can take
      raise ValueError(f"{self.op}: " + "; ".join(
          f"{name}: {self._implementations[name].supports(call)}" for name in self.established))
    return established[0]

  def _measured_choice(self, fits, established, measured_at) -> Implementation | None:
    """The fastest of `fits` where measured: an implementation timed in a
    table of its own first (against the established ones), then the op's."""
    peers = [impl.timed_name for impl in established]
    for impl in fits:
      if impl.table is not None and impl.table != self.table:
        if _measured.fastest(impl.table, (impl.timed_name, *peers)) == impl.timed_name:
          return impl
    if self.table is None:
      return None
    ours = [impl for impl in fits if impl.table in (None, self.table)]
    fastest = _measured.fastest(self.table, [impl.timed_name for impl in ours], **measured_at)
    return next((impl for impl in ours if impl.timed_name == fastest), None)


def xla_and_triton(op: str, *, xla: Callable[..., Any], triton: Callable[..., Any],
                   supports: Callable[[Call], str | None], config: type,
                   **triton_fields) -> Registry:
  """The registry of an op with an XLA tier and one Triton kernel path:
  'xla', 'triton' (timed as 'pallas' in the dispatch table named `op`) and
  'pallas', its alias. `triton_fields`: more of `Implementation`'s fields."""
  implementations = Registry(op, table=op)
  implementations.register("xla", xla)
  implementations.register("triton", triton, supports=supports, kernel=True, config=config,
                           measured_as="pallas", **triton_fields)
  implementations.alias("pallas", ("triton",))
  return implementations
