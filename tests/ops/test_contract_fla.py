"""`ops.gated_delta_rule` and `ops.ssd` against the arguments of
flash-linear-attention (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`,
its peer), on every implementation (XLA, and the Pallas kernels in interpret
mode here), checked against the step references: outputs, final states and
every gradient.

The peer's arguments covered: `g=None` (no gate: the plain delta rule),
`use_qk_l2norm_in_kernel`, beta given as a logit (its KDA ops'
`use_beta_sigmoid_in_kernel`), `allow_neg_eigval` (beta in [0, 2]), K = V =
256, and `cu_seqlens` (sequences packed on the time axis of a batch of one,
each with its own initial and final state; empty sequences, sequences inside
one chunk and across several). The packed references are themselves checked
against the plain references run on each sequence alone.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops import _backend
from ops import _measured
from ops.gated_delta_rule import gated_delta_rule
from ops.gated_delta_rule import gated_delta_rule_reference
from ops.ssd import ssd
from ops.ssd import ssd_reference
from ops.ssd import configs as ssd_configs
from ops.ssd import pallas as ssd_pallas_lib
from tests.ops.outputs_and_grads import fixed_weights_loss
from tests.ops.outputs_and_grads import outputs_and_grads

_F32 = jnp.float32
# Max error relative to max(1, max |reference|): (forward, gradients), per dtype.
_TOL = {_F32: (2e-5, 2e-4), jnp.bfloat16: (3e-2, 6e-2)}
# Packed: an empty sequence, one inside a chunk, one across three chunks of 16.
_CU = (0, 5, 5, 14, 48)


def _rel(x, ref):
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  assert np.isfinite(x).all()
  return np.abs(x - ref).max() / max(1.0, np.abs(ref).max())


def _inputs(time, heads, key, value, *, states=1, dtype=_F32, seed=0, unit_keys=True):
  """q, k, v, log_decay, beta, initial_state ([states, N, K, V]), batch 1; drawn
  with NumPy (an eager `jax.random` call compiles a program per shape)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape, np.float32)
  q = normal(1, time, heads, key)
  k = normal(1, time, heads, key)
  if unit_keys:
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = normal(1, time, heads, value)
  g = -np.logaddexp(0.0, normal(1, time, heads) - 1.0)  # -softplus
  beta = 1.0 / (1.0 + np.exp(-normal(1, time, heads)))
  h0 = normal(states, heads, key, value)
  return (tuple(jnp.asarray(x.astype(dtype)) for x in (q, k, v))
          + tuple(jnp.asarray(x) for x in (g, beta, h0)))


# Outputs and gradients of the references, by key: the tiers compared with
# one reference on the same inputs share its compiled program and results.
_REFERENCE_RESULTS = {}


def _reference_results(reference, args, argnums, key):
  if key is None:
    return outputs_and_grads(reference, fixed_weights_loss, argnums)(*args)
  if key not in _REFERENCE_RESULTS:
    _REFERENCE_RESULTS[key] = outputs_and_grads(reference, fixed_weights_loss, argnums)(*args)
  return _REFERENCE_RESULTS[key]


def _check(fn, reference, args, argnums, dtype=_F32, *, names=None, reference_key=None):
  """`fn` against `reference` (float32 inputs) on y, final state and the
  gradients of `argnums`; the extra trailing `args` (offsets) pass through.
  `reference_key`: the reference's results are computed once per key."""
  fwd_tol, grad_tol = _TOL[dtype]
  ref_args = tuple(x.astype(_F32) if x is not None and jnp.issubdtype(x.dtype, jnp.floating)
                   else x for x in args)
  (y, final), grads = outputs_and_grads(fn, fixed_weights_loss, argnums)(*args)
  (y_ref, final_ref), want = _reference_results(reference, ref_args, argnums, reference_key)
  assert y.dtype == args[2].dtype and final.dtype == _F32
  assert y.shape == y_ref.shape and final.shape == final_ref.shape
  assert _rel(y, y_ref) < fwd_tol
  assert _rel(final, final_ref) < fwd_tol
  for i, a, b in zip(argnums, grads, want):
    assert a.shape == b.shape, (names or argnums)[i]
    assert _rel(a, b) < grad_tol, (names or argnums)[i]


_GDR_NAMES = ("q", "k", "v", "log_decay", "beta", "initial_state")


