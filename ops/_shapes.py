"""Shape helpers shared by the kernels: padding to block multiples."""

import jax.numpy as jnp


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
