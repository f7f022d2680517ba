"""`ssd`: the state-space dual (Mamba-2) linear recurrence with scalar decay.

Dao & Gu 2024, https://arxiv.org/abs/2405.21060.

Glossary of shapes: B batch, T time, N heads, G query/key groups (N % G == 0),
K key size, V value size.
"""

import jax
import jax.numpy as jnp

from ops import _shapes
from ops import _sharding
from ops import registry
from ops.ssd import configs
from ops.ssd import pallas as pallas_impl
from ops.ssd import sequence_parallel
from ops.ssd import varlen
from ops.ssd.xla import ssd_xla

_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


def validate(op, q, k, v, log_decay, initial_state, *, extra=(), optional_decay=False,
             cu_seqlens=None):
  """Shared shape checks of `ssd` and `gated_delta_rule` (ValueErrors naming the
  argument); `log_decay` may be None where `optional_decay`; with `cu_seqlens`
  B = 1 and `initial_state` is [S, N, K, V]."""
  if log_decay is None and not optional_decay:
    raise TypeError(f"{op}: `log_decay` must be an array, got None")
  _shapes.check_arrays(op, (("q", q), ("k", k), ("v", v), ("log_decay", log_decay),
                            ("initial_state", initial_state)) + tuple(extra))
  if v.ndim != 4:
    raise ValueError(f"{op}: `v` must be [B, T, N, V], got shape {v.shape}")
  batch, time, heads, value = v.shape
  _shapes.check_time(op, "v", v.shape)
  if q.ndim != 4 or q.shape[:2] != (batch, time):
    raise ValueError(f"{op}: `q` must be [B, T, N, K] or [B, T, G, K] with B, T = "
                     f"{(batch, time)} of `v`, got shape {q.shape}")
  groups, key = q.shape[2:]
  if groups == 0 or heads % groups:
    raise ValueError(f"{op}: the heads of `v` ({heads}) must be a multiple of the "
                     f"groups of `q` ({groups})")
  if k.shape != q.shape:
    raise ValueError(f"{op}: `k` must have the shape of `q` {q.shape}, got {k.shape}")
  if log_decay is not None and log_decay.shape != (batch, time, heads):
    raise ValueError(f"{op}: `log_decay` must be [B, T, N] = {(batch, time, heads)}, "
                     f"got {log_decay.shape}")
  for name, x in extra:
    if x.shape != (batch, time, heads):
      raise ValueError(f"{op}: `{name}` must be [B, T, N] = {(batch, time, heads)}, "
                       f"got {x.shape}")
  if cu_seqlens is not None:
    varlen.check(op, cu_seqlens, batch, time, initial_state, (heads, key, value))
  elif initial_state is not None and initial_state.shape != (batch, heads, key, value):
    raise ValueError(f"{op}: `initial_state` must be [B, N, K, V] = "
                     f"{(batch, heads, key, value)}, got {initial_state.shape}")
  for name, x in ((("q", q), ("k", k), ("v", v), ("log_decay", log_decay),
                   ("initial_state", initial_state)) + tuple(extra)):
    if x is not None and not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{op}: `{name}` must be floating point, got {x.dtype}")


