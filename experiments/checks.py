"""An implementation against its float32 reference on this device: outputs and gradients.

Shared by `gpu_check` and the benchmark programs' checks (`--check`,
`--grid_check`), which define absl flags at import and so cannot import one
another. A check runs the implementation's forward and its `jax.vjp` against
fixed cotangents in one jit, runs the reference the same way on float32
copies of the inputs at full matmul precision, and measures each output and
gradient against the reference's (`experiments/tolerances.py` has the
measures and the tests' bounds).
"""

import json
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from experiments import tolerances


def float32(tree):
  """`tree` with its floating-point leaves in float32 (bf16 values exactly)."""
  return jax.tree.map(
      lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def vjp_function(fn: Callable) -> Callable:
  """`(*args, cotangent) -> (fn(*args), its gradient in each of args)`, the
  gradient against `cotangent` (the structure of `fn`'s output; each leaf is
  cast to its output's dtype): a check's computation, and its fwd+bwd."""
  def run(*args_and_cotangent):
    *args, cotangent = args_and_cotangent
    out, pullback = jax.vjp(fn, *args)
    return (out, *pullback(jax.tree.map(lambda c, o: c.astype(o.dtype), cotangent, out)))
  return run


def vjp_outputs(fn: Callable, args: tuple, cotangent) -> tuple:
  """`vjp_function(fn)` on `args` and `cotangent`, in one jit."""
  return jax.jit(vjp_function(fn))(*args, cotangent)


def reference_vjp_outputs(reference: Callable, args: tuple, cotangent) -> tuple:
  """`vjp_outputs` of `reference` on float32 copies of `args` and `cotangent`
  at full matmul precision (no TF32 on a GPU)."""
  with jax.default_matmul_precision("highest"):
    return vjp_outputs(reference, float32(args), float32(cotangent))


def rel_err(got, want) -> float:
  """max |got - want| / max |want| (at least 1e-6), in float32 on the device;
  for pytrees (a layer's parameters) the largest over their leaves, NaN if
  any leaf's is."""
  def one(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return jnp.max(jnp.abs(a - b)) / jnp.maximum(1e-6, jnp.max(jnp.abs(b)))
  return float(np.max(np.asarray(jax.tree.leaves(jax.tree.map(one, got, want)))))


def tree_error(metric: Callable[[Any, Any], float]) -> Callable[[Any, Any], float]:
  """`metric` over pytrees: the largest over their leaves (NaN wins)."""
  def error(got, want):
    values = [metric(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    return float(np.max(values)) if values else 0.0
  return error


def errors(got: tuple, want: tuple, names: Sequence[str], metric=rel_err,
           prefix: str = "rel_err_") -> dict:
  """`<prefix><name>` of each of `got` against `want` (`vjp_outputs`)."""
  return {f"{prefix}{name}": metric(g, w) for name, g, w in zip(names, got, want)}


def vjp_errors(fn, reference, args, cotangent, names) -> dict:
  """`rel_err_<name>` of fn's output and input gradients against reference's."""
  return errors(vjp_outputs(fn, args, cotangent), vjp_outputs(reference, args, cotangent),
                names)


def check_against(config: dict, impls: dict[str, Callable], reference: Callable,
                  args: tuple, cotangent, names) -> list[dict]:
  """One check row per implementation in `impls`, each `fn(*args)`: `config`,
  `impl`, status and `rel_err_<name>` of its output and gradients (in each of
  `args`, against `cotangent`) against `reference` run once on float32 copies
  of `args` and `cotangent` at full matmul precision; prints each row's
  line. Where the reference fails, every row says error with its message."""
  want = harness.computed_once(lambda: reference_vjp_outputs(reference, args, cotangent),
                               "the float32 reference")

  def errors_of(fn):
    reference_out = want()  # before the implementation: a failed reference is the row
    return errors(vjp_outputs(fn, args, cotangent), reference_out, names)

  rows = []
  for name, fn in impls.items():
    row = harness.check_row(dict(config, impl=name), lambda fn=fn: errors_of(fn))
    print(json.dumps({k: row.get(k) for k in (
        "point", "case", "impl", "status", *(f"rel_err_{n}" for n in names), "message")}),
          flush=True)
    rows.append(row)
  return rows


# ---------------------------------------------------------------------------
# Attention: q [B, T, N, H], k and v [B, S, K, H]; relative L2 errors.


def attention_reference_outputs(reference: Callable, cotangent, q, k, v) -> tuple:
  """(out, dq, dk, dv) of `reference` on float32 copies of q, k, v against
  `cotangent` [B, T, N, H], at full matmul precision."""
  return reference_vjp_outputs(reference, (q, k, v), cotangent)


def attention_errors(attend: Callable, want: tuple, q, k, v, cotangent) -> dict:
  """`attend` against the reference's `want` (`attention_reference_outputs`):
  relative L2 errors of the output (`fwd_rel`) and of dq, dk, dv, and
  whether the output holds a NaN."""
  got = vjp_outputs(attend, (q, k, v), cotangent)
  rel = tolerances.relative_l2
  return dict(fwd_rel=rel(got[0], want[0]), nan=bool(np.isnan(np.asarray(got[0])).any()),
              dq_rel=rel(got[1], want[1]), dk_rel=rel(got[2], want[2]),
              dv_rel=rel(got[3], want[3]))


# ---------------------------------------------------------------------------
# Decoding against the forward pass.

# A generated token that the forward's argmax does not pick is a near tie when
# its logit is within this much (times max(1, max |logits|)) of the argmax's.
NEAR_TIE = 1e-2


def greedy_agreement(tokens, logits, near_tie: float = NEAR_TIE) -> dict:
  """Greedy tokens [B, G] against the forward pass's logits [B, G, V] at the
  positions that predicted them: `mismatches` where the argmax differs and
  `worst_gap` (the largest logit gap to the argmax, over max(1, |logits|));
  status 'fail' where a mismatch is not a near tie or a token is -1 (drawn
  from NaN logits)."""
  tokens, logits = np.asarray(tokens), np.asarray(logits, np.float32)
  result = dict(mismatches=int((tokens != logits.argmax(-1)).sum()))
  if (tokens < 0).any():
    return dict(result, status="fail", message="a token was drawn from NaN logits")
  picked = np.take_along_axis(logits, tokens[..., None], -1)[..., 0]
  gap = (logits.max(-1) - picked) / np.maximum(1.0, np.abs(logits).max(-1))
  result["worst_gap"] = float(gap.max(initial=0.0))
  if not (gap <= near_tie).all():
    result.update(status="fail", message=f"{int((~(gap <= near_tie)).sum())} generated tokens "
                  f"are not the forward's argmax (gap up to {result['worst_gap']:.3g})")
  return result
