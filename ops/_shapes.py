"""Shape helpers shared by the ops: padding to block multiples, and the input
checks of their api.py files (errors that name the argument and the limit)."""

import jax.numpy as jnp
import numpy as np


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(a: int, multiple: int) -> int:
  return cdiv(a, multiple) * multiple


def pad_axis(x: jnp.ndarray, axis: int, multiple: int, value=0, *,
             at_start: bool = False) -> jnp.ndarray:
  """Pads `x` at the end (or the start) of `axis` to a multiple of `multiple`."""
  size = x.shape[axis]
  extra = round_up(size, multiple) - size
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (extra, 0) if at_start else (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def time_chunk(batch: int, time: int, width: int, block_d: int, unroll: int,
               programs: int, max_chunks: int) -> int:
  """The chunk (a multiple of `unroll`) of a time-blocked scan that splits
  each of its `batch * width / block_d` serial chains into enough chunks for
  about `programs` programs, and into at most `max_chunks`."""
  chains = batch * cdiv(width, block_d)
  num_chunks = min(max_chunks, max(1, cdiv(programs, chains)))
  return round_up(cdiv(time, num_chunks), unroll)


def check_time_blocks(blocks) -> None:
  """Checks a time-blocked scan kernel's block config (`block_d`, `unroll`,
  `num_warps` powers of two; `num_stages` >= 1; `chunk` a positive multiple
  of `unroll`)."""
  for name in ("block_d", "unroll", "num_warps"):
    value = getattr(blocks, name)
    if value < 1 or value & (value - 1):
      raise ValueError(f"`{name}` must be a power of two, got {value}")
  if blocks.num_stages < 1:
    raise ValueError(f"`num_stages` must be at least 1, got {blocks.num_stages}")
  if blocks.chunk < 1 or blocks.chunk % blocks.unroll:
    raise ValueError(f"`chunk` must be a positive multiple of {blocks.unroll=}, "
                     f"got {blocks.chunk}")


def _where(op: str | None) -> str:
  return f"{op}: " if op else ""


def check_arrays(op: str | None, named) -> None:
  """TypeError naming the first `(name, x)` whose `x` is not an array (JAX,
  numpy or a tracer); None entries (optional arguments) are skipped."""
  for name, x in named:
    if x is not None and not (hasattr(x, "shape") and hasattr(x, "dtype")):
      raise TypeError(f"{_where(op)}`{name}` must be an array, got "
                      f"{type(x).__name__}")


def check_inexact(op: str | None, named) -> None:
  """ValueError naming the first `(name, x)` whose dtype is not a float or
  complex type (integers and bools would be truncated or refused deep inside);
  None entries are skipped."""
  for name, x in named:
    if x is not None and not jnp.issubdtype(x.dtype, jnp.inexact):
      raise ValueError(f"{_where(op)}`{name}` must be a float (or complex) array, "
                       f"got {x.dtype}")


def check_bool(op: str | None, name: str, value) -> None:
  """TypeError unless `value` is a Python (or numpy) bool: a static option,
  where a string such as 'no' would otherwise count as True."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{_where(op)}`{name}` must be a bool, got {value!r}")


def check_time(op: str | None, name: str, shape, axis: int = 1) -> None:
  """ValueError unless `shape[axis]` (the time axis) holds at least one step."""
  if shape[axis] < 1:
    raise ValueError(f"{_where(op)}`{name}` needs T >= 1 time steps on axis "
                     f"{axis}, got shape {tuple(shape)}")


def check_chunk_size(op: str | None, chunk_size) -> None:
  """ValueError unless `chunk_size` is None or a positive Python int (not a bool)."""
  if chunk_size is not None and (not isinstance(chunk_size, int)
                                 or isinstance(chunk_size, bool) or chunk_size < 1):
    raise ValueError(f"{_where(op)}`chunk_size` must be a positive int, "
                     f"got {chunk_size!r}")
