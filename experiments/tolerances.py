"""How close each op must come to its float32 reference: the tests' bounds.

One table per op, used by the op's tests (tests/ops/) and by `gpu_check`,
which holds the kernels to the same bounds on a GPU. Each table is keyed by
the inputs' dtype and looked up with any dtype-like value (`jnp.bfloat16`,
`"bfloat16"`, a NumPy dtype). Two error measures, as the tests use them:

* `relative_l2`: |got - want| / |want| in the L2 norm (attention, where a
  row's outputs are averages of comparable size);
* `max_error`: max |got - want| / max(1, max |want|) (the recurrences and the
  grouped matmuls, whose outputs grow with T or K).

On a GPU, float32 matmuls run as TF32 (a 10-bit significand), so the
float32 bounds of the ops built on matmuls, set on the CPU, hold there only
for the 16-bit entries; `gpu_check` checks those ops with 16-bit inputs.
"""

import dataclasses
from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np


class ByDtype(dict):
  """Bounds keyed by dtype name, looked up by any dtype-like key."""

  def __getitem__(self, dtype):
    return super().__getitem__(jnp.dtype(dtype).name)

  def __contains__(self, dtype):
    return super().__contains__(jnp.dtype(dtype).name)


def relative_l2(got, want) -> float:
  """|got - want| / |want| (L2 norms, float32; complex values as they are)."""
  got, want = np.asarray(got), np.asarray(want)
  real = not (np.iscomplexobj(got) or np.iscomplexobj(want))
  got, want = (got.astype(np.float32), want.astype(np.float32)) if real else (got, want)
  return float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-30))


def max_error(got, want) -> float:
  """max |got - want| / max(1, max |want|); NaN where `got` is not finite."""
  got, want = np.asarray(got), np.asarray(want)
  if not (np.iscomplexobj(got) or np.iscomplexobj(want)):
    got, want = got.astype(np.float32), want.astype(np.float32)
  if not np.isfinite(got).all():
    return float("nan")
  return float(np.abs(got - want).max(initial=0.0) / max(1.0, float(np.abs(want).max(initial=0.0))))


# Relative L2, the same bound for the output and the gradients. The reference
# runs in float32 on the same (upcast) inputs.
FLEX_ATTENTION = ByDtype(float32=2e-5, bfloat16=2.5e-2, float16=5e-3)
# The kernel's probabilities meet V in V's dtype.
DECODE_ATTENTION = ByDtype(float32=2e-5, bfloat16=2e-2, float16=3e-3)
# Max error, (forward, gradients).
SSD = ByDtype(float32=(2e-5, 1e-4), bfloat16=(3e-2, 5e-2))
# d log_decay sums q.dq - k.dk over a chunk's suffix: cancellation, so bf16 gets more.
SSD_LOG_DECAY_GRAD = ByDtype(float32=1e-4, bfloat16=1e-1)
GATED_DELTA_RULE = ByDtype(float32=(2e-5, 2e-4), bfloat16=(3e-2, 6e-2))
SELECTIVE_SCAN = ByDtype(float32=(1e-5, 1e-4), bfloat16=(3e-2, 6e-2))
LINEAR_SCAN = ByDtype(float32=(1e-5, 1e-4), complex64=(1e-5, 1e-4), bfloat16=(2e-2, 5e-2))
# Max error, the output and the gradients alike; the grouped MLP's by its
# input's dtype (its weights may be float32).
GROUPED_MATMUL = ByDtype(float32=1e-5, bfloat16=2e-2)
GROUPED_MLP = ByDtype(float32=1e-5, bfloat16=3e-2)


@dataclasses.dataclass(frozen=True)
class Bounds:
  """One op's check: its error measure and its bounds by dtype."""
  metric: Callable[[object, object], float]
  table: ByDtype           # a bound, or a (forward, gradients) pair, per dtype
  gradient_overrides: Mapping[str, ByDtype] = dataclasses.field(default_factory=dict)

  def bound(self, dtype, gradient: str | None = None) -> float:
    """The bound of the outputs (`gradient` None) or of the gradient with
    respect to the input named `gradient`, for inputs of `dtype`."""
    if gradient is not None and gradient in self.gradient_overrides:
      return self.gradient_overrides[gradient][dtype]
    entry = self.table[dtype]
    if isinstance(entry, tuple):
      return entry[0 if gradient is None else 1]
    return entry

  def over(self, dtype, outputs: Mapping[str, float],
           gradients: Mapping[str, float]) -> list[str]:
    """`name error > bound` for each error over its bound (NaN is over every
    bound): `outputs` by output name, `gradients` by the name of the input
    they are the gradient of (reported as 'd' + name)."""
    named = [(name, error, self.bound(dtype)) for name, error in outputs.items()]
    named += [(f"d{name}", error, self.bound(dtype, name)) for name, error in gradients.items()]
    return [f"{name} {error:.3g} > {bound:.3g}" for name, error, bound in named
            if not error <= bound]


OPS = {
    "flex_attention": Bounds(relative_l2, FLEX_ATTENTION),
    "decode_attention": Bounds(relative_l2, DECODE_ATTENTION),
    "ssd": Bounds(max_error, SSD, {"log_decay": SSD_LOG_DECAY_GRAD}),
    "gated_delta_rule": Bounds(max_error, GATED_DELTA_RULE),
    "selective_scan": Bounds(max_error, SELECTIVE_SCAN),
    "linear_scan": Bounds(max_error, LINEAR_SCAN),
    "grouped_matmul": Bounds(max_error, GROUPED_MATMUL),
    "grouped_mlp": Bounds(max_error, GROUPED_MLP),
}
