"""The short causal depthwise convolution of Mamba, Mamba-2 and Gated DeltaNet.

    y_t = b + sum_k w[k] x_{t - (W-1) + k}            # per channel, width W

Its decode state is the last W - 1 inputs, `[B, W - 1, C]` float32:
`causal_conv` returns it after a sequence (or after each sequence's own last
step) and `causal_conv_step` carries it one input at a time.

With the time axis split over Explicit mesh axes (context parallelism), each
device's first outputs need the W - 1 inputs before its chunk, which its left
neighbour holds: one `ppermute` of [B, W - 1, C] per call brings them
(`_split_causal_conv`). Padding the split axis instead, as the whole-sequence
path does, is refused by JAX's sharding rules (T + W - 1 does not split evenly).

Glossary of shapes: B batch, T time, C channels, W width.
"""

import math

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

_F32 = jnp.float32


def conv_params(width: int, channels: int, name: str = "conv"):
  """Depthwise causal convolution weights [W, C] and bias [C], float32."""
  bound = 1 / math.sqrt(width)
  w = hk.get_parameter(f"{name}_w", [width, channels], _F32,
                       init=hk.initializers.RandomUniform(-bound, bound))
  b = hk.get_parameter(f"{name}_b", [channels], _F32, init=jnp.zeros)
  return w, b


def causal_conv(x: jax.Array, w: jax.Array, b: jax.Array,
                conv_state: jax.Array | None = None, valid: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """`y_t = b + sum_k w[k] x_{t - (W-1) + k}`, the inputs before x read from
  `conv_state` [B, W - 1, C] (zeros when None).

  Returns:
    (y [B, T, C] in x's dtype, the last W - 1 inputs [B, W - 1, C] float32:
    the conv_state that `causal_conv_step` continues from; with `valid`
    [B, T] (right-padded sequences), the last W - 1 before each sequence's
    end).
  """
  width, time = w.shape[0], x.shape[1]
  split = _time_split(x)
  if split is not None and width > 1:
    return _split_causal_conv(x, w, b, conv_state, valid, *split)
  if conv_state is None:
    xp = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
  else:
    xp = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)   # [B, W - 1 + T, C]
  w = w.astype(x.dtype)
  y = b.astype(x.dtype) + sum(w[k] * xp[:, k:k + time] for k in range(width))
  if valid is None:
    return y, xp[:, time:].astype(_F32)
  # Sequence b's window ends at its length: xp[b, L_b : L_b + W - 1].
  rows = valid.sum(axis=1)[:, None] + jnp.arange(width - 1)           # [B, W - 1]
  return y, jnp.take_along_axis(xp, rows[..., None], axis=1).astype(_F32)


def _time_split(x: jax.Array):
  """(spec entries, time axes) when `x`'s time axis (axis 1) is split over
  Explicit mesh axes, else None."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  if sharding is None or sharding.mesh.empty:
    return None
  entries = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  axes = entries[1] if isinstance(entries[1], tuple) else (entries[1],)
  types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
  if not any(types.get(a) == AxisType.Explicit for a in axes):
    return None
  return entries, axes


def _split_causal_conv(x, w, b, conv_state, valid, entries, axes):
  """`causal_conv` of x [B, T, C] whose time axis is split over the mesh
  axes `axes` (x's layout `entries`): each device convolves its own t = T / n
  steps after the last W - 1 inputs of the device before it (the first
  device: `conv_state`, or zeros)."""
  width = w.shape[0]
  mesh = jax.typeof(x).sharding.mesh
  shards = math.prod(mesh.shape[a] for a in axes)
  local = x.shape[1] // shards
  if valid is not None:
    raise ValueError(
        f"causal_conv: `valid` (ragged sequences) with the time axis split over"
        f" mesh axes {axes} is not supported; keep the time axis whole")
  if local < width - 1:
    raise ValueError(
        f"causal_conv: each of the {shards} devices along mesh axes {axes} holds"
        f" {local} of T={x.shape[1]} steps, fewer than the convolution's"
        f" width - 1 = {width - 1}: use longer sequences or fewer devices")
  state_spec = P(entries[0], None, entries[2])  # [B, W - 1, C]
  following = [(i, i + 1) for i in range(shards - 1)]

  def chunk(x, w, b, conv_state=None):  # x [B', t, C'], conv_state [B', W - 1, C']
    before = jax.lax.ppermute(x[:, local - (width - 1):], axes, following)  # zeros on the first
    index = jax.lax.axis_index(axes)
    if conv_state is not None:
      before = jnp.where(index == 0, conv_state.astype(x.dtype), before)
    y, last = causal_conv(x, w, b, before)
    # The final state is the last device's; a sum with zeros elsewhere is exact.
    final = jax.lax.psum(jnp.where(index == shards - 1, last, 0), axes)
    return y, final

  replicated = lambda a: jax.sharding.reshard(a, P())
  args = [x, replicated(w), replicated(b)]
  specs = [P(*entries), P(), P()]
  if conv_state is not None:
    args.append(jax.sharding.reshard(conv_state, state_spec))
    specs.append(state_spec)
  free = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}
  return jax.shard_map(chunk, mesh=mesh, in_specs=tuple(specs),
                       out_specs=(P(*entries), state_spec), axis_names=free)(*args)


def causal_conv_step(x_t: jax.Array, conv_state: jax.Array, w: jax.Array,
                     b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One step: x_t [B, C], conv_state [B, W - 1, C] f32 (the last inputs)
  -> (y_t [B, C] in x_t's dtype, new conv_state)."""
  window = jnp.concatenate([conv_state.astype(x_t.dtype), x_t[:, None]], axis=1)
  y = b.astype(x_t.dtype) + jnp.sum(window * w.astype(x_t.dtype), axis=1)
  return y, window[:, 1:].astype(_F32)
