"""Mixture-of-experts feed-forward layer: dropless by default, or with capacity.

Switch Transformer (https://arxiv.org/abs/2101.03961): top-k routing, the
load-balancing loss and expert capacity. ST-MoE (https://arxiv.org/abs/2202.08906):
the router z-loss. MegaBlocks (https://arxiv.org/abs/2211.15841): dropless
experts as grouped matmuls over tokens sorted by expert (`ops.grouped_mlp`).

Glossary of shapes: T tokens (every leading axis of the input, flattened),
D d_model, F d_hidden, E experts, k top_k, A = T * k token-expert assignments,
R rows handed to the experts, N shards of the tokens over the mesh, T_s = T / N
tokens of one shard (A_s = T_s * k assignments), n devices on `expert_axis`,
El = E / n local experts, C expert capacity. How the layer splits over a
mesh: `MoELayer`'s docstring.

Every `dropless_impl` computes the same function; the paths are listed under
`MoELayer`'s `dropless_impl` argument.
"""

import dataclasses
import functools
import math
from typing import Any, Callable, Literal, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import ops
from ops import _backend
from ops import _measured
from ops import _shapes
from ops import _sharding
from ops.grouped_mlp.reference import Activation
from ops.grouped_mlp.reference import activate
from probjax_hk import arguments
from probjax_hk import layers

DroplessImpl = Literal["dense", "ragged_dot", "sort", "gmm", "auto"]
DROPLESS_IMPLS = ("dense", "ragged_dot", "sort", "gmm", "auto")

_OP = "MoELayer"  # in sharding messages
_TOKENS = ("batch", None)  # [T, D] and [T, k]: tokens split like a batch
_EXPERTS = ("experts", None, None)  # [E, D, F']: split over `expert_axis` only
_EXPERT_WEIGHTS = ("w_in", "w_out")  # the parameters `expert_parameter_sharding` splits


def choose_dropless_impl(num_tokens: int, num_experts: int, top_k: int, d_model: int,
                         d_hidden: int) -> str:
  """The 'auto' rule: the fastest measured path for the platform.

  On NVIDIA GPUs, the path timed fastest (fwd+bwd) at the measured layer that
  judges this one (`ops/dispatch_tables/moe.json`, read by `ops._measured`),
  among those measured on this device kind ('gmm', the Pallas kernels, only
  where they passed their check there); 'ragged_dot' where nothing decides.
  Elsewhere the Pallas kernel would run interpreted, so XLA's 'ragged_dot' is
  used.
  """
  if not _backend.on_nvidia_gpu():
    return "ragged_dot"
  return _measured.fastest("moe", ("gmm", "ragged_dot", "sort", "dense"), experts=num_experts,
                           top_k=top_k, d_model=d_model, d_hidden=d_hidden,
                           tokens=num_tokens) or "ragged_dot"


class Routing(NamedTuple):
  """The router's decisions for T tokens (all float32)."""
  logits: jax.Array      # [T, E]
  probs: jax.Array       # [T, E] softmax over experts
  expert_ids: jax.Array  # [T, k] int32, the top-k experts of each token
  gates: jax.Array       # [T, k] top-k probabilities renormalized to sum to 1


def route(x: jax.Array, w_router: jax.Array, top_k: int) -> Routing:
  """Softmax router with top-k and renormalized gates, in float32.

  Args:
    x: [T, D] tokens (any float dtype).
    w_router: [D, E] float32.
    top_k: experts per token.
  """
  logits = router_logits(x, w_router.astype(jnp.float32))  # [T, E]
  probs = jax.nn.softmax(logits, axis=-1)
  top_probs, expert_ids = _top_k(probs, top_k)  # [T, k]
  gates = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
  return Routing(logits, probs, expert_ids, gates)


def _bfloat16_parts(a: jax.Array, axis: int) -> jax.Array:
  """Three bfloat16 arrays summing to float32 `a`, concatenated along `axis`.

  8 + 8 + 8 significand bits hold all 24 of a float32 (up to underflow of the
  last part), so a product with a bfloat16 operand, accumulated in float32,
  loses nothing that a float32 matmul would keep.
  """
  hi = a.astype(jnp.bfloat16)
  rest = a - hi.astype(jnp.float32)
  mid = rest.astype(jnp.bfloat16)
  lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
  return jnp.concatenate([hi, mid, lo], axis=axis)


@jax.custom_vjp
def _router_logits_bf16(x, w):
  """bf16 x [T, D] @ f32 w [D, E] -> f32 [T, E], to float32 accuracy."""
  num_experts = w.shape[1]
  parts = jnp.dot(x, _bfloat16_parts(w, axis=1), preferred_element_type=jnp.float32)
  return parts.reshape(x.shape[0], 3, num_experts).sum(axis=1)