def chunked_kernel_limit(q, k, v, chunk_size: int | None, max_head_size: int,
                         why: str) -> str | None:
  """The limits the chunked Pallas kernels (ssd, gated_delta_rule) share:
  None when they take the inputs, else the argument and the limit."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if jnp.dtype(x.dtype) not in _DTYPES:
      return f"`{name}` dtype {x.dtype} is not one of float32, bfloat16, float16"
  key, value = k.shape[-1], v.shape[-1]
  if key > max_head_size or value > max_head_size:
    return f"K = {key} and V = {value} must be <= {max_head_size} ({why})"
  if chunk_size is not None and (chunk_size < 16 or chunk_size & (chunk_size - 1)):
    return f"`chunk_size` must be a power of two >= 16, got {chunk_size}"
  return None


def run_chunked_per_shard(op: str, kernel_path, q, k, v, log_decay, initial_state,
                          extra=(), cu_seqlens=None):
  """`kernel_path(q, k, v, log_decay, initial_state, *extra, cu_seqlens)` per
  shard (ssd and gated_delta_rule): batch, and under Explicit axes heads (the
  query/key groups with them, so each shard keeps whole groups); never time,
  the key/value sizes or (with `cu_seqlens`) the packed sequences."""
  token = ("batch", "seq", "heads", None)
  per_head = ("batch", "seq", "heads")
  state = ("batch" if cu_seqlens is None else None, "heads", None, None)
  plan = _sharding.plan(op, (
      ("q", q, token), ("k", k, token), ("v", v, token), ("log_decay", log_decay, per_head),
      ("initial_state", initial_state, state),
      *((name, x, per_head) for name, x in extra),
      ("cu_seqlens", cu_seqlens, (None,))), split=("batch", "heads"))
  return plan.run(kernel_path, [token, state])


def ssd(q: jax.Array, k: jax.Array, v: jax.Array, log_decay: jax.Array, *,
        initial_state: jax.Array | None = None, chunk_size: int | None = None,
        cu_seqlens: jax.Array | None = None,
        implementation: registry.Choice = None
        ) -> tuple[jax.Array, jax.Array]:
  """SSD: `y_t = sum_{s<=t} exp(G_t - G_s) (q_t^T k_s) v_s`, `G = cumsum(log_decay)`.

  Equivalently `S_t = exp(log_decay_t) S_{t-1} + k_t v_t^T`, `y_t = S_t^T q_t`.

  On a mesh, the time axis may be split over Explicit mesh axes (with the
  batch and heads): each device runs its own chunk from a zero state, and
  only the chunks' final states and total log-decays cross devices
  (`ops/ssd/sequence_parallel.py`, packed sequences included).

  Args:
    q: [B, T, N, K] queries (Mamba-2's C), or [B, T, G, K] shared by N // G heads.
    k: keys (Mamba-2's B), the shape of `q`.
    v: [B, T, N, V] values (Mamba-2's dt * x); sets the output dtype.
    log_decay: [B, T, N] log decay per step (Mamba-2's dt * A), <= 0.
    initial_state: [B, N, K, V] state before the first token ([S, N, K, V],
      one per sequence, with `cu_seqlens`), or None (zeros).
    chunk_size: tokens per chunk (None: 64 for the kernel, 128 for XLA); the
      kernel takes a power of two >= 16.
    cu_seqlens: None, or int [S + 1] offsets of S sequences packed on the time
      axis of a batch of one (B = 1; flash-linear-attention's convention:
      sequence s is tokens cu_seqlens[s] to cu_seqlens[s + 1] - 1, from 0 to
      T): each starts from its own initial state and ends in its own final
      state. Each sequence is computed on chunks of its own, so many
      sequences much shorter than a chunk waste work: pass a smaller
      `chunk_size` then.
    implementation: None (on NVIDIA GPUs the faster of the Triton kernels and
      XLA where measured, `ops/dispatch_tables/ssd.json`; XLA elsewhere),
      'triton' (the kernels; interpret mode off GPU; 'pallas' is its alias),
      'xla' (the chunked einsum algorithm of xla.py), or a sequence of these
      tried in order (`ops.registry`).

  Returns:
    y: [B, T, N, V] in `v`'s dtype (accumulated in float32).
    final_state: [B, N, K, V] float32, the state after the last token
      ([S, N, K, V], each sequence's, with `cu_seqlens`).
  """
  validate("ssd", q, k, v, log_decay, initial_state, cu_seqlens=cu_seqlens)
  _shapes.check_chunk_size("ssd", chunk_size)
  call = dict(q=q, k=k, v=v, log_decay=log_decay, initial_state=initial_state,
              chunk_size=chunk_size, cu_seqlens=cu_seqlens)
  split = sequence_parallel.plan(q, k, v, log_decay, initial_state, cu_seqlens)
  chosen = IMPLEMENTATIONS.choose(implementation, call, key_dim=q.shape[-1],
                                  length=q.shape[1] // (split.size("seq") if split else 1))
  if split is not None:
    return sequence_parallel.ssd_split(chosen.run, split, chunk_size=chunk_size)
  return chosen.run(**call)


def _xla(**call):
  return ssd_xla(**call)


def _triton(q, k, v, log_decay, initial_state, chunk_size, cu_seqlens):
  return run_chunked_per_shard(
      "ssd", lambda q, k, v, g, h0, cu: pallas_impl.ssd_pallas(
          q, k, v, g, initial_state=h0, chunk_size=chunk_size, cu_seqlens=cu),
      q, k, v, log_decay, initial_state, cu_seqlens=cu_seqlens)


def _triton_supports(call) -> str | None:
  return chunked_kernel_limit(call["q"], call["k"], call["v"], call["chunk_size"],
                              pallas_impl.MAX_HEAD_SIZE, "the state tile lives in registers")


# The measured table decides the default (ops/dispatch_tables/ssd.json, where
# the kernels are timed as 'pallas').
IMPLEMENTATIONS = registry.xla_and_triton(
    "ssd", xla=_xla, triton=_triton, supports=_triton_supports,
    config=configs.TritonConfig)
