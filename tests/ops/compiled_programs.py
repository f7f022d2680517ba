"""What the multi-device tests read in a compiled program's HLO text.

The sequence-parallel tests (`test_*_sequence_parallel.py`) import it in
their simulated-device scripts: which arrays a program communicates, and
the longest axis any of its arrays has (a sequence assembled on one device
shows as an axis of length T).
"""

import re

import jax
import numpy as np

_COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-reduce|reduce-scatter|collective-permute"
                         r"|all-to-all)(-start)?\(")


def shapes(text: str) -> list[list[int]]:
  """Every array shape written in an HLO text."""
  return [[int(d) for d in dims.split(",") if d]
          for dims in re.findall(r"\b(?:pred|[subfc]\d+)\[([\d,]*)\]", text)]


def collectives(text: str) -> list[list[int]]:
  """The result shapes of every collective of a compiled program."""
  found = []
  for line in text.splitlines():
    m = _COLLECTIVE.search(line)
    if m:
      found += shapes(m.group(1))
  return found


def collective_kinds(text: str) -> list[str]:
  """The kind of every collective of a compiled program that moves an array
  (a scalar's, such as a loss summed over devices, left out)."""
  return [m.group(2) for m in map(_COLLECTIVE.search, text.splitlines())
          if m and any(shapes(m.group(1)))]


def longest_axis(text: str) -> int:
  """The longest dimension of any array in an HLO text."""
  return max(max(s, default=0) for s in shapes(text))


def compile_and_run(mesh, forward, grad, args) -> tuple:
  """Compiles `jax.jit(forward)` and `grad` (jitted) for `args` under `mesh`
  and runs them. Returns ((forward's outputs, grad's), facts): facts holds
  the collectives of both programs, their longest axis, and how many
  all-gathers the forward has."""
  with jax.set_mesh(mesh):
    forward = jax.jit(forward).lower(*args).compile()
    backward = grad.lower(*args).compile()
    got = (forward(*args), backward(*args))
  texts = forward.as_text() + backward.as_text()
  return got, {"collectives": collectives(texts), "longest_axis": longest_axis(texts),
               "forward_gathers": len(re.findall(r" all-gather(?:-start)?\(", forward.as_text()))}


def traced_error(mesh, fn, *args) -> str:
  """The ValueError message of tracing `jax.jit(fn)(*args)` under `mesh`, or "no error"."""
  try:
    with jax.set_mesh(mesh):
      jax.jit(fn).trace(*args)
    return "no error"
  except ValueError as e:
    return str(e)


def max_err(got, want) -> float:
  """The largest error over the leaves of two pytrees, relative to 1 + max |want|."""
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             / (1.0 + float(np.max(np.abs(np.asarray(y)))))
             for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def record_shapes(module, function: str, argument: str) -> list[list[int]]:
  """Replaces `module.function` by a wrapper that records the shape of its
  keyword `argument` at every trace; returns the (growing) list of shapes."""
  seen, real = [], getattr(module, function)

  def spy(**call):
    seen.append(list(call[argument].shape))
    return real(**call)

  setattr(module, function, spy)
  return seen
