"""`gated_delta_rule`: Gated DeltaNet's recurrence.

Yang, Kautz & Hatamizadeh 2024, https://arxiv.org/abs/2412.06464.

Glossary of shapes: B batch, T time, N heads, G query/key groups (N % G == 0),
K key size, V value size.
"""

import numbers

import jax

from ops import _shapes
from ops import registry
from ops.gated_delta_rule import configs
from ops.gated_delta_rule import pallas as pallas_impl
from ops.gated_delta_rule import sequence_parallel
from ops.gated_delta_rule.reference import no_gate
from ops.gated_delta_rule.step import l2_normalize
from ops.gated_delta_rule.step import write_strength
from ops.gated_delta_rule.xla import gated_delta_rule_xla
from ops.ssd.api import chunked_kernel_limit
from ops.ssd.api import run_chunked_per_shard
from ops.ssd.api import validate


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array,
                     log_decay: jax.Array | None, beta: jax.Array, *,
                     scale: float | None = None,
                     initial_state: jax.Array | None = None,
                     chunk_size: int | None = None,
                     cu_seqlens: jax.Array | None = None,
                     use_qk_l2norm_in_kernel: bool = False,
                     use_beta_sigmoid_in_kernel: bool = False,
                     allow_neg_eigval: bool = False,
                     implementation: registry.Choice = None
                     ) -> tuple[jax.Array, jax.Array]:
  """The gated delta rule, state `M = S^T` in the [K, V] layout of `ops.ssd`::

      S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
      y_t = scale * S_t q_t

  On a mesh, the time axis may be split over Explicit mesh axes (with the
  batch and heads): each device runs its own chunk once, from zero and from
  the identity, and only the chunks' final states and total transitions
  [B, N, K, K] cross devices (`ops/gated_delta_rule/sequence_parallel.py`,
  packed sequences included).

  Args:
    q: [B, T, N, K] queries, or [B, T, G, K] shared by N // G heads.
    k: keys, the shape of `q` (L2-normalize them, or pass
      `use_qk_l2norm_in_kernel`: the rule assumes `|k| = 1`).
    v: [B, T, N, V] values; sets the output dtype.
    log_decay: [B, T, N] log of the decay gate alpha (<= 0), or None: no gate
      (the plain delta rule, flash-linear-attention's `g=None`).
    beta: [B, T, N] write strength in [0, 1] (a logit with
      `use_beta_sigmoid_in_kernel`).
    scale: output scale, default K ** -0.5.
    initial_state: [B, N, K, V] state before the first token ([S, N, K, V],
      one per sequence, with `cu_seqlens`), or None (zeros).
    chunk_size: tokens per chunk (default 32 on the kernel, measured faster
      than 64 on an H200; 64 on the XLA form; the kernel takes a power of
      two >= 16).
    cu_seqlens: None, or int [S + 1] offsets of S sequences packed on the
      time axis of a batch of one, as in `ops.ssd` (flash-linear-attention's
      `cu_seqlens`): each starts from its own initial state and ends in its
      own final state.
    use_qk_l2norm_in_kernel: L2-normalize q and k over K inside the op
      (`x / sqrt(|x|^2 + 1e-6)` in float32, differentiated through), as
      flash-linear-attention's option of that name.
    use_beta_sigmoid_in_kernel: `beta` holds logits; the rule uses
      `sigmoid(beta)` (flash-linear-attention's option of that name).
    allow_neg_eigval: the rule uses `2 * beta` (after the sigmoid, if any), in
      [0, 2]: `I - beta k k^T` may have the eigenvalue -1 (flash-linear-attention
      applies it only together with the sigmoid; here it always doubles).
    implementation: None (on NVIDIA GPUs the faster of the Triton kernels and
      XLA where measured, `ops/dispatch_tables/gated_delta_rule.json`, at K,
      V <= 128; XLA elsewhere), 'triton' (the kernels of triton.py, with their
      Mosaic GPU state walks on Hopper where those take the shapes; interpret
      mode off GPU; 'pallas' is its alias), 'xla' (the chunked WY form of
      xla.py), or a sequence of these tried in order (`ops.registry`).

  Returns:
    y: [B, T, N, V] in `v`'s dtype (accumulated in float32).
    final_state: [B, N, K, V] float32 ([S, N, K, V] with `cu_seqlens`).
  """
  validate("gated_delta_rule", q, k, v, log_decay, initial_state,
           extra=(("beta", beta),), optional_decay=True, cu_seqlens=cu_seqlens)
  _shapes.check_chunk_size("gated_delta_rule", chunk_size)
  if scale is not None and (isinstance(scale, bool) or not (
      isinstance(scale, numbers.Real) or getattr(scale, "shape", None) == ())):
    raise TypeError(f"gated_delta_rule: `scale` must be a number (or a scalar "
                    f"array) or None, got {scale!r}")
  for name, flag in (("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
                     ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                     ("allow_neg_eigval", allow_neg_eigval)):
    _shapes.check_bool("gated_delta_rule", name, flag)

  # The options act per token before the recurrence; XLA fuses them into one pass.
  if use_qk_l2norm_in_kernel:
    q, k = l2_normalize(q).astype(q.dtype), l2_normalize(k).astype(k.dtype)
  if use_beta_sigmoid_in_kernel or allow_neg_eigval:
    beta = write_strength(beta, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                          allow_neg_eigval=allow_neg_eigval)
  call = dict(q=q, k=k, v=v, log_decay=no_gate(log_decay, beta), beta=beta, scale=scale,
              initial_state=initial_state, chunk_size=chunk_size, cu_seqlens=cu_seqlens)
  split = sequence_parallel.plan(q, k, v, call["log_decay"], beta, initial_state, cu_seqlens)
  chosen = IMPLEMENTATIONS.choose(implementation, call, key_dim=q.shape[-1],
                                  length=q.shape[1] // (split.size("seq") if split else 1))
  if split is not None:
    return sequence_parallel.gated_delta_rule_split(chosen, split, scale=scale,
                                                    chunk_size=chunk_size)
  return chosen.run(**call)


def _xla(**call):
  return gated_delta_rule_xla(**call)


def _triton(q, k, v, log_decay, beta, scale, initial_state, chunk_size, cu_seqlens):
  return run_chunked_per_shard(
      "gated_delta_rule",
      lambda q, k, v, g, h0, beta, cu: pallas_impl.gated_delta_rule_pallas(
          q, k, v, g, beta, scale=scale, initial_state=h0, chunk_size=chunk_size,
          cu_seqlens=cu),
      q, k, v, log_decay, initial_state, extra=(("beta", beta),), cu_seqlens=cu_seqlens)


def _triton_supports(call) -> str | None:
  return chunked_kernel_limit(call["q"], call["k"], call["v"], call["chunk_size"],
                              pallas_impl.MAX_HEAD_SIZE,
                              "a chunk's [K, V] state tiles and gradients live in registers")


def _triton_measured_range(call) -> str | None:
  key, value = call["k"].shape[-1], call["v"].shape[-1]
  if max(key, value) > pallas_impl.MAX_MEASURED_HEAD_SIZE:
    return f"K, V > {pallas_impl.MAX_MEASURED_HEAD_SIZE} not measured"
  return None


# The measured table decides the default (ops/dispatch_tables/gated_delta_rule.json,
# where the kernels are timed as 'pallas').
# No 'mosaic': the Mosaic GPU walks replace some Triton launches per shape inside pallas.py.
IMPLEMENTATIONS = registry.xla_and_triton(
    "gated_delta_rule", xla=_xla, triton=_triton, supports=_triton_supports,
    config=configs.TritonConfig,
    measured_range=_triton_measured_range)
