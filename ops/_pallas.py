"""Kernel calls and custom VJPs that keep `jax.shard_map`'s types.

With shard_map's default `check_vma=True`, every value carries the mesh axes
it varies over, and:

- a Pallas call's declared output types must say theirs (the
  `manual_axis_type` of each `jax.ShapeDtypeStruct`); a plain one is refused.
  A kernel's outputs are computed from its inputs, so they vary over every
  axis one of the inputs varies over: `pallas_call` and `mosaic_kernel` take
  the JAX entry points' arguments and set that when the call is made;
- a custom VJP's gradients must have its inputs' types: `type_tokens` (in the
  residuals) and `typed_like` (on the gradients) see to it.

Outside shard_map, or with `check_vma=False`, nothing varies and these change
nothing.
"""

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def _varying(args) -> frozenset:
  """The mesh axes any of `args` (a pytree of arrays, refs or None) varies over."""
  axes = frozenset()
  for leaf in jax.tree.leaves(args):
    mat = getattr(jax.typeof(leaf), "mat", None)
    if mat is not None:
      axes |= mat.varying
  return axes


def _typed(out_types, args):
  varying = _varying(args)
  if not varying:
    return out_types
  mat = jax.sharding.ManualAxisType(varying=varying)
  return jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat), out_types)


def pallas_call(kernel, *, out_shape, **kwargs):
  """`pl.pallas_call(kernel, out_shape=..., **kwargs)`, shard_map-typed outputs."""
  def call(*args):
    return pl.pallas_call(kernel, out_shape=_typed(out_shape, args), **kwargs)(*args)
  return call


def mosaic_kernel(body, *, out_type, **kwargs):
  """`plgpu.kernel(body, out_type=..., **kwargs)`, shard_map-typed outputs."""
  def call(*args):
    return plgpu.kernel(body, out_type=_typed(out_type, args), **kwargs)(*args)
  return call


def shared_lowering(custom_vjp_fn, *, static_argnums: tuple[int, ...]):
  """`jax.jit(custom_vjp_fn, static_argnums=...)`: an op's custom VJP, called
  through this, lowers its kernels once per distinct static configuration.

  A model calls an op with the same static arguments in every layer. Under one
  jit the calls share jit's trace and lowering caches, so the program embeds
  each kernel (forward and backward) once and XLA compiles it once, where
  every call site would otherwise embed and compile its own copy (compile
  times: BUILD_NOTES.md, "Backend support").
  """
  return jax.jit(custom_vjp_fn, static_argnums=static_argnums)


def type_tokens(*primals) -> tuple:
  """Zero-size slices of a custom VJP's primal inputs, for its residuals: they
  carry each input's shard_map type into the backward (`typed_like`)."""
  return tuple(None if p is None else p.reshape(-1)[:0] for p in primals)


def typed_like(grads, tokens) -> tuple:
  """A custom VJP's gradients typed as its primal inputs (from `type_tokens`).

  Under shard_map an input that does not vary over a mesh axis was used, on
  every device, by varying work: its gradient is the sum over that axis of
  the devices' terms (`psum`; what JAX's own rules do). An input that varies
  where its gradient, computed from non-varying values, does not, gets the
  gradient cast to varying. Outside shard_map this changes nothing.
  """
  out = []
  for grad, token in zip(grads, tokens):
    if grad is not None and token is not None:
      have, want = jax.typeof(grad).mat.varying, jax.typeof(token).mat.varying
      if extra := tuple(sorted(have - want)):
        grad = jax.lax.psum(grad, extra)
      if missing := tuple(sorted(want - have)):
        grad = jax.lax.pcast(grad, missing, to="varying")
    out.append(grad)
  return tuple(out)