# (gate, options, dtype): the options of the peer, each where it changes the result.
_OPTION_CASES = {
    # No gate, q/k normalized inside, beta as a logit, doubled: all four at once.
    "no_gate_l2norm_logit_neg_eigval": (False, dict(use_qk_l2norm_in_kernel=True,
                                                    use_beta_sigmoid_in_kernel=True,
                                                    allow_neg_eigval=True), _F32),
    # Gated, beta in [0, 2] as given (no sigmoid), bf16 inputs.
    "gated_neg_eigval_bf16": (True, dict(allow_neg_eigval=True), jnp.bfloat16),
}


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("case", sorted(_OPTION_CASES))
def test_gated_delta_rule_options(implementation, case):
  gated, options, dtype = _OPTION_CASES[case]
  q, k, v, g, beta, h0 = _inputs(37, 2, 16, 24, dtype=dtype, seed=1,
                                 unit_keys=not options.get("use_qk_l2norm_in_kernel"))
  if options.get("use_beta_sigmoid_in_kernel"):
    beta = jnp.asarray(np.random.default_rng(7).standard_normal(beta.shape, np.float32)
                       * 2.0)  # logits
  log_decay = g if gated else None

  def fn(q, k, v, beta, h0, log_decay):
    return gated_delta_rule(q, k, v, log_decay, beta, initial_state=h0, chunk_size=16,
                            implementation=implementation, **options)

  def reference(q, k, v, beta, h0, log_decay):
    return gated_delta_rule_reference(q, k, v, log_decay, beta, initial_state=h0,
                                      **options)
  argnums = (0, 1, 2, 3, 4, 5) if gated else (0, 1, 2, 3, 4)
  _check(fn, reference, (q, k, v, beta, h0, log_decay), argnums, dtype,
         names=("q", "k", "v", "beta", "initial_state", "log_decay"),
         reference_key=("options", case))


def test_head_size_256_on_the_kernel():
  """K = V = 256 (the kernels' limit) in interpret mode: one chunk, every gradient."""
  args = _inputs(16, 1, 256, 256, seed=2)

  def fn(q, k, v, g, beta, h0):
    return gated_delta_rule(q, k, v, g, beta, initial_state=h0, implementation="pallas")

  def reference(q, k, v, g, beta, h0):
    return gated_delta_rule_reference(q, k, v, g, beta, initial_state=h0)
  _check(fn, reference, args, tuple(range(6)), names=_GDR_NAMES)


def test_head_size_dispatch_on_gpu(monkeypatch):
  """On a GPU whose measurements name the kernels faster, None takes them up
  to the measured K = V = 128 and XLA past it; 'pallas' runs them up to 256
  and names the limit past that."""
  monkeypatch.setattr(_backend, "on_nvidia_gpu", lambda: True)
  monkeypatch.setattr(_measured, "fastest", lambda *args, **call: "pallas")
  jaxpr = lambda *a, **kw: str(jax.make_jaxpr(lambda *a: gated_delta_rule(*a, **kw))(*a))
  q, k, v, g, beta, _ = _inputs(8, 1, 128, 128)
  assert "pallas_call" in jaxpr(q, k, v, g, beta)
  q, k, v, g, beta, _ = _inputs(8, 1, 256, 256)
  assert "pallas_call" not in jaxpr(q, k, v, g, beta)
  assert "pallas_call" in jaxpr(q, k, v, g, beta, implementation="pallas")
  q = jnp.asarray(np.zeros((1, 8, 1, 512), np.float32))
  with pytest.raises(ValueError, match="K = 512 and V = 256 must be <= 256"):
    gated_delta_rule(q, q, v, g, beta, implementation="pallas")


def _per_sequence(reference, args, cu):
  """`reference` on each packed sequence alone, from its own initial state:
  (y [1, T, ...], final states [S, ...]); an empty sequence keeps its state."""
  *tokens, h0 = (np.asarray(x) for x in args)  # sliced on the host
  ys, finals = [], []
  for s in range(len(cu) - 1):
    a, b = cu[s], cu[s + 1]
    if a == b:
      finals.append(h0[s])
      continue
    y, final = reference(*(x[:, a:b] for x in tokens), h0[s:s + 1])
    ys.append(np.asarray(y))
    finals.append(np.asarray(final)[0])
  return np.concatenate(ys, axis=1), np.stack(finals)


_OPS = {
    "ssd": (lambda q, k, v, g, beta, h0, **kw: ssd(q, k, v, g, initial_state=h0, **kw),
            lambda q, k, v, g, beta, h0, **kw: ssd_reference(q, k, v, g, initial_state=h0,
                                                             **kw),
            (0, 1, 2, 3, 5)),
    "gated_delta_rule": (
        lambda q, k, v, g, beta, h0, **kw: gated_delta_rule(q, k, v, g, beta,
                                                            initial_state=h0, **kw),
        lambda q, k, v, g, beta, h0, **kw: gated_delta_rule_reference(
            q, k, v, g, beta, initial_state=h0, **kw),
        (0, 1, 2, 3, 4, 5)),
}


def _packed_args():
  """q, k (shared by both heads), v (V padded by the kernels), log_decay, beta,
  the initial states and the offsets `_CU`."""
  q, k, v, g, beta, h0 = _inputs(_CU[-1], 2, 16, 24, states=len(_CU) - 1, seed=5)
  q, k = (jnp.asarray(np.asarray(x)[:, :, :1]) for x in (q, k))
  return q, k, v, g, beta, h0, jnp.asarray(_CU, jnp.int32)


