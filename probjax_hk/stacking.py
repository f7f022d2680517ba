"""How a model stacks its blocks: rematerialization and scan-over-layers.

Every model with a stack of identical blocks goes through `apply_stack`, so
`remat_policy` and `scan_layers` mean the same thing everywhere:

* `remat_policy` wraps each block with `hk.remat`. `None` keeps every
  residual; `'full'` saves nothing but the block's inputs; any parameterless
  name in `jax.checkpoint_policies` (`'dots_saveable'`, `'nothing_saveable'`,
  ...) or a callable policy is passed to `hk.remat` as is.
* `scan_layers=True` builds the blocks with `hk.layer_stack`: one compiled
  block, parameters stacked along a leading `num_layers` axis under
  `.../blocks/block/...`. Unrolled blocks live under `.../block_{i}/...`;
  `stack_layer_params` and `unstack_layer_params` convert between the two.
"""

import re
from typing import Any, Callable, Mapping

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

RematPolicy = None | str | Callable[..., bool]

# jax.checkpoint_policies also holds policy *factories* (they need names or
# offload targets); only parameterless policies can be named by a string.
_POLICY_FACTORY_PREFIXES = ("save_", "Save", "offload_")

UNROLLED_BLOCK_NAME = "block_{}"
SCANNED_STACK_NAME = "blocks"
SCANNED_BLOCK_NAME = "block"


def remat_policy_names() -> tuple[str, ...]:
  """Every string `remat_policy` accepts."""
  named = sorted(
      name for name in dir(jax.checkpoint_policies)
      if not name.startswith("_") and not name.startswith(_POLICY_FACTORY_PREFIXES)
      and callable(getattr(jax.checkpoint_policies, name)))
  return ("full", *named)


def validate_remat_policy(remat_policy: RematPolicy) -> None:
  """Raises a ValueError listing the valid names for an unknown policy."""
  if remat_policy is None or callable(remat_policy):
    return
  if not isinstance(remat_policy, str) or remat_policy not in remat_policy_names():
    raise ValueError(
        f"Unknown `remat_policy` {remat_policy!r}; use None, a callable policy "
        f"or one of {remat_policy_names()}")


def resolve_remat_policy(remat_policy: RematPolicy) -> Callable[..., bool] | None:
  """The `policy` argument for `hk.remat` (None means save nothing)."""
  validate_remat_policy(remat_policy)
  if remat_policy is None or remat_policy == "full":
    return None
  if callable(remat_policy):
    return remat_policy
  return getattr(jax.checkpoint_policies, remat_policy)


def apply_stack(make_block: Callable[[str], Callable[..., Any]], num_layers: int,
                carry: tuple, *, scan_layers: bool = False,
                remat_policy: RematPolicy = None, unroll: int = 1) -> tuple:
  """Runs `num_layers` blocks over `carry`.

  Args:
    make_block: `make_block(name)` returns a callable block (usually an
      `hk.Module`) mapping `*carry -> carry` (a tuple of the same structure,
      e.g. `(x, conditioning)` with the conditioning passed through).
    num_layers: how many blocks.
    carry: the tuple of arrays (or None) each block maps.
    scan_layers: build the blocks with `hk.layer_stack`.
    remat_policy: see the module docstring.
    unroll: `hk.layer_stack`'s unroll, with `scan_layers`.

  Returns:
    The carry after the last block.
  """
  validate_remat_policy(remat_policy)

  def wrap(block_fn):
    if remat_policy is None:
      return block_fn
    return hk.remat(block_fn, policy=resolve_remat_policy(remat_policy))

  try:
    if scan_layers:
      # hk.layer_stack wants explicit positional arguments: the carry travels
      # as one tuple.
      def one_layer(c):
        return tuple(make_block(SCANNED_BLOCK_NAME)(*c))
      return hk.layer_stack(num_layers, unroll=unroll, name=SCANNED_STACK_NAME)(
          wrap(one_layer))(tuple(carry))
    for i in range(num_layers):
      name = UNROLLED_BLOCK_NAME.format(i)
      carry = wrap(lambda c, name=name: tuple(make_block(name)(*c)))(tuple(carry))
    return tuple(carry)
  except ValueError as e:
    if _layout_error(e, scan_layers) is None:
      raise
    raise _layout_error(e, scan_layers) from e


def apply_stack_with_states(make_block: Callable[[str], Callable[..., Any]],
                            num_layers: int, x: Any, states: Any, *,
                            scan_layers: bool = False, unroll: int = 1) -> tuple[Any, Any]:
  """Runs `num_layers` blocks that each carry a state of their own (decoding).

  The blocks and parameters are those of `apply_stack` with the same
  `scan_layers` (`remat_policy` only matters for gradients and is not
  applied): a scanned model decodes with its stacked parameters, its states
  stacked the same way.

  Args:
    make_block: `make_block(name)` returns a callable block mapping
      `(x, state) -> (x, new state)`.
    num_layers: how many blocks.
    x: the input of the first block (an array or a pytree of arrays).
    states: the per-layer states: a list of `num_layers`, or with
      `scan_layers` one pytree stacked on a leading `num_layers` axis; None
      passes None to every block.
    scan_layers: build the blocks with `hk.layer_stack`.
    unroll: `hk.layer_stack`'s unroll, with `scan_layers`.

  Returns:
    (the last block's x, the new states in the layout of `states`: a list,
    or stacked with `scan_layers`).
  """
  try:
    if scan_layers:
      def one_layer(x, *state):
        return make_block(SCANNED_BLOCK_NAME)(x, state[0] if state else None)
      per_layer = () if states is None else (states,)
      return hk.layer_stack(num_layers, with_per_layer_inputs=True, unroll=unroll,
                            name=SCANNED_STACK_NAME)(one_layer)(x, *per_layer)
    new_states = []
    for i in range(num_layers):
      x, state = make_block(UNROLLED_BLOCK_NAME.format(i))(
          x, None if states is None else states[i])
      new_states.append(state)
    return x, new_states
  except ValueError as e:
    if _layout_error(e, scan_layers) is None:
      raise
    raise _layout_error(e, scan_layers) from e


