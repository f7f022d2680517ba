"""ops.gated_delta_rule's Mosaic GPU state walks (mosaic.py): against float64
walks and the Triton kernels in Mosaic GPU interpret mode, inside the op
(forward and every gradient against the reference), its lowering for Hopper,
and its limits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.gated_delta_rule import configs as gdr_configs
from ops.gated_delta_rule import gated_delta_rule_reference
from ops.gated_delta_rule import mosaic
from ops.gated_delta_rule import pallas as gdr_pallas
from ops.gated_delta_rule import triton as gdr_triton
from tests.ops.outputs_and_grads import outputs_and_grads
from tests.ops.outputs_and_grads import sin_loss

_SIZE = 128  # the walk's K = V


def _normal(rng, *shape):
  return rng.standard_normal(shape, np.float32)


def _bf16(x):
  return jnp.asarray(x.astype(jnp.bfloat16))


def _walk_inputs(batch, time, heads, groups, chunk, seed=0):
  """k, w, u_tilde (bf16), b and h0 (float32), drawn with NumPy (an eager
  `jax.random` call compiles a program per shape)."""
  rng = np.random.default_rng(seed)
  k = _normal(rng, batch, time, groups, _SIZE) / np.sqrt(_SIZE)
  w = _normal(rng, batch, time, heads, _SIZE) / np.sqrt(_SIZE)
  u_tilde = _normal(rng, batch, time, heads, _SIZE)
  log_decay = -0.2 * rng.uniform(size=(batch, heads, time // chunk, chunk))
  b = np.cumsum(log_decay, axis=-1).reshape(batch, heads, time).astype(np.float32)
  h0 = _normal(rng, batch, heads, _SIZE, _SIZE)
  return _bf16(k), _bf16(w), _bf16(u_tilde), jnp.asarray(b), jnp.asarray(h0)


def _triton_walk_blocks(chunk):
  """The Triton walks on whole [K, V] states, the yardstick of the Mosaic ones."""
  return gdr_configs.TritonConfig(chunk=chunk, block_v=_SIZE, state_block_v=_SIZE,
                                  grad_block_k=_SIZE, mosaic_walk=False)


def _assert_as_close_as_triton(names, walk, want, triton):
  """Each Mosaic output is within 2 x the Triton walk's error of the float64
  walk (or 1e-3), relative to max(1, max |float64|)."""
  for name, got, ref, other in zip(names, walk, want, triton):
    assert got.shape == ref.shape, name
    scale = max(1.0, np.abs(ref).max())
    err = np.abs(np.asarray(got, np.float64) - ref).max() / scale
    triton_err = np.abs(np.asarray(other, np.float64) - ref).max() / scale
    assert err < max(2 * triton_err, 1e-3), (name, err, triton_err)


def _scores_float64(q, k, b, chunk):
  """Each chunk's decayed causal scores S [B, N, C, L, L] in float64."""
  q, k, b = (np.asarray(x, np.float64) for x in (q, k, b))
  batch, time, groups = q.shape[:3]
  heads = b.shape[1]
  shape = (batch, time // chunk, chunk, groups, -1)
  qc, kc = q.reshape(shape), k.reshape(shape)
  qk = np.einsum("bcigd,bcjgd->bgcij", qc, kc)
  qk = np.repeat(qk, heads // groups, axis=1)
  bc = b.reshape(batch, heads, time // chunk, chunk)
  gap = bc[..., :, None] - bc[..., None, :]
  causal = np.tril(np.ones((chunk, chunk), bool))
  return np.where(causal, qk * np.exp(np.where(causal, gap, 0.0)), 0.0)


def _walk_float64(q, k, w, u_tilde, b, h0, chunk, scale):
  """The walk and its output in numpy float64, on the same (rounded) inputs."""
  scores = _scores_float64(q, k, b, chunk)
  q, k, w, u_tilde, b, h = (np.asarray(x, np.float64) for x in (q, k, w, u_tilde, b, h0))
  batch, time, heads = u_tilde.shape[:3]
  rep = heads // k.shape[2]
  states, u_all, y = [], np.zeros(u_tilde.shape), np.zeros(u_tilde.shape)
  for c in range(time // chunk):
    rows = slice(c * chunk, (c + 1) * chunk)
    states.append(h.copy())
    for i in range(batch):
      for n in range(heads):
        u = u_tilde[i, rows, n] - w[i, rows, n] @ h[i, n]
        u_all[i, rows, n] = u
        b_c = b[i, n, rows]
        y[i, rows, n] = scale * (np.exp(b_c)[:, None] * (q[i, rows, n // rep] @ h[i, n])
                                 + scores[i, n, c] @ u)
        k_end = np.exp(b_c[-1] - b_c)[:, None] * k[i, rows, n // rep]
        h[i, n] = np.exp(b_c[-1]) * h[i, n] + k_end.T @ u
  return y, h, np.stack(states, 2), u_all


def _queries(k, seed):
  return _bf16(_normal(np.random.default_rng(seed), *k.shape) / np.sqrt(_SIZE))


def _ring_wrapping_time(chunk, slots):
  """One chunk more than the input ring holds: its slots are reused."""
  return (slots + 1) * chunk


# The walk without residuals only leaves out the residuals' stores, so it
# runs at one of the two rings.
@pytest.mark.parametrize("chunk, slots, also_without_residuals", [(32, 2, False),
                                                                  (16, 3, True)])
def test_walk_matches_float64_and_the_triton_walk(chunk, slots, also_without_residuals):
  """Y, the final state, the states entering each chunk and U; two heads share
  each key group. The Mosaic walk and the Triton walk with the output kernel
  round the same products to bfloat16 (in different places), so both are held
  to the float64 walk with the same tolerance."""
  k, w, u_tilde, b, h0 = _walk_inputs(1, _ring_wrapping_time(chunk, slots), 4, 2, chunk)
  q = _queries(k, seed=5)
  blocks = _triton_walk_blocks(chunk)
  states, u, final = gdr_triton.states(k, w, u_tilde, b, h0, blocks)
  y, _ = gdr_triton.output(q, k, u, b, states, 0.25, blocks, save_scores=True)
  y_walk, final_walk, (states_walk, u_walk) = mosaic.walk_forward(
      q, k, w, u_tilde, b, h0, chunk=chunk, scale=0.25, slots=slots, interpret=True)
  want = _walk_float64(q, k, w, u_tilde, b, h0, chunk, 0.25)
  _assert_as_close_as_triton(("y", "final", "states", "u"),
                             (y_walk, final_walk, states_walk, u_walk), want,
                             (y, final, states, u))
  assert y_walk.dtype == states_walk.dtype == u_walk.dtype == jnp.bfloat16
  assert final_walk.dtype == jnp.float32
  if not also_without_residuals:
    return
  y_only, final_only, none = mosaic.walk_forward(
      q, k, w, u_tilde, b, h0, chunk=chunk, scale=0.25, slots=slots, residuals=False,
      interpret=True)
  assert none is None
  np.testing.assert_array_equal(np.asarray(y_only, np.float32), np.asarray(y_walk, np.float32))
  np.testing.assert_array_equal(final_only, final_walk)


def _reverse_float64(q, k, w, dy, b, dfinal, chunk, scale):
  scores = _scores_float64(q, k, b, chunk)
  q, k, w, dy, b, g = (np.asarray(x, np.float64) for x in (q, k, w, dy, b, dfinal))
  batch, time, heads = dy.shape[:3]
  rep = heads // k.shape[2]
  adjoints, du_all = [None] * (time // chunk), np.zeros(dy.shape)
  for c in reversed(range(time // chunk)):
    rows = slice(c * chunk, (c + 1) * chunk)
    adjoints[c] = g.copy()
    for i in range(batch):
      for n in range(heads):
        b_c = b[i, n, rows]
        k_c, q_c = k[i, rows, n // rep], q[i, rows, n // rep]
        du = (scale * scores[i, n, c].T @ dy[i, rows, n]
              + (np.exp(b_c[-1] - b_c)[:, None] * k_c) @ g[i, n])
        du_all[i, rows, n] = du
        g[i, n] = (scale * (np.exp(b_c)[:, None] * q_c).T @ dy[i, rows, n]
                   + np.exp(b_c[-1]) * g[i, n] - w[i, rows, n].T @ du)
  return np.stack(adjoints, 2), du_all, g


@pytest.mark.parametrize("chunk, slots", [(32, 2), (16, 3)])
def test_reverse_walk_matches_float64_and_the_triton_walk(chunk, slots):
  """The adjoint of the state leaving each chunk, dU and d initial_state; the
  Triton walk reads the scores the output kernel stores, the Mosaic walk forms
  them."""
  time = _ring_wrapping_time(chunk, slots)
  k, w, dy, b, dfinal = _walk_inputs(1, time, 4, 2, chunk, seed=2)
  q = _queries(k, seed=3)
  blocks = _triton_walk_blocks(chunk)
  states = jnp.asarray(np.zeros((1, 4, time // chunk, _SIZE, _SIZE), jnp.bfloat16))
  _, scores_t = gdr_triton.output(q, k, dy, b, states, 0.25, blocks, save_scores=True)
  triton = gdr_triton.states_bwd(q, k, w, dy, b, scores_t, dfinal, 0.25, blocks)
  walk = mosaic.walk_reverse(q, k, w, dy, b, dfinal, chunk=chunk, scale=0.25, slots=slots,
                             interpret=True)
  want = _reverse_float64(q, k, w, dy, b, dfinal, chunk, 0.25)
  _assert_as_close_as_triton(("adjoints", "du", "dh0"), walk, want, triton)


def _op_reference(q, k, v, g, beta, h0):
  return gated_delta_rule_reference(q, k, v, g, beta, initial_state=h0)


# One program for every seed and kernel configuration.
_OP_REFERENCE = outputs_and_grads(_op_reference, sin_loss)


def assert_op_matches_reference(seed, check_outputs=True, **blocks_changes):
  """The whole op with `TritonConfig` changed so (V 100 pads to 128, T 70
  to three chunks, two heads): outputs and every gradient against the step
  reference. Shared by the Mosaic kernels' test modules."""
  rng = np.random.default_rng(seed)
  shape = (1, 70, 2)
  q = _normal(rng, *shape, _SIZE)
  k = _normal(rng, *shape, _SIZE)
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = _normal(rng, *shape, 100)
  g = -np.logaddexp(0.0, _normal(rng, *shape) - 1.0)  # -softplus
  beta = 1.0 / (1.0 + np.exp(-_normal(rng, *shape)))
  h0 = _normal(rng, 1, 2, _SIZE, 100)
  args = tuple(_bf16(x) for x in (q, k, v)) + tuple(jnp.asarray(x) for x in (g, beta, h0))
  blocks = dataclasses.replace(gdr_configs.TritonConfig.get_default(70, _SIZE, _SIZE),
                               **blocks_changes)
  kernel = lambda *a: gdr_pallas.gated_delta_rule_pallas(*a[:5], initial_state=a[5],
                                                         blocks=blocks)
  rel = lambda x, ref: (np.abs(np.asarray(x, np.float32) - np.asarray(ref, np.float32)).max()
                        / max(1.0, np.abs(np.asarray(ref, np.float32)).max()))
  outputs, grads = outputs_and_grads(kernel, sin_loss)(*args)
  ref_outputs, ref_grads = _OP_REFERENCE(*args)
  if check_outputs:
    for got, want in zip(outputs, ref_outputs):
      assert rel(got, want) < 3e-2
  for a, b in zip(grads, ref_grads):
    assert a.shape == b.shape and rel(a, b) < 6e-2


def test_op_with_the_mosaic_walk_matches_reference():
  assert_op_matches_reference(seed=1, mosaic_walk=True)


def traced_gradient(groups, **blocks_changes):
  """The op's gradient traced as for a Hopper GPU (run under the
  `hopper_lowering` fixture), keys in `groups` groups of four heads."""
  blocks = dataclasses.replace(gdr_configs.TritonConfig.get_default(256, _SIZE, _SIZE),
                               **blocks_changes)
  def loss(q, k, v, g, beta):
    y, final = gdr_pallas.gated_delta_rule_pallas(q, k, v, g, beta, blocks=blocks)
    return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)
  spec = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
  specs = (spec(2, 256, groups, _SIZE), spec(2, 256, groups, _SIZE), spec(2, 256, 4, _SIZE),
           spec(2, 256, 4, dtype=jnp.float32), spec(2, 256, 4, dtype=jnp.float32))
  return jax.jit(jax.grad(loss, argnums=range(5))).trace(*specs)


def lowered_gradient(groups, **blocks_changes):
  """StableHLO of `traced_gradient` lowered for a Hopper GPU."""
  return traced_gradient(groups, **blocks_changes).lower(
      lowering_platforms=("cuda",)).as_text()


def test_lowers_to_mosaic_gpu_for_hopper(hopper_lowering):
  """Mosaic GPU's checks (TMA boxes, swizzles, wgmma shapes) without a GPU,
  inside the op's gradient."""
  del hopper_lowering
  text = lowered_gradient(2, mosaic_walk=True)
  assert "gated_delta_states_mosaic" in text
  assert "gated_delta_states_reverse_mosaic" in text


@pytest.mark.parametrize("dtype, key, chunk, match", [
    (jnp.float32, _SIZE, 32, "16-bit inputs"),
    (jnp.bfloat16, 64, 32, "K = V = 128"),
    (jnp.bfloat16, _SIZE, 64, "chunks of 16 to 32"),
])
def test_forced_mosaic_walk_outside_its_limits_raises(dtype, key, chunk, match):
  blocks = gdr_configs.TritonConfig(chunk=chunk, mosaic_walk=True)
  x = jnp.zeros((1, 32, 1, key), dtype)
  g = jnp.zeros((1, 32, 1), jnp.float32)
  with pytest.raises(ValueError, match=f"blocks.mosaic_walk.*{match}"):
    gdr_pallas.gated_delta_rule_pallas(x, x, x, g, g, blocks=blocks)


def test_default_is_off_where_it_does_not_compile():
  """On the CPU (interpret mode) the default blocks keep the Triton walk."""
  assert not mosaic.takes(jnp.bfloat16, _SIZE, _SIZE, 32)