def _packed_reference_results(op):
  """The packed reference's outputs and gradients on `_packed_args()`, once per op."""
  _, reference, argnums = _OPS[op]
  return _reference_results(lambda *a: reference(*a[:6], cu_seqlens=a[6]), _packed_args(),
                            argnums, ("packed", op))


@pytest.mark.parametrize("op", sorted(_OPS))
def test_packed_reference_is_each_sequence_alone(op):
  _, reference, _ = _OPS[op]
  got, _ = _packed_reference_results(op)
  want = _per_sequence(jax.jit(lambda *a: reference(*a[:5], a[5])), _packed_args()[:6], _CU)
  for a, b in zip(got, want):
    assert _rel(a, b) < 1e-6


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("op", sorted(_OPS))
def test_packed_sequences(op, implementation):
  """Offsets traced (an argument of the jitted function), q/k shared by both
  heads, V padded by the kernels; every gradient, the initial states' too."""
  fn, reference, argnums = _OPS[op]
  _check(lambda *a: fn(*a[:6], cu_seqlens=a[6], chunk_size=16,
                       implementation=implementation),
         lambda *a: reference(*a[:6], cu_seqlens=a[6]),
         _packed_args(), argnums, names=_GDR_NAMES, reference_key=("packed", op))


def test_packed_ssd_kernel_restarts_inside_chunk_groups():
  """The SSD walks fold groups of chunks (here 2 groups of 4 of the packed
  layout's 7 chunks: two programs, one per head, for a target of four); a
  sequence starts or ends inside a group, where the fold passes nothing
  across (log-decay -inf): no NaN, the same values and gradients."""
  blocks = ssd_configs.TritonConfig(chunk=16, state_programs=4)
  assert ssd_pallas_lib._state_groups(2, 7, blocks.state_programs) == (2, 4)
  _, reference, argnums = _OPS["ssd"]
  _check(lambda *a: ssd_pallas_lib.ssd_pallas(*a[:4], initial_state=a[5], cu_seqlens=a[6],
                                              blocks=blocks),
         lambda *a: reference(*a[:6], cu_seqlens=a[6]),
         _packed_args(), argnums, names=_GDR_NAMES, reference_key=("packed", "ssd"))


@pytest.mark.parametrize("op", sorted(_OPS))
def test_packed_without_initial_states(op):
  """`initial_state=None`: every sequence starts from zeros (default dispatch)."""
  fn, reference, _ = _OPS[op]
  args = _inputs(_CU[-1], 2, 16, 8, seed=8)[:5] + (None,)
  cu = jnp.asarray(_CU, jnp.int32)
  got = jax.jit(lambda *a: fn(*a, cu_seqlens=cu))(*args)
  want = jax.jit(lambda *a: reference(*a, cu_seqlens=cu))(*args)
  for a, b in zip(got, want):
    assert a.shape == b.shape
    assert _rel(a, b) < 2e-5


@pytest.mark.parametrize("op", sorted(_OPS))
@pytest.mark.parametrize("change, error, match", [
    (dict(batch=2), ValueError, "batch of one"),
    (dict(cu=np.array([0, 20, 10, 48])), ValueError, "without decreasing"),
    (dict(cu=np.array([0, 5, 20, 40])), ValueError, "rise from 0 to T = 48"),
    (dict(cu=np.array([0.0, 48.0])), ValueError, "`cu_seqlens` must be integers"),
    (dict(cu=np.array([48])), ValueError, r"`cu_seqlens` must be \[S \+ 1\]"),
    (dict(cu=[0, 48]), TypeError, "`cu_seqlens` must be an array"),
    (dict(states=2), ValueError, r"`initial_state` must be \[S, N, K, V\] = \(3, 2, 16, 8\)"),
])
def test_bad_offsets_raise(op, change, error, match):
  fn, _, _ = _OPS[op]
  batch = change.get("batch", 1)
  zeros = lambda *shape: jnp.asarray(np.zeros(shape, np.float32))
  x = zeros(batch, 48, 2, 16)
  v, g = zeros(batch, 48, 2, 8), zeros(batch, 48, 2)
  h0 = zeros(change.get("states", 3), 2, 16, 8)
  cu = change.get("cu", np.array([0, 5, 20, 48], np.int32))
  with pytest.raises(error, match=match):
    fn(x, x, v, g, g, h0, cu_seqlens=cu)


def test_bad_options_raise():
  q, k, v, g, beta, _ = _inputs(8, 1, 16, 16)
  with pytest.raises(TypeError, match="`use_qk_l2norm_in_kernel` must be a bool"):
    gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel="yes")
  with pytest.raises(TypeError, match="`allow_neg_eigval` must be a bool"):
    gated_delta_rule(q, k, v, g, beta, allow_neg_eigval=None)
  with pytest.raises(TypeError, match="ssd: `log_decay` must be an array, got None"):
    ssd(q, k, v, None)

