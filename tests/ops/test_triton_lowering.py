"""Every Pallas kernel lowers to Triton for a Hopper GPU, checked on the CPU.

Interpret mode checks the kernels' numerics but not that they lower: block
shapes, dtypes and ops that Triton refuses only show up when the kernel is
lowered for CUDA. This lowers the forward and the gradient of each op with
interpret mode off, for `cuda` at compute capability 9.0, without a GPU. It
does not run ptxas (register allocation), so a GPU run is still the final
word; it catches the errors that would make `implementation=None` fail on a
GPU before a GPU ever sees them.
"""

import jax
import jax.numpy as jnp
import pytest

import ops

# Every test here lowers for a Hopper GPU without one (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("hopper_lowering")


def _spec(shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _sum_outputs(fn):
  """A scalar of every floating output, so jax.grad reaches every kernel."""
  def loss(*args):
    leaves = jax.tree.leaves(fn(*args))
    return sum(jnp.sum(jnp.abs(x).astype(jnp.float32)) for x in leaves
               if jnp.issubdtype(x.dtype, jnp.inexact))
  return loss


B, T, N, H = 2, 256, 4, 64
f32 = jnp.float32

CASES = {
    "flex_attention_causal": (
        lambda q, k, v: ops.flex_attention(q, k, v, is_causal=True, implementation="pallas"),
        (_spec((B, T, N, H)), _spec((B, T, 2, H)), _spec((B, T, 2, H)))),
    "flex_attention_window_h32": (
        lambda q, k, v: ops.flex_attention(q, k, v, local_window_size=(64, 0),
                                           implementation="pallas"),
        (_spec((B, T, N, 32)), _spec((B, T, N, 32)), _spec((B, T, N, 32)))),
    "flex_attention_h80_f32_cross": (
        lambda q, k, v: ops.flex_attention(q, k, v, implementation="pallas"),
        (_spec((B, 100, N, 80), f32), _spec((B, 300, N, 80), f32), _spec((B, 300, N, 80), f32))),
    "grouped_matmul": (
        lambda x, w: ops.grouped_matmul(x, w, jnp.array([100, 0, 300, 112], jnp.int32),
                                        implementation="pallas"),
        (_spec((512, 256)), _spec((4, 256, 384)))),
    "grouped_mlp_gelu_f32_weights": (
        lambda x, w1, w2: ops.grouped_mlp(x, w1, w2, jnp.array([100, 0, 300, 112], jnp.int32),
                                          implementation="pallas"),
        (_spec((512, 256)), _spec((4, 256, 384), f32), _spec((4, 384, 256), f32))),
    "grouped_mlp_swiglu": (
        lambda x, w1, w2: ops.grouped_mlp(x, w1, w2, jnp.array([100, 0, 300, 112], jnp.int32),
                                          activation="swiglu", implementation="pallas"),
        (_spec((512, 200)), _spec((4, 200, 640)), _spec((4, 320, 136)))),
    "linear_scan_complex": (
        lambda a, b: ops.linear_scan(a, b, implementation="pallas"),
        (_spec((B, T, 128), jnp.complex64), _spec((B, T, 128), jnp.complex64))),
    "linear_scan_shared_decay": (
        lambda a, b: ops.linear_scan(a, b, implementation="pallas"),
        (_spec((128,), jnp.complex64), _spec((B, T, 128), jnp.complex64))),
    "selective_scan": (
        lambda u, dt, a, b, c: ops.selective_scan(u, dt, a, b, c, delta_softplus=True,
                                                  implementation="pallas"),
        (_spec((B, T, 128), f32), _spec((B, T, 128), f32), _spec((128, 16), f32),
         _spec((B, T, 16), f32), _spec((B, T, 16), f32))),
    "ssd": (
        lambda q, k, v, g: ops.ssd(q, k, v, g, implementation="pallas"),
        (_spec((B, T, N, H)), _spec((B, T, N, H)), _spec((B, T, N, H)), _spec((B, T, N), f32))),
    "gated_delta_rule": (
        lambda q, k, v, g, beta: ops.gated_delta_rule(q, k, v, g, beta, implementation="pallas"),
        (_spec((B, T, N, H)), _spec((B, T, N, H)), _spec((B, T, N, H)), _spec((B, T, N), f32),
         _spec((B, T, N), f32))),
    "gated_delta_rule_k256": (
        lambda q, k, v, g, beta: ops.gated_delta_rule(q, k, v, g, beta, implementation="pallas"),
        (_spec((1, 64, 2, 256)), _spec((1, 64, 2, 256)), _spec((1, 64, 2, 256)),
         _spec((1, 64, 2), f32), _spec((1, 64, 2), f32))),
    # Packed sequences: the walks read the offsets' per-chunk entries.
    "ssd_packed": (
        lambda q, k, v, g, h0, cu: ops.ssd(q, k, v, g, initial_state=h0, cu_seqlens=cu,
                                           implementation="pallas"),
        (_spec((1, T, N, H)), _spec((1, T, N, H)), _spec((1, T, N, H)), _spec((1, T, N), f32),
         _spec((3, N, H, H), f32), _spec((4,), jnp.int32))),
    "gated_delta_rule_packed": (
        lambda q, k, v, g, beta, h0, cu: ops.gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, implementation="pallas"),
        (_spec((1, T, N, H)), _spec((1, T, N, H)), _spec((1, T, N, H)), _spec((1, T, N), f32),
         _spec((1, T, N), f32), _spec((3, N, H, H), f32), _spec((4,), jnp.int32))),
}


@pytest.mark.parametrize("mode", ["forward", "gradient"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_lowers_to_triton_for_hopper(case, mode):
  fn, specs = CASES[case]
  if mode == "gradient":
    fn = jax.grad(_sum_outputs(fn), argnums=tuple(
        i for i, s in enumerate(specs) if jnp.issubdtype(s.dtype, jnp.inexact)))
  text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
  # The kernels are there as Triton custom calls (interpret mode would leave
  # plain HLO loops and no such call).
  assert "__gpu$xla.gpu.triton" in text
