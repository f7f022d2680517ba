"""The argument checks the models, the functions and `fit()` share.

Each names the argument, the limit and the value it got, at construction (or
at the start of a call), before any parameter exists or anything is traced:
a TypeError for a value of the wrong kind (a float or a bool where a size
goes, a string where a number or a flag goes), a ValueError for one out of
range. Sizes may be Python or numpy integers; numbers may be Python, numpy or
concrete 0-d JAX scalars (a traced one is left to JAX: it cannot be compared
before it is run).
"""

import math
import numbers
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def check_positive_ints(**values) -> None:
  """Every value must be an integer >= 1."""
  for arg, value in values.items():
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
      raise TypeError(f"`{arg}` must be a positive integer, got {arg}={value!r}")
    if value < 1:
      raise ValueError(f"`{arg}` must be a positive integer, got {arg}={value!r}")


def check_positive_ints_or_none(**values) -> None:
  """Every value must be None (a default chosen later) or an integer >= 1."""
  check_positive_ints(**{arg: value for arg, value in values.items() if value is not None})


def check_bools(**values) -> None:
  """Every value must be a bool (a Python or numpy one): a string such as
  'False' would otherwise read as true."""
  for arg, value in values.items():
    if not isinstance(value, (bool, np.bool_)):
      raise TypeError(f"`{arg}` must be True or False, got {arg}={value!r}")


def check_choice(arg: str, value: Any, choices: Sequence[str | None]) -> None:
  """`value` must be one of `choices` (strings, and None where it is one)."""
  if not (value is None or isinstance(value, str)) or value not in choices:
    raise ValueError(f"`{arg}` must be one of {tuple(choices)}, got {arg}={value!r}")


def check_callables(**values) -> None:
  """Every value must be callable (a function, a module class, ...)."""
  for arg, value in values.items():
    if not callable(value):
      raise TypeError(f"`{arg}` must be callable, got {arg}={value!r}")


def check_callables_or_none(**values) -> None:
  """Every value must be None (a default chosen later) or callable."""
  check_callables(**{arg: value for arg, value in values.items() if value is not None})


def check_name(name: Any) -> None:
  """A module's `name` must be None or a string (Haiku checks that a string
  is an identifier, but fails on another type with an AttributeError)."""
  if name is not None and not isinstance(name, str):
    raise TypeError(f"`name` must be a string or None, got name={name!r}")


def _number(arg: str, value: Any, limit: str) -> float | None:
  """`value` as a float, None for a traced value; a TypeError naming `arg`
  and `limit` for anything but a real number."""
  if isinstance(value, jax.core.Tracer):
    return None
  is_scalar_array = (isinstance(value, (np.ndarray, jax.Array)) and value.shape == ()
                     and jnp.issubdtype(value.dtype, jnp.number)
                     and not jnp.issubdtype(value.dtype, jnp.complexfloating))
  if isinstance(value, (bool, np.bool_)) or not (isinstance(value, numbers.Real)
                                                 or is_scalar_array):
    raise TypeError(f"`{arg}` must be a number {limit}, got {arg}={value!r}")
  return float(value)


def _check_numbers(values: dict[str, Any], limit: str, fits: Callable[[float], bool]) -> None:
  for arg, value in values.items():
    number = _number(arg, value, limit)
    if number is not None and not fits(number):
      raise ValueError(f"`{arg}` must be a number {limit}, got {arg}={value!r}")


def check_finite_numbers_or_none(**values) -> None:
  """Every value must be None (a default chosen later) or a finite number."""
  _check_numbers({arg: value for arg, value in values.items() if value is not None},
                 "(finite)", math.isfinite)


def check_positive_numbers(**values) -> None:
  """Every value must be a finite number > 0."""
  _check_numbers(values, "> 0 (finite)", lambda x: 0 < x < math.inf)


def check_positive_numbers_or_none(**values) -> None:
  """Every value must be None (the feature off, or a default) or a finite
  number > 0."""
  check_positive_numbers(**{arg: value for arg, value in values.items() if value is not None})


def check_nonnegative_numbers(**values) -> None:
  """Every value must be a finite number >= 0."""
  _check_numbers(values, ">= 0 (finite)", lambda x: 0 <= x < math.inf)


def check_rates(**values) -> None:
  """Every value must be a number in [0, 1) (a dropout rate: 1 drops all)."""
  _check_numbers(values, "in [0, 1)", lambda x: 0 <= x < 1)


def check_key(**values) -> None:
  """Every value must be one JAX PRNG key: `jax.random.key(seed)` or a raw
  `jax.random.PRNGKey(seed)` (uint32 [2]); traced keys are checked by their
  shape and dtype."""
  for arg, value in values.items():
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    if not ((typed and shape == ()) or (dtype == jnp.uint32 and shape == (2,))):
      raise TypeError(f"`{arg}` must be a JAX PRNG key (jax.random.key(seed)), got "
                      f"{arg}={value!r}")
