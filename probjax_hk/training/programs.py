"""Compiled programs shared by what they compute, not by who built them.

`jax.jit` keeps its executables per function object, so `fit()` called again
with an optimizer written inline (`optax.adam(1e-2)`), a loss function
defined again or a new `hk.transform` of the same model would compile its
step again, although the program is the same. A `Program` wraps one jitted
function; the first time it meets an argument signature it traces the
function (no compile: tens of milliseconds for a small model, under a second
for a Transformer, against seconds to compile it), reduces the trace to a
key that holds everything the compiled program depends on, and takes the
executable from a process-wide cache when another `Program` already compiled
that key. Later calls with that signature go straight to the executable.

The key (`program_key`) is the traced jaxpr, its variables numbered in
order, with

- every literal and closed-over array by value (a blake2b digest of its
  bytes), so that a loss closing over other values compiles again; a
  `jax.Array` over `MAX_HASHED_BYTES` (or not fully addressable) by
  identity, the key holding a reference so that the id is never reused;
- every parameter of every equation: nested jaxprs recursively, floats by
  their exact bits, containers and dataclasses field by field, other
  hashable objects by their own equality, anything else (a host callback's
  function) by identity. The rules of an undifferentiated `custom_jvp` /
  `custom_vjp` call are left out: it lowers its `call_jaxpr` alone;
- each equation's effects and context (compute type, metadata, mesh);
- the jit's options (out shardings, donation), the arguments' tree, types
  and shardings, the static arguments, the mesh, and JAX's trace context
  (the configuration options that enter a jit's cache key, the default
  matmul precision among them).

So an optimizer's hyperparameters (Python floats, literals in the jaxpr), a
model's widths (shapes) and the choice of optimizer (its equations) all
change the key, and only a program equal in all of these is reused.
"""

import collections
import dataclasses
import hashlib
import time
from typing import Any, Callable, Sequence

import jax
from jax._src import config as jax_config
from jax.extend import core as jex_core
import numpy as np

# Compiled executables kept process-wide (least recently used dropped first).
CACHE_SIZE = 32
# Executables one Program keeps, by argument signature (a fit uses one or two).
SIGNATURES_PER_PROGRAM = 8
# Closed-over jax.Arrays larger than this are keyed by identity (immutable)
# rather than read back and hashed on every trace.
MAX_HASHED_BYTES = 16 * 2**20
# Primitives lowered from their `call_jaxpr` alone: their other parameters
# (differentiation rules, fresh callables on every trace) never reach the
# compiled program.
_CALL_JAXPR_ONLY = ("custom_jvp_call", "custom_vjp_call")

_executables: collections.OrderedDict = collections.OrderedDict()
_stats = collections.Counter()


def stats() -> dict[str, float]:
  """Totals since the process started: `traces` (signatures traced) and
  `trace_s` (their seconds, keys included), `compiles` (executables built)
  and `compile_s` (lowering and compiling), `shared` (traces whose
  executable another Program had compiled)."""
  return dict(_stats)


def clear() -> None:
  """Drops every cached executable (Programs keep the ones they hold)."""
  _executables.clear()


def _value_key(x, keep: list):
  """An array or scalar by value (dtype, shape, digest of its bytes)."""
  if isinstance(x, jax.Array) and (x.nbytes > MAX_HASHED_BYTES
                                   or not x.is_fully_addressable):
    keep.append(x)
    return ("array-id", id(x), x.aval)
  a = np.asarray(x)
  digest = hashlib.blake2b(np.ascontiguousarray(a).tobytes(),
                           digest_size=16).digest()
  return ("value", type(x).__name__, a.dtype.str, a.shape, digest)


class _Encoder:
  """Reduces jaxprs to hashable keys (see the module docstring)."""

  def __init__(self):
    self.keep = []  # objects keyed by identity: kept alive with the key
    self.memo = {}  # id(jaxpr) -> key (a sub-jaxpr is often shared)

  def jaxpr(self, jaxpr) -> tuple:
    if id(jaxpr) in self.memo:
      return self.memo[id(jaxpr)]
    names = {}

    def bind(v):
      if isinstance(v, jex_core.DropVar):
        return ("drop", self.param(v.aval))
      names[v] = len(names)
      return self.param(v.aval)

    def read(v):
      if isinstance(v, jex_core.Literal):
        return ("literal", self.param(v.aval), _value_key(v.val, self.keep))
      return names[v]

    constvars = tuple(bind(v) for v in jaxpr.constvars)
    invars = tuple(bind(v) for v in jaxpr.invars)
    eqns = []
    for eqn in jaxpr.eqns:
      params = eqn.params
      if eqn.primitive.name in _CALL_JAXPR_ONLY:
        params = {"call_jaxpr": params["call_jaxpr"]}
      eqns.append((
          eqn.primitive, tuple(read(v) for v in eqn.invars),
          tuple((k, self.param(v)) for k, v in sorted(params.items())),
          self.param(eqn.effects), self.param(eqn.ctx),
          tuple(bind(v) for v in eqn.outvars)))
    key = ("jaxpr", constvars, invars, tuple(eqns),
           tuple(read(v) for v in jaxpr.outvars), self.param(jaxpr.effects))
    self.memo[id(jaxpr)] = key  # every jaxpr lives as long as the trace
    return key

  def param(self, x):
    """A parameter (or aval, effect, context) as a hashable key."""
    if isinstance(x, jex_core.ClosedJaxpr):
      return ("closed", self.jaxpr(x.jaxpr),
              tuple(_value_key(c, self.keep) for c in x.consts))
    if isinstance(x, jex_core.Jaxpr):
      return self.jaxpr(x)
    if isinstance(x, (bool, int, str, bytes)) or x is None:
      return (type(x), x)  # True == 1 == 1.0 as dict keys
    if isinstance(x, float):
      return (type(x), float(x).hex())  # 0.0 and -0.0 differ
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
      return _value_key(x, self.keep)
    if isinstance(x, (tuple, list)):
      return (type(x), tuple(self.param(v) for v in x))
    if isinstance(x, (set, frozenset)):  # effects
      return (frozenset, frozenset(self.param(v) for v in x))
    if isinstance(x, dict):
      return (type(x), tuple((self.param(k), self.param(v))
                             for k, v in x.items()))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
      return (type(x), tuple(self.param(getattr(x, f.name))
                             for f in dataclasses.fields(x)))
    try:
      hash(x)
    except TypeError:
      self.keep.append(x)
      return ("id", id(x))
    return (type(x), x)  # its own equality (identity unless it defines one)