def _router_logits_bf16_fwd(x, w):
  return _router_logits_bf16(x, w), (x, w)


def _router_logits_bf16_bwd(residuals, dlogits):
  x, w = residuals
  # dx is rounded to bfloat16: the default (TF32 on GPUs) product is enough.
  dx = jnp.dot(dlogits, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
  parts = jnp.dot(x.T, _bfloat16_parts(dlogits, axis=1),
                  preferred_element_type=jnp.float32)  # [D, 3E]
  dw = parts.reshape(w.shape[0], 3, w.shape[1]).sum(axis=1)
  return dx, dw


_router_logits_bf16.defvjp(_router_logits_bf16_fwd, _router_logits_bf16_bwd)


def router_logits(x: jax.Array, w_router: jax.Array) -> jax.Array:
  """Router logits `x @ w_router` in float32: [T, D] x [D, E] -> [T, E].

  A float32 matmul at full precision (no TF32) of a [T, D] x [D, 8] shape
  runs at a fraction of the GPU's speed; for bfloat16 tokens the weights are
  split into three bfloat16 parts instead (`_bfloat16_parts`), one native
  bfloat16 matmul with float32 accumulation that keeps float32 accuracy.
  """
  if x.dtype == jnp.bfloat16:
    return _router_logits_bf16(x, w_router)
  return jnp.dot(x.astype(jnp.float32), w_router, precision=jax.lax.Precision.HIGHEST)


def _top_k(probs: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
  """`jax.lax.top_k` over the last axis as k argmax passes (ties: lowest index).

  For the few experts of a router this fuses into elementwise work, where the
  general top-k is a separate, slower kernel on GPUs; the gradient flows
  through one-hot products instead of a scatter.
  """
  remaining = probs
  values, ids = [], []
  for _ in range(top_k):
    idx = jnp.argmax(remaining, axis=-1).astype(jnp.int32)  # [T]
    pick = jax.nn.one_hot(idx, probs.shape[-1], dtype=probs.dtype)  # [T, E]
    values.append(jnp.sum(probs * pick, axis=-1))
    ids.append(idx)
    remaining = jnp.where(pick > 0, -jnp.inf, remaining)
  return jnp.stack(values, axis=-1), jnp.stack(ids, axis=-1)


def load_balance_loss(routing: Routing, num_experts: int) -> jax.Array:
  """Switch loss `E * sum_e f_e P_e`: f_e the fraction of assignments to
  expert e, P_e its mean router probability. 1.0 when perfectly balanced."""
  counts = jnp.sum(jax.nn.one_hot(routing.expert_ids, num_experts), axis=(0, 1))  # [E]
  fraction = counts / routing.expert_ids.size
  mean_prob = jnp.mean(routing.probs, axis=0)  # [E]
  return num_experts * jnp.sum(jax.lax.stop_gradient(fraction) * mean_prob)


def router_z_loss(routing: Routing) -> jax.Array:
  """ST-MoE z-loss: mean squared log-partition of the router logits."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1)))


def capacity_positions(expert_ids: jax.Array, num_experts: int,
                       capacity: int) -> tuple[jax.Array, jax.Array]:
  """Each assignment's slot in its expert's buffer, and whether it fits.

  Priority is choice-major (every token's first choice before any second
  choice), then token order, as in Switch/GShard.

  Args:
    expert_ids: [T, k].
    num_experts: E.
    capacity: C slots per expert.

  Returns:
    (slot, keep): each [T, k]; slot is the 0-based rank within the expert,
    keep is `slot < capacity`.
  """
  flat = expert_ids.T.reshape(-1)  # [k*T], choice-major
  onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32)  # [k*T, E]
  rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)  # [k*T]
  slot = rank.reshape(expert_ids.shape[1], -1).T  # [T, k]
  return slot, slot < capacity


# Row permutations with gather-only backward passes (a scatter-add into the
# token array is much slower than a gather on GPUs).

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_tokens(x, order, inverse, top_k):
  """xs[i] = x[order[i] // top_k]: [T, D] -> [A, D] in expert order."""
  return x[order // top_k]


def _gather_tokens_fwd(x, order, inverse, top_k):
  return _gather_tokens(x, order, inverse, top_k), (order, inverse, x.shape[0])


def _gather_tokens_bwd(top_k, residuals, dxs):
  order, inverse, num_tokens = residuals
  dx = dxs[inverse].reshape(num_tokens, top_k, -1).sum(axis=1)  # [T, D]
  return dx.astype(dxs.dtype), None, None


_gather_tokens.defvjp(_gather_tokens_fwd, _gather_tokens_bwd)


@jax.custom_vjp
def _unsort(ys, order, inverse):
  """y[a] = ys[inverse[a]]: rows back from expert order to assignment order."""
  return ys[inverse]


def _unsort_fwd(ys, order, inverse):
  return ys[inverse], (order, inverse)


def _unsort_bwd(residuals, dy):
  order, _ = residuals
  return dy[order], None, None


_unsort.defvjp(_unsort_fwd, _unsort_bwd)


def _sort_by_expert(ids: jax.Array, num_experts: int, *, method: str = "counting"):
  """Stable sort of rows by expert id; ids == num_experts mark empty rows.

  Args:
    ids: [R] int32 in [0, num_experts].
    num_experts: E.
    method: 'counting' (a counting sort: one cumsum over a [R, E + 1] one-hot,
      then a scatter of row numbers) or 'argsort' (`jnp.argsort`). Both give
      the same stable order; the counting sort avoids a general sort on GPUs.

  Returns:
    order [R] (sorted position -> row), inverse [R] (row -> sorted position),
    group_sizes [E] int32 (empty rows counted in none), sorted_ids [R].
  """
  num_rows = ids.shape[0]
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  if method == "argsort":
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)  # [R]
    inverse = jnp.zeros_like(order).at[order].set(rows)
    group_sizes = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.int32), axis=0)
  else:
    onehot = jax.nn.one_hot(ids, num_experts + 1, dtype=jnp.int32)  # [R, E+1]
    before = jnp.cumsum(onehot, axis=0) - onehot  # earlier rows of the same id
    counts = jnp.sum(onehot, axis=0)  # [E+1]
    starts = jnp.cumsum(counts) - counts
    inverse = jnp.sum((before + starts[None, :]) * onehot, axis=1)  # [R]
    order = jnp.zeros_like(inverse).at[inverse].set(rows, unique_indices=True)
    group_sizes = counts[:num_experts]
  return order, inverse, group_sizes, ids[order]


def _sort_block_size(num_rows: int, num_experts: int) -> int:
  """'sort' pads each expert to a multiple of this (padding <= ~25% of rows)."""
  quarter_group = _shapes.cdiv(num_rows, 4 * num_experts)
  return min(1024, max(16, 1 << max(0, quarter_group - 1).bit_length()))


def _block_padded_experts(xs, group_sizes, sorted_ids, w_in, w_out, activation):
  """'sort': batched matmul over row blocks, each block owned by one expert.

  Args:
    xs: [R, D] rows sorted by expert (empty rows, id E, last).
    group_sizes: [E]; sorted_ids: [R]; w_in: [E, D, F']; w_out: [E, F, D].

  Returns:
    [R, D], zero for empty rows.
  """
  num_rows, d = xs.shape
  num_experts = w_in.shape[0]
  block = _sort_block_size(num_rows, num_experts)
  num_blocks = _shapes.cdiv(num_rows, block) + num_experts  # static upper bound
  padded = (group_sizes + block - 1) // block * block  # [E]
  padded_end = jnp.cumsum(padded)
  padded_start = padded_end - padded
  start = jnp.cumsum(group_sizes) - group_sizes
  ids = jnp.minimum(sorted_ids, num_experts - 1)
  rank = jnp.arange(num_rows) - start[ids]
  dest = jnp.where(sorted_ids < num_experts, padded_start[ids] + rank,
                   num_blocks * block)  # [R]; out of range -> dropped
  xp = jnp.zeros((num_blocks * block, d), xs.dtype).at[dest].set(xs, mode="drop")
  block_first_row = jnp.arange(num_blocks) * block
  block_expert = jnp.minimum(
      jnp.sum(block_first_row[:, None] >= padded_end[None, :], axis=1), num_experts - 1)
  h = jnp.einsum("nbd,ndf->nbf", xp.reshape(num_blocks, block, d), w_in[block_expert])
  y = jnp.einsum("nbf,nfd->nbd", activate(h, activation), w_out[block_expert])
  return y.reshape(num_blocks * block, d).at[dest].get(mode="fill", fill_value=0)


def _grouped_experts(xs, group_sizes, sorted_ids, w_in, w_out, *, activation,
                     impl, gmm_implementation):
  """Experts on rows sorted by expert: [R, D] -> [R, D] (empty rows -> 0).

  'gmm' and 'ragged_dot' are `ops.grouped_mlp` (its kernels, or its XLA path
  of two `ragged_dot`s), which takes the float32 weights, casts them and
  returns float32 gradients; 'sort' takes them in xs's dtype.
  """
  if impl == "sort":
    return _block_padded_experts(xs, group_sizes, sorted_ids, w_in.astype(xs.dtype),
                                 w_out.astype(xs.dtype), activation)
  implementation = gmm_implementation if impl == "gmm" else "xla"
  return ops.grouped_mlp(xs, w_in, w_out, group_sizes, activation=activation,
                         implementation=implementation)


def _experts_on_rows(rows, ids, w_in, w_out, *, activation, impl, gmm_implementation):
  """Rows [R, D] each bound for expert ids[r] (E = none) -> [R, D]."""
  num_experts = w_in.shape[0]
  if impl == "dense":
    h = activate(jnp.einsum("rd,edf->erf", rows, w_in), activation)
    y = jnp.einsum("erf,efd->erd", h, w_out)  # [E, R, D]
    select = jax.nn.one_hot(ids, num_experts, dtype=rows.dtype)  # [R, E]
    return jnp.einsum("re,erd->rd", select, y)
  order, inverse, group_sizes, sorted_ids = _sort_by_expert(ids, num_experts)
  xs = _gather_tokens(rows, order, inverse, 1)
  ys = _grouped_experts(xs, group_sizes, sorted_ids, w_in, w_out, activation=activation,
                        impl=impl, gmm_implementation=gmm_implementation)
  return _unsort(ys, order, inverse)


def _dropless_local(x, expert_ids, gates, w_in, w_out, *, activation, impl,
                    gmm_implementation):
  """Dropless experts for local tokens: [T, D] -> [T, D] (gates float32)."""
  num_tokens, d = x.shape
  top_k = expert_ids.shape[1]
  num_experts = w_in.shape[0]
  if impl == "dense":
    combine = jnp.sum(jax.nn.one_hot(expert_ids, num_experts) * gates[..., None], axis=1)
    h = activate(jnp.einsum("td,edf->etf", x, w_in), activation)
    y = jnp.einsum("etf,efd->etd", h, w_out)  # [E, T, D]
    return jnp.einsum("te,etd->td", combine.astype(x.dtype), y)
  order, inverse, group_sizes, sorted_ids = _sort_by_expert(expert_ids.reshape(-1),
                                                            num_experts)
  xs = _gather_tokens(x, order, inverse, top_k)  # [A, D]
  ys = _grouped_experts(xs, group_sizes, sorted_ids, w_in, w_out, activation=activation,
                        impl=impl, gmm_implementation=gmm_implementation)
  y = _unsort(ys, order, inverse).reshape(num_tokens, top_k, d)  # [T, k, D]
  return jnp.einsum("tk,tkd->td", gates.astype(x.dtype), y)


def _capacity_local(x, expert_ids, gates, slot, keep, w_in, w_out, *, capacity,
                    activation):
  """Token-dropping experts on [E, C, D] buffers (GShard/Switch style)."""
  num_tokens, d = x.shape
  top_k = expert_ids.shape[1]
  num_experts = w_in.shape[0]
  dest = jnp.where(keep, expert_ids * capacity + slot, num_experts * capacity)  # [T, k]
  tokens = jnp.broadcast_to(x[:, None, :], (num_tokens, top_k, d))
  buffer = jnp.zeros((num_experts * capacity, d), x.dtype).at[dest.reshape(-1)].set(
      tokens.reshape(-1, d), mode="drop").reshape(num_experts, capacity, d)
  h = activate(jnp.einsum("ecd,edf->ecf", buffer, w_in), activation)
  out = jnp.einsum("ecf,efd->ecd", h, w_out).reshape(num_experts * capacity, d)
  y = out.at[dest.reshape(-1)].get(mode="fill", fill_value=0).reshape(num_tokens, top_k, d)
  return jnp.einsum("tk,tkd->td", (gates * keep).astype(x.dtype), y)


def _expert_parallel_local(x, expert_ids, gates, w_in, w_out, *, expert_axis,
                           num_experts, activation, impl, gmm_implementation):
  """One device's part of the expert-parallel layer (inside `jax.shard_map`).

  Each device sorts its assignments by expert, sends each device on
  `expert_axis` its rows in a [n, A_s, D] buffer (sized for the worst case,
  every local assignment bound for one device, so no token is ever dropped),
  runs its El experts on what it received, and sends the results back.

  Args:
    x: [T_s, D] this device's tokens; expert_ids, gates: [T_s, k] (global
      expert ids).
    w_in: [El, D, F'] and w_out: [El, F, D], the experts this device holds:
      device i on `expert_axis` holds experts [i * El, (i + 1) * El).
    num_experts: E.

  Returns:
    [T_s, D].
  """
  num_tokens, d = x.shape
  top_k = expert_ids.shape[1]
  num_assign = num_tokens * top_k
  local_experts = w_in.shape[0]
  num_devices = num_experts // local_experts
  order, inverse, group_sizes, sorted_ids = _sort_by_expert(expert_ids.reshape(-1),
                                                            num_experts)
  xs = _gather_tokens(x, order, inverse, top_k)  # [A_s, D] in expert order
  device = sorted_ids // local_experts  # [A_s] destination of each row
  per_device = group_sizes.reshape(num_devices, local_experts).sum(axis=1)  # [n]
  slot = jnp.arange(num_assign) - (jnp.cumsum(per_device) - per_device)[device]
  send = jnp.zeros((num_devices, num_assign, d), x.dtype).at[device, slot].set(xs)
  send_ids = jnp.full((num_devices, num_assign), local_experts, jnp.int32).at[
      device, slot].set(sorted_ids % local_experts)
  recv = jax.lax.all_to_all(send, expert_axis, 0, 0)  # [n, A_s, D] by source
  recv_ids = jax.lax.all_to_all(send_ids, expert_axis, 0, 0)
  y_rows = _experts_on_rows(recv.reshape(-1, d), recv_ids.reshape(-1), w_in, w_out,
                            activation=activation, impl=impl,
                            gmm_implementation=gmm_implementation)
  back = jax.lax.all_to_all(y_rows.reshape(num_devices, num_assign, d), expert_axis, 0, 0)
  ys = back[device, slot]  # [A_s, D] in expert order
  y = _unsort(ys, order, inverse).reshape(num_tokens, top_k, d)
  return jnp.einsum("tk,tkd->td", gates.astype(x.dtype), y)


def _experts_per_shard(x, expert_ids, gates, w_in, w_out, *, num_experts, capacity,
                       expert_axis, activation, impl, gmm_implementation):
  """The experts on one shard's tokens (on all of them when nothing is split).

  Args:
    x: [T_s, D]; expert_ids, gates: [T_s, k]; w_in: [E or El, D, F'];
      w_out: [E or El, F, D].
    capacity: None (dropless) or C, the slots per expert in this shard.

  Returns:
    [T_s, D] when dropless; else ([T_s, D], keep [T_s, k] bool).
  """
  common = dict(activation=activation, impl=impl, gmm_implementation=gmm_implementation)
  if expert_axis is not None:
    return _expert_parallel_local(x, expert_ids, gates, w_in, w_out,
                                  expert_axis=expert_axis, num_experts=num_experts,
                                  **common)
  if capacity is None:
    return _dropless_local(x, expert_ids, gates, w_in, w_out, **common)
  slot, keep = capacity_positions(expert_ids, num_experts, capacity)
  if impl == "dense":
    y = _dropless_local(x, expert_ids, gates * keep, w_in, w_out, **common)
  else:
    y = _capacity_local(x, expert_ids, gates, slot, keep, w_in, w_out,
                        capacity=capacity, activation=activation)
  return y, keep


def _dispatch_plan(x, expert_ids, gates, w_in, w_out, expert_axis) -> _sharding.Plan:
  """How the dispatch splits over the mesh (`ops/_sharding.plan`).

  Tokens split like a batch: over the axes their Explicit types name, else
  over the context mesh's Auto axes (`_sharding`'s rule). Without
  `expert_axis` the expert weights are replicated; with it they split over
  `expert_axis` alone, and the tokens over their batch axes plus
  `expert_axis` (or over `expert_axis` alone when the token count does not
  divide that product), so each group of devices along `expert_axis`
  exchanges its own tokens.

  Raises:
    ValueError: when `expert_axis` is not an Auto or Explicit axis of the
      mesh in context, or when the experts or tokens do not divide over it.
  """
  weights = _EXPERTS if expert_axis is not None else (None,) * 3
  plan = _sharding.plan(_OP, (
      ("x", x, _TOKENS), ("expert_ids", expert_ids, _TOKENS), ("gates", gates, _TOKENS),
      ("w_in", w_in, weights), ("w_out", w_out, weights)),
      split=("batch", "experts") if expert_axis is not None else ("batch",))
  if expert_axis is None:
    return plan
  mesh = plan.mesh
  if mesh.empty or expert_axis not in mesh.axis_names:
    raise ValueError(f"`expert_axis`={expert_axis!r} is not an axis of the current mesh "
                     f"({mesh.axis_names if not mesh.empty else 'no mesh set'}); call "
                     "the layer under `jax.set_mesh(mesh)`")
  if dict(zip(mesh.axis_names, mesh.axis_types))[expert_axis] == AxisType.Manual:
    raise ValueError(f"`expert_axis`={expert_axis!r} is already manual (inside a "
                     "`shard_map` over it); call the layer outside that shard_map")
  num_devices = mesh.shape[expert_axis]
  num_experts, num_tokens = w_in.shape[0], x.shape[0]
  if num_experts % num_devices:
    raise ValueError(f"`num_experts`={num_experts} must be a multiple of the "
                     f"{num_devices} devices on mesh axis {expert_axis!r}")
  if plan.axes.get("experts", (expert_axis,)) != (expert_axis,):
    raise ValueError(f"`w_in` and `w_out` are sharded over {plan.axes['experts']} along "
                     f"their expert axis (axis 0), but `expert_axis` is {expert_axis!r}; "
                     "place them with `expert_parameter_sharding(expert_axis)`")
  batch = plan.axes.get("batch", ())
  if expert_axis not in batch:
    wider = tuple(a for a in batch if a != expert_axis) + (expert_axis,)
    batch = wider if num_tokens % math.prod(mesh.shape[a] for a in wider) == 0 else (
        expert_axis,)
  if num_tokens % math.prod(mesh.shape[a] for a in batch):
    raise ValueError(f"the token count {num_tokens} (every leading axis of `x`) must be "
                     f"a multiple of the {num_devices} devices on mesh axis "
                     f"{expert_axis!r}")
  return dataclasses.replace(plan, axes={**plan.axes, "batch": batch,
                                         "experts": (expert_axis,)})


def _path_leaf_name(path) -> str:
  """The last name in a parameter path: a key path, a tuple or 'a/b/c'."""
  if isinstance(path, str):
    return path.rsplit("/", 1)[-1]
  last = path[-1] if len(path) else ""
  for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
    if hasattr(last, attr):
      return str(getattr(last, attr))
  return str(last)


def expert_parameter_sharding(expert_axis: str) -> Callable[[Any, Any], P | None]:
  """A `fit(..., parameter_sharding=...)` rule placing MoE experts over a mesh axis.

  Each device then holds `num_experts / n` experts' weights and their
  optimizer state (n the size of `expert_axis`), which is what
  `MoELayer(expert_axis=...)`'s shard_map takes without a gather. Every other
  parameter is replicated. Compose it with another rule for the rest:
  `lambda path, leaf: expert_rule(path, leaf) or other_rule(path, leaf)`.

  Args:
    expert_axis: the mesh axis given to the layers as `MoELayer(expert_axis=...)`.

  Returns:
    `rule(path, leaf) -> PartitionSpec | None`: for a leaf named `w_in` or
    `w_out` (MoELayer's [E, D, F'] and [E, F, D] expert weights; with more
    dimensions, as under `hk.layer_stack`, the leading ones are stacked
    layers) the spec splitting its expert dimension over `expert_axis`, e.g.
    `P('expert')` or `P(None, 'expert')`; None (replicated) otherwise.
    `path` is a key path (`jax.tree_util.tree_map_with_path`), a tuple of
    names or a '/'-joined string.

  Raises:
    ValueError: when `expert_axis` is not a non-empty string.
  """
  if not isinstance(expert_axis, str) or not expert_axis:
    raise ValueError(f"`expert_axis` must be a mesh axis name, got {expert_axis!r}")

  def rule(path, leaf) -> P | None:
    ndim = len(getattr(leaf, "shape", ()))
    if _path_leaf_name(path) in _EXPERT_WEIGHTS and ndim >= 3:
      return P(*([None] * (ndim - 3)), expert_axis)
    return None
  return rule


class MoELayer(hk.Module):
  """Top-k mixture-of-experts MLP, `[..., D] -> [..., D]`.

  Experts are bias-free MLPs (`w_in` [E, D, F] with GELU, or [E, D, 2F] with
  SwiGLU; `w_out` [E, F, D]); parameters are float32 and the experts compute
  in the input's dtype. The router computes in float32 whatever the input.

  State written with `hk.set_state` on every call (use `hk.transform_with_state`)
  so that a training loop can add `aux_loss` to its loss and log the rest::

    aux_loss:            load_balance_loss_weight * load_balance_loss
                         + router_z_loss_weight * router_z_loss   (scalar, f32)
    load_balance_loss:   Switch's `E * sum_e f_e P_e` (1.0 when balanced)
    router_z_loss:       mean squared logsumexp of the router logits
    tokens_per_expert:   [E] f32 assignments routed to each expert (before drops)
    dropped_tokens:      scalar int32 assignments dropped for capacity (0 when
                         dropless)

  Sharding. Under a mesh (`jax.set_mesh(mesh)`, or inputs with Explicit-axis
  types) the experts run once per shard of the tokens, through
  `ops/_sharding` (one `jax.shard_map`); with no mesh the layer runs whole.
  Routing is per token, so every split computes the same function, and the
  aux losses and `tokens_per_expert` are reduced over all T tokens (equal to
  one device's).

  - Data parallel (no `expert_axis`): the tokens split like the batch, over
    the mesh axes `x` is sharded over (Explicit types) or, for Auto axes, over
    the longest run of the mesh's axes whose product divides T. Each device
    routes, sorts and runs the experts on its own T/N tokens: no token leaves
    its device, only the loss, the aux losses and the weight gradients are
    all-reduced. Each device holds every expert: 2 E D F floats (3 E D F for
    SwiGLU), plus their gradients and optimizer state.
  - Capacity (`capacity_factor`) is per shard, as in GShard and Switch: each
    device gives each expert C = ceil(capacity_factor * (T/N) * k / E) slots
    for its own tokens, with choice-major priority among them. So which
    tokens drop depends on N: on N devices the layer equals the unsharded
    layer applied to each device's tokens separately (N = 1: the global rule).
  - Expert parallel (`expert_axis` of size n): device i on `expert_axis` holds
    experts [i E/n, (i+1) E/n) (`w_in` [E/n, D, F'], `w_out` [E/n, F, D]: the
    shard_map takes them split along E, so weights placed that way, e.g. by
    `fit(..., parameter_sharding=expert_parameter_sharding(expert_axis))`,
    are never gathered; replicated ones are sliced). The tokens split over
    their batch axes and `expert_axis` (on a ('data', 'expert') mesh: over
    both, each 'data' group exchanging its own tokens along 'expert'), and
    move by all-to-all in [n, T_s k, D] buffers (T_s tokens a device), sized
    for the worst case so that nothing drops: per device E/n experts'
    weights and state, plus about 2 n T_s k D activations in flight. With
    Explicit types and `x` split over fewer axes than that, `y` returns in
    `x`'s layout (an all-gather of [T_s, D] rows along `expert_axis`); split
    the batch over both axes to avoid it.
  """

  def __init__(self, num_experts: int, top_k: int, d_hidden: int, *,
               activation: Activation = "gelu", dropless_impl: DroplessImpl = "auto",
               capacity_factor: float | None = None,
               router_z_loss_weight: float = 1e-3,
               load_balance_loss_weight: float = 1e-2,
               expert_axis: str | None = None,
               grouped_matmul_implementation: _backend.Implementation = None,
               name: str | None = None):
    """Constructs the layer.

    Args:
      num_experts: E >= 1.
      top_k: experts per token, 1 <= top_k <= num_experts.
      d_hidden: F, each expert's hidden width.
      activation: 'gelu' or 'swiglu'.
      dropless_impl: how the experts are run; every path computes the same
        function:

        - `'dense'`: every expert on every token, then a masked combine (the
          reference; E / k times the arithmetic the routing needs).
        - `'ragged_dot'`: sort assignments by expert, `jax.lax.ragged_dot`.
        - `'sort'`: sort, pad each expert's rows to a block multiple, and run a
          batched matmul over blocks with each block's expert weights gathered.
        - `'gmm'`: sort, `ops.grouped_mlp`: both grouped matmuls with the
          activation in their kernels (Pallas on NVIDIA GPUs, `ragged_dot`
          elsewhere).
        - `'auto'`: on NVIDIA GPUs the path measured fastest
          (`ops/dispatch_tables/moe.json`; 'gmm' only where its kernels passed
          their check on that device kind), elsewhere 'ragged_dot'.

        With `capacity_factor`, 'dense' applies the drops to the dense
        reference and every other value uses [E, C, D] buffers.
      capacity_factor: None for dropless; else each expert takes
        C = ceil(capacity_factor * T * k / E) assignments and drops the rest
        (T the tokens of one shard when the tokens are split: class docstring).
      router_z_loss_weight, load_balance_loss_weight: weights in `aux_loss`.
      expert_axis: mesh axis to shard the experts (E / n each, n its size)
        and the tokens over, exchanging tokens with all-to-all; call under
        `jax.set_mesh(mesh)`. E and T must be multiples of n.
      grouped_matmul_implementation: `implementation` of `ops.grouped_mlp`
        on the 'gmm' path (None: Pallas on NVIDIA GPUs, XLA elsewhere).
      name: module name.

    Raises:
      TypeError: a size that is not an integer, a factor or weight that is
        not a number, or an `expert_axis` that is not a string.
      ValueError: a size below 1, `top_k` above `num_experts`, a factor or
        weight out of range, an unknown `activation`, `dropless_impl` or
        `grouped_matmul_implementation`, or `capacity_factor` with
        `expert_axis`.
    """
    arguments.check_name(name)
    super().__init__(name=name or "moe_layer")
    arguments.check_positive_ints(num_experts=num_experts, top_k=top_k, d_hidden=d_hidden)
    if top_k > num_experts:
      raise ValueError(f"`top_k` must be in [1, num_experts], got {top_k=} {num_experts=}")
    arguments.check_choice("activation", activation, layers.ACTIVATIONS)
    arguments.check_choice("dropless_impl", dropless_impl, DROPLESS_IMPLS)
    arguments.check_positive_numbers_or_none(capacity_factor=capacity_factor)
    arguments.check_nonnegative_numbers(router_z_loss_weight=router_z_loss_weight,
                                        load_balance_loss_weight=load_balance_loss_weight)
    if expert_axis is not None and not isinstance(expert_axis, str):
      raise TypeError(f"`expert_axis` must be a mesh axis name or None, got {expert_axis!r}")
    if expert_axis == "":
      raise ValueError("`expert_axis` must be a mesh axis name or None, got ''")
    arguments.check_choice("grouped_matmul_implementation", grouped_matmul_implementation,
                           _backend.IMPLEMENTATIONS)
    if capacity_factor is not None and expert_axis is not None:
      raise ValueError("`capacity_factor` with `expert_axis` is not supported: the "
                       "expert-parallel path is dropless")
    self.num_experts = num_experts
    self.top_k = top_k
    self.d_hidden = d_hidden
    self.activation = activation
    self.dropless_impl = dropless_impl
    self.capacity_factor = capacity_factor
    self.router_z_loss_weight = router_z_loss_weight
    self.load_balance_loss_weight = load_balance_loss_weight
    self.expert_axis = expert_axis
    self.grouped_matmul_implementation = grouped_matmul_implementation

  def __call__(self, x: jax.Array) -> jax.Array:
    """Routes each token to its top-k experts and mixes their outputs.

    Args:
      x: [..., D] float32 or bfloat16; the leading axes (T tokens in all)
        may be sharded like a batch (class docstring).

    Returns:
      [..., D] in `x.dtype`.

    Raises:
      ValueError: for a bad `x` shape; with `expert_axis`, when it is not an
        axis of the mesh in context or E or T is not a multiple of its size.
    """
    if x.ndim < 1 or x.shape[-1] < 1:
      raise ValueError(f"`x` must be [..., D] with D >= 1, got shape {x.shape}")
    d_model = x.shape[-1]
    e, f = self.num_experts, self.d_hidden
    x2 = x.reshape(-1, d_model)  # [T, D]
    num_tokens = x2.shape[0]
    w_router = hk.get_parameter("router", [d_model, e], jnp.float32,
                                init=hk.initializers.TruncatedNormal(1.0 / math.sqrt(d_model)))
    f_in = 2 * f if self.activation == "swiglu" else f
    w_in = hk.get_parameter("w_in", [e, d_model, f_in], jnp.float32,
                            init=hk.initializers.TruncatedNormal(1.0 / math.sqrt(d_model)))
    w_out = hk.get_parameter("w_out", [e, f, d_model], jnp.float32,
                             init=hk.initializers.TruncatedNormal(1.0 / math.sqrt(f)))
    routing = route(x2, w_router, self.top_k)  # float32
    gates = routing.gates
    impl = self.dropless_impl
    if impl == "auto":
      impl = choose_dropless_impl(num_tokens, e, self.top_k, d_model, f)
    if impl == "dense" or self.capacity_factor is not None:
      w_in, w_out = w_in.astype(x.dtype), w_out.astype(x.dtype)
    # else the sorted paths cast in `_grouped_experts` ('gmm' inside its op).
    plan = _dispatch_plan(x2, routing.expert_ids, gates, w_in, w_out, self.expert_axis)
    capacity = None
    if self.capacity_factor is not None:  # per shard: the formula on its own tokens
      shard_tokens = num_tokens // plan.size("batch")
      capacity = max(1, math.ceil(self.capacity_factor * shard_tokens * self.top_k / e))
    experts = functools.partial(
        _experts_per_shard, num_experts=e, capacity=capacity, expert_axis=self.expert_axis,
        activation=self.activation, impl=impl,
        gmm_implementation=self.grouped_matmul_implementation)
    if capacity is None:
      y = plan.run(experts, _TOKENS)  # [T, D]
      dropped = jnp.zeros((), jnp.int32)
    else:
      y, keep = plan.run(experts, [_TOKENS, _TOKENS])
      dropped = jnp.sum(~keep).astype(jnp.int32)
    if plan.splits and AxisType.Explicit in plan.mesh.axis_types:
      # Explicit types: give y x's layout (expert parallelism may split finer).
      spec = jax.typeof(x2).sharding.spec
      if jax.typeof(y).sharding.spec != spec:
        y = jax.sharding.reshard(y, spec)

    balance = load_balance_loss(routing, e)
    z_loss = router_z_loss(routing)
    hk.set_state("aux_loss", self.load_balance_loss_weight * balance
                 + self.router_z_loss_weight * z_loss)
    hk.set_state("load_balance_loss", balance)
    hk.set_state("router_z_loss", z_loss)
    hk.set_state("tokens_per_expert",
                 jnp.sum(jax.nn.one_hot(routing.expert_ids, e), axis=(0, 1)))
    hk.set_state("dropped_tokens", dropped)
    return y.reshape(x.shape).astype(x.dtype)
