"""`pallas.forward_with_lse` and `pallas.backward_with_lse`: the kernels'
attention over a part of the keys, as ring attention merges it.

The keys are cut in two; each half's (out, lse) comes from the kernels, and
the merge by log-sum-exp (`ring._merge`) equals the reference over every
key. The whole attention has a window on both sides; each half takes it as
ring attention's blocks do, shifted by where its keys start (the second
half's right side below zero: a key must lie that far left of the query). Each half's backward, given the merged rows, gives dK and dV of its
keys and a part of dQ; together they equal the reference's gradients. The
second row's key length ends inside the first half, so the second half has
no key for it (lse -inf, zero gradients). On the Triton kernels (f32) and on
the Mosaic GPU ones (bf16, interpret mode).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops import flex_attention_reference
from ops.flex_attention import configs
from ops.flex_attention import pallas
from ops.flex_attention import ring
from tests.ops.test_flex_attention import _inputs

_MOSAIC = dataclasses.replace(
    configs.get_config(64, jnp.bfloat16, interpret=True),
    mosaic_fwd=configs.MosaicConfig(block_q=64, block_k=64, max_concurrent_steps=2),
    mosaic_fwd_bounded=None, mosaic_fwd_min_scores=0,
    mosaic_bwd=configs.MosaicBackwardConfig(block_q=64, block_k=64, max_concurrent_steps=2))

# name: (T = S, head size, dtype, config, relative error bound).
_CASES = {
    "triton_f32": (64, 16, jnp.float32,
                   dataclasses.replace(configs.get_config(16, jnp.float32, interpret=True).forward_on(None),
                                       mosaic_bwd=None), 1e-5),
    "mosaic_bf16": (256, 64, jnp.bfloat16, _MOSAIC, 2e-2),
}


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("name", _CASES)
def test_halves_merge_to_the_whole(name):
  seq, head_dim, dtype, config, bound = _CASES[name]
  q, k, v, w = _inputs((2, seq, 4, head_dim), (2, seq, 2, head_dim), dtype, 0)
  lengths = jnp.array([seq, seq // 4], jnp.int32)
  half = seq // 2
  options = dict(scale=head_dim ** -0.5, q_segment_ids=None, kv_segment_ids=None,
                 interpret=True, config=config)

  left, right = 3 * seq // 8, seq // 8

  def halves(q, k, v, w):
    parts = []
    for first in (0, half):
      part = dict(options, is_causal=False, window=(left + first, right - first),
                  key_value_seq_lengths=jnp.clip(lengths - first, 0, half))
      parts.append((k[:, first:first + half], v[:, first:first + half], part))
    stats = [pallas.forward_with_lse(q, kp, vp, **part) for kp, vp, part in parts]
    out, lse = ring._merge(*stats[0], *stats[1])
    grads = [pallas.backward_with_lse(q, kp, vp, out, lse, w, **part) for kp, vp, part in parts]
    return (out, stats[1][1], grads[0][0] + grads[1][0],
            jnp.concatenate([grads[0][1], grads[1][1]], axis=1),
            jnp.concatenate([grads[0][2], grads[1][2]], axis=1))

  def reference(q, k, v):
    f32 = lambda x: x.astype(jnp.float32)
    return flex_attention_reference(f32(q), f32(k), f32(v), scale=head_dim ** -0.5,
                                    local_window_size=(left, right),
                                    key_value_seq_lengths=lengths)

  if name.startswith("mosaic"):  # both halves' calls go to the Mosaic GPU kernels
    static = []
    jax.eval_shape(lambda q, k: static.append(pallas.prepare(
        q, k, k, is_causal=False, window=(left + half, right - half),
        key_value_seq_lengths=lengths, **options)[0]), q, k[:, :half])
    assert static[0].config.mosaic_fwd is not None and static[0].config.mosaic_bwd is not None
  out, second_lse, dq, dk, dv = jax.jit(halves)(q, k, v, w)
  want, pull = jax.vjp(reference, q, k, v)
  assert _rel(out, want) < bound
  assert np.all(np.asarray(second_lse)[1] == -np.inf)  # row 2's keys end in the first half
  for got, wanted in zip((dq, dk, dv), jax.jit(pull)(w.astype(jnp.float32))):
    assert _rel(got, wanted) < bound
  assert not np.any(np.asarray(dk)[1, seq // 4:]), "keys past the length get no gradient"
