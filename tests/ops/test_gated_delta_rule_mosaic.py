"""ops.gated_delta_rule's Mosaic GPU forward state walk (mosaic.py): against a
float64 walk and the Triton walk in Mosaic GPU interpret mode, inside the op
(forward and every gradient against the reference), its lowering for Hopper,
and its limits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.gated_delta_rule import gated_delta_rule_reference
from ops.gated_delta_rule import mosaic
from ops.gated_delta_rule import pallas as gdr_pallas

_SIZE = 128  # the walk's K = V


def _walk_inputs(batch, time, heads, groups, chunk, seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  k = jax.random.normal(ks[0], (batch, time, groups, _SIZE)) / np.sqrt(_SIZE)
  w = jax.random.normal(ks[1], (batch, time, heads, _SIZE)) / np.sqrt(_SIZE)
  u_tilde = jax.random.normal(ks[2], (batch, time, heads, _SIZE))
  log_decay = -0.2 * jax.random.uniform(ks[3], (batch, heads, time // chunk, chunk))
  b = jnp.cumsum(log_decay, axis=-1).reshape(batch, heads, time)
  h0 = jax.random.normal(ks[4], (batch, heads, _SIZE, _SIZE))
  bf16 = lambda x: x.astype(jnp.bfloat16)
  return bf16(k), bf16(w), bf16(u_tilde), b, h0


def _triton_walk_blocks(chunk):
  """The Triton walks on whole [K, V] states, the yardstick of the Mosaic ones."""
  return gdr_pallas.GatedDeltaBlocks(chunk=chunk, block_v=_SIZE, state_block_v=_SIZE,
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


def _walk_float64(k, w, u_tilde, b, h0, chunk):
  """The walk in numpy float64, on the same (rounded) inputs."""
  k, w, u_tilde, b, h = (np.asarray(x, np.float64) for x in (k, w, u_tilde, b, h0))
  batch, time, heads = u_tilde.shape[:3]
  rep = heads // k.shape[2]
  states, u_all = [], np.zeros(u_tilde.shape)
  for c in range(time // chunk):
    rows = slice(c * chunk, (c + 1) * chunk)
    states.append(h.copy())
    for i in range(batch):
      for n in range(heads):
        u = u_tilde[i, rows, n] - w[i, rows, n] @ h[i, n]
        u_all[i, rows, n] = u
        b_c = b[i, n, rows]
        k_end = np.exp(b_c[-1] - b_c)[:, None] * k[i, rows, n // rep]
        h[i, n] = np.exp(b_c[-1]) * h[i, n] + k_end.T @ u
  return np.stack(states, 2), u_all, h


@pytest.mark.parametrize("chunk, slots", [(32, 2), (16, 3)])
def test_walk_matches_float64_and_the_triton_walk(chunk, slots):
  """States entering each chunk, U and the final state; two heads share each
  key group. Both walks round the same products to bfloat16 (in different
  places), so they are held to the float64 walk with the same tolerance."""
  args = _walk_inputs(1, 96, 4, 2, chunk)
  blocks = _triton_walk_blocks(chunk)
  triton = gdr_pallas._states(*args, blocks)
  walk = mosaic.walk_forward(*args, chunk=chunk, slots=slots, interpret=True)
  want = _walk_float64(*args, chunk)
  _assert_as_close_as_triton(("states", "u", "final"), walk, want, triton)
  assert walk[0].dtype == walk[1].dtype == jnp.bfloat16 and walk[2].dtype == jnp.float32


def _reverse_float64(q, k, w, dy, b, scores_t, dfinal, chunk, scale):
  q, k, w, dy, b, scores_t, g = (np.asarray(x, np.float64)
                                 for x in (q, k, w, dy, b, scores_t, dfinal))
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
        du = (scale * scores_t[i, n, rows] @ dy[i, rows, n]
              + (np.exp(b_c[-1] - b_c)[:, None] * k_c) @ g[i, n])
        du_all[i, rows, n] = du
        g[i, n] = (scale * (np.exp(b_c)[:, None] * q_c).T @ dy[i, rows, n]
                   + np.exp(b_c[-1]) * g[i, n] - w[i, rows, n].T @ du)
  return np.stack(adjoints, 2), du_all, g


@pytest.mark.parametrize("chunk, slots", [(32, 2), (16, 3)])
def test_reverse_walk_matches_float64_and_the_triton_walk(chunk, slots):
  """The adjoint of the state leaving each chunk, dU and d initial_state."""
  k, w, dy, b, dfinal = _walk_inputs(1, 96, 4, 2, chunk, seed=2)
  ks = jax.random.split(jax.random.key(3), 2)
  q = (jax.random.normal(ks[0], k.shape) / np.sqrt(_SIZE)).astype(jnp.bfloat16)
  scores_t = jnp.tril(jax.random.normal(ks[1], (1, 4, 96 // chunk, chunk, chunk)))
  scores_t = jnp.swapaxes(scores_t, -1, -2).reshape(1, 4, 96, chunk).astype(jnp.bfloat16)
  args = (q, k, w, dy, b, scores_t, dfinal)
  blocks = _triton_walk_blocks(chunk)
  triton = gdr_pallas._states_bwd(*args, 0.25, blocks)
  walk = mosaic.walk_reverse(*args, chunk=chunk, scale=0.25, slots=slots, interpret=True)
  want = _reverse_float64(*args, chunk, 0.25)
  _assert_as_close_as_triton(("adjoints", "du", "dh0"), walk, want, triton)


def test_op_with_the_mosaic_walk_matches_reference():
  """The whole op with the walk forced on (V 100 pads to 128, T 70 to three
  chunks): outputs and every gradient against the step reference."""
  ks = jax.random.split(jax.random.key(1), 6)
  shape = (1, 70, 2)
  q = jax.random.normal(ks[0], shape + (_SIZE,))
  k = jax.random.normal(ks[1], shape + (_SIZE,))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(ks[2], shape + (100,))
  g = -jax.nn.softplus(jax.random.normal(ks[3], shape) - 1.0)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], shape))
  h0 = jax.random.normal(ks[5], (1, 2, _SIZE, 100))
  args = tuple(x.astype(jnp.bfloat16) for x in (q, k, v)) + (g, beta, h0)
  blocks = dataclasses.replace(gdr_pallas.GatedDeltaBlocks.get_default(70, _SIZE, _SIZE),
                               mosaic_walk=True)
  kernel = lambda *a: gdr_pallas.gated_delta_rule_pallas(*a[:5], initial_state=a[5],
                                                         blocks=blocks)
  reference = lambda *a: gated_delta_rule_reference(*a[:5], initial_state=a[5])
  loss = lambda fn: lambda *a: sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in fn(*a))
  rel = lambda x, ref: (np.abs(np.asarray(x, np.float32) - np.asarray(ref, np.float32)).max()
                        / max(1.0, np.abs(np.asarray(ref, np.float32)).max()))
  for got, want in zip(jax.jit(kernel)(*args), reference(*args)):
    assert rel(got, want) < 3e-2
  grads = jax.jit(jax.grad(loss(kernel), argnums=range(6)))(*args)
  for a, b in zip(grads, jax.grad(loss(reference), argnums=range(6))(*args)):
    assert a.shape == b.shape and rel(a, b) < 6e-2


def test_lowers_to_mosaic_gpu_for_hopper(hopper_lowering):
  """Mosaic GPU's checks (TMA boxes, swizzles, wgmma shapes) without a GPU,
  inside the op's gradient."""
  del hopper_lowering
  blocks = dataclasses.replace(gdr_pallas.GatedDeltaBlocks.get_default(256, _SIZE, _SIZE),
                               mosaic_walk=True)
  def loss(q, k, v, g, beta):
    y, final = gdr_pallas.gated_delta_rule_pallas(q, k, v, g, beta, blocks=blocks)
    return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)
  spec = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
  specs = (spec(2, 256, 2, _SIZE), spec(2, 256, 2, _SIZE), spec(2, 256, 4, _SIZE),
           spec(2, 256, 4, dtype=jnp.float32), spec(2, 256, 4, dtype=jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=range(5))).trace(*specs).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "gated_delta_states_mosaic" in text
  assert "gated_delta_states_reverse_mosaic" in text


@pytest.mark.parametrize("dtype, key, chunk, match", [
    (jnp.float32, _SIZE, 32, "16-bit inputs"),
    (jnp.bfloat16, 64, 32, "K = V = 128"),
    (jnp.bfloat16, _SIZE, 64, "chunks of 16 to 32"),
])
def test_forced_mosaic_walk_outside_its_limits_raises(dtype, key, chunk, match):
  blocks = gdr_pallas.GatedDeltaBlocks(chunk=chunk, mosaic_walk=True)
  x = jnp.zeros((1, 32, 1, key), dtype)
  g = jnp.zeros((1, 32, 1), jnp.float32)
  with pytest.raises(ValueError, match=f"blocks.mosaic_walk.*{match}"):
    gdr_pallas.gated_delta_rule_pallas(x, x, x, g, g, blocks=blocks)


def test_default_is_off_where_it_does_not_compile():
  """On the CPU (interpret mode) the default blocks keep the Triton walk."""
  assert not mosaic.takes(jnp.bfloat16, _SIZE, _SIZE, 32)