def _layout_error(e: ValueError, scan_layers: bool) -> ValueError | None:
  """A missing block parameter explained (a scanned tree given to an unrolled
  model or the reverse); None for any other error."""
  if "Unable to retrieve parameter" not in str(e):
    return None
  hint = ("stack_layer_params(params) to use an unrolled checkpoint with "
          "scan_layers=True" if scan_layers else
          "unstack_layer_params(params) to use a scanned checkpoint with "
          "scan_layers=False")
  return ValueError(f"Block parameters not found: the parameter tree does not "
                    f"match scan_layers={scan_layers}. Call probjax_hk.{hint}. ({e})")


def _check_params(params) -> None:
  if not (isinstance(params, Mapping) and all(isinstance(k, str) and isinstance(v, Mapping)
                                              for k, v in params.items())):
    raise TypeError(f"`params` must be a Haiku parameter tree {{module path: {{name: "
                    f"array}}}}, got {type(params).__name__}")


_UNROLLED_SEGMENT = re.compile(r"(^|/)block_(\d+)(/|$)")
_SCANNED_SEGMENT = f"{SCANNED_STACK_NAME}/{SCANNED_BLOCK_NAME}"


def stack_layer_params(params: hk.Params) -> hk.Params:
  """Converts an unrolled (`scan_layers=False`) tree to the scanned layout.

  `.../block_{i}/<rest>` entries become one `.../blocks/block/<rest>` entry
  whose arrays are stacked along a new leading axis, in block order.

  Args:
    params: a Haiku parameter tree, `{module path: {name: array}}`, in the
      unrolled layout; the blocks of one stack hold the same parameters with
      the same shapes. Modules outside any `block_{i}` pass through as they
      are. The tree is not modified.

  Returns:
    A new tree in the scanned layout; each stacked parameter of shape
    [...] becomes [num_layers, ...].

  Raises:
    TypeError: `params` is not a Haiku parameter tree.
    ValueError: the block indices of a stack are not 0, 1, ..., n - 1 (a
      block is missing).
  """
  _check_params(params)
  groups: dict[tuple[str, str], dict[int, Any]] = {}
  out = {}
  for module, leaves in params.items():
    match = _UNROLLED_SEGMENT.search(module)
    if match is None:
      out[module] = leaves
      continue
    prefix = module[:match.start()] + match.group(1)
    suffix = match.group(3) + module[match.end():]
    groups.setdefault((prefix, suffix), {})[int(match.group(2))] = leaves
  for (prefix, suffix), by_layer in groups.items():
    layers = sorted(by_layer)
    if layers != list(range(len(layers))):
      raise ValueError(f"Cannot stack {prefix}block_*{suffix}: layers {layers} "
                       "are not 0..n-1")
    out[prefix + _SCANNED_SEGMENT + suffix] = jax.tree.map(
        lambda *xs: jnp.stack(xs), *[by_layer[i] for i in layers])
  return out


def unstack_layer_params(params: hk.Params) -> hk.Params:
  """Converts a scanned (`scan_layers=True`) tree to the unrolled layout.

  Each `.../blocks/block/<rest>` entry becomes `num_layers` entries
  `.../block_{i}/<rest>` holding the i-th slice of every array; the inverse
  of `stack_layer_params`.

  Args:
    params: a Haiku parameter tree, `{module path: {name: array}}`, in the
      scanned layout: every array under `.../blocks/block/...` is
      [num_layers, ...]. Other modules pass through as they are. The tree is
      not modified.

  Returns:
    A new tree in the unrolled layout, each block's arrays [...].

  Raises:
    TypeError: `params` is not a Haiku parameter tree.
    ValueError: the arrays of one stacked module disagree on `num_layers`
      (their leading axis).
  """
  _check_params(params)
  out = {}
  for module, leaves in params.items():
    parts = module.split("/")
    try:
      at = next(i for i in range(len(parts) - 1)
                if parts[i] == SCANNED_STACK_NAME and parts[i + 1] == SCANNED_BLOCK_NAME)
    except StopIteration:
      out[module] = leaves
      continue
    num_layers = {np.shape(x)[0] for x in jax.tree.leaves(leaves)}
    if len(num_layers) != 1:
      raise ValueError(f"{module}: stacked leaves disagree on the layer count "
                       f"{sorted(num_layers)}")
    for i in range(num_layers.pop()):
      name = "/".join(parts[:at] + [UNROLLED_BLOCK_NAME.format(i)] + parts[at + 2:])
      out[name] = jax.tree.map(lambda x, i=i: x[i], leaves)
  return out