def signature(args, static_argnums: Sequence[int]) -> tuple:
  """The arguments' tree, each leaf's type and committed sharding, and the
  static arguments' values: what selects an executable for `args`."""
  static = tuple(args[i] for i in static_argnums)
  dynamic = [a for i, a in enumerate(args) if i not in static_argnums]
  leaves, treedef = jax.tree.flatten(dynamic)

  def leaf(x):
    committed = isinstance(x, jax.Array) and x.committed
    return (jax.typeof(x), x.sharding if committed else None)
  return (treedef, tuple(leaf(x) for x in leaves), static)


def program_key(traced: jax.stages.Traced, *context) -> tuple:
  """Everything the program compiled from `traced` depends on, with
  `context` (hashables: the jit's options, the arguments' signature, the
  mesh); also the objects the key names by identity, to keep alive with it.

  Returns:
    (key, kept objects).
  """
  encoder = _Encoder()
  key = (encoder.param(traced.jaxpr),
         # Constants lifted out of the jaxpr, passed by the executable.
         tuple(_value_key(c, encoder.keep) for c in traced._consts),  # pylint: disable=protected-access
         traced.out_tree, encoder.param(context), jax_config.trace_context())
  return key, encoder.keep


class Program:
  """A jitted function whose executables are shared by every Program whose
  trace has the same `program_key`.

  Tracing and compiling run under `jax.set_mesh(mesh)` (the ops inside see
  the mesh and run their kernels per shard); a call runs the executable
  compiled for its arguments' signature. The first call with a signature
  traces; later ones cost what a `jax.jit` call does (the executable's own
  dispatch; a call whose arguments no longer fit it finds or builds the
  right one).

  Args:
    fn: the function.
    mesh: the mesh it is traced and compiled under.
    static_argnums: as in `jax.jit`.
    **jit_kwargs: `jax.jit`'s other options (out_shardings, donate_argnums).
  """

  def __init__(self, fn: Callable[..., Any], mesh: jax.sharding.Mesh, *,
               static_argnums: Sequence[int] = (), **jit_kwargs):
    self.jitted = jax.jit(fn, static_argnums=static_argnums, **jit_kwargs)
    self.mesh = mesh
    self._options = (tuple(static_argnums), jit_kwargs)
    self._static = tuple(static_argnums)
    self._by_signature = {}  # signature -> executable
    self._last = None  # (static argument values, signature, executable)

  def _dynamic(self, args):
    if not self._static:
      return args
    return tuple(a for i, a in enumerate(args) if i not in self._static)

  def __call__(self, *args):
    last = self._last
    if last is not None and (not self._static or last[0] == tuple(
        args[i] for i in self._static)):
      try:
        return last[2](*self._dynamic(args))
      except (TypeError, ValueError):
        # An executable checks its arguments before it runs (nothing is
        # donated): another signature finds its own; the same one re-raises.
        if signature(args, self._static) == last[1]:
          raise
    sig = signature(args, self._static)
    executable = self._by_signature.get(sig)
    if executable is None:
      if len(self._by_signature) >= SIGNATURES_PER_PROGRAM:
        self._by_signature.clear()
      executable = self._by_signature[sig] = self._executable(args, sig)
    self._last = (sig[2], sig, executable)
    return executable(*self._dynamic(args))

  def _executable(self, args, sig):
    start = time.perf_counter()
    with jax.set_mesh(self.mesh):
      traced = self.jitted.trace(*args)
      key, kept = program_key(traced, self._options, sig, self.mesh)
      entry = _executables.get(key)
      _stats["traces"] += 1
      _stats["trace_s"] += time.perf_counter() - start
      if entry is not None:
        _executables.move_to_end(key)
        _stats["shared"] += 1
        return entry[0]
      start = time.perf_counter()
      executable = traced.lower().compile()
    _stats["compiles"] += 1
    _stats["compile_s"] += time.perf_counter() - start
    _executables[key] = (executable, kept)
    while len(_executables) > CACHE_SIZE:
      _executables.popitem(last=False)
    return executable

  def lower(self, *args):
    """`jax.jit(fn).lower(*args)` under the mesh (for inspecting the HLO)."""
    with jax.set_mesh(self.mesh):
      return self.jitted.lower(*args)
