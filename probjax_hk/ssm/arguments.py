"""The constructor argument checks the SSM cells and model share.

Each raises a ValueError naming the argument and its value, at construction,
before any parameter exists.
"""


def check_positive_ints(**values) -> None:
  """Every value must be an int >= 1."""
  for arg, value in values.items():
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"`{arg}` must be a positive integer, got {arg}={value!r}")


def check_positive_or_none(**values) -> None:
  """Every value must be None (a default chosen later) or > 0."""
  for arg, value in values.items():
    if value is not None and value <= 0:
      raise ValueError(f"`{arg}` must be positive, got {arg}={value!r}")
