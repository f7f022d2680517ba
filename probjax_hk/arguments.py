"""The constructor argument checks the models share.

Each names the argument and its value, at construction, before any parameter
exists: a TypeError for a value of the wrong kind (a float or a bool where a
size goes), a ValueError for one out of range. Sizes may be Python or numpy
integers.
"""

import numbers


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


def check_positive_or_none(**values) -> None:
  """Every value must be None (a default chosen later) or > 0."""
  for arg, value in values.items():
    if value is not None and value <= 0:
      raise ValueError(f"`{arg}` must be positive, got {arg}={value!r}")
