"""Tensor parallelism: attention heads and MLP hidden units split over a mesh axis.

Megatron-LM (Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053): in each
block the query, key and value projections are split by their output columns
(whole heads), the attention output projection by its input rows (the same
heads), the MLP's `w_in` by its columns and `w_out` by its rows (hidden
units). Each device then computes its own heads and hidden units from the
whole activations, and one all-reduce per branch sums the row-split
products (`layers.summed_sharding`): two per block forward, and two
backward, the query, key and value projections computed as one product
(`layers.shared_input`) so that their input gradients are summed before
one all-reduce (the query's apart with grouped key/value heads); never a
gather of a weight.

Glossary of shapes: L stacked layers (`scan_layers`), T time, D model
width, N query heads, K key/value heads, H head size, F MLP hidden width, n
devices on the tensor axis.
"""

import dataclasses

from jax.sharding import PartitionSpec as P

from probjax_hk.training import sharding as sharding_lib

# Module names under a `MultiHeadAttention` whose weights are split by
# columns (whole heads out) or by rows (heads in).
_HEAD_COLUMNS = ("query", "key", "value")
_HEAD_ROWS = ("output",)
# Module names under an `MLP` (Transformer's and DiffusionTransformer's 'mlp').
_HIDDEN_COLUMNS = ("w_in",)
_HIDDEN_ROWS = ("w_out",)


def _names(path) -> tuple[str, ...]:
  """A parameter path ('a/b/w', a key path or a tuple of names) as its names."""
  text = path if isinstance(path, str) else sharding_lib.path_name(path)
  return tuple(text.split("/"))


@dataclasses.dataclass(frozen=True)
class TensorParallelSharding:
  """A `fit(..., parameter_sharding=...)` rule: Megatron-style tensor parallelism.

  Made by `tensor_parameter_sharding`; `fit` reads `tensor_axis` to keep
  each batch whole along that mesh axis.

  Attributes:
    tensor_axis: the mesh axis heads and hidden units are split over.
  """
  tensor_axis: str

  def __call__(self, path, leaf) -> P | None:
    """The PartitionSpec of one parameter.

    Args:
      path: the parameter's path: 'transformer/block_0/attention/query/w'
        (fit's form), a key path or a tuple of names.
      leaf: the parameter (an array or anything with a `shape`); leading
        dimensions beyond the layer's own are stacked layers ([L, ...]
        under `scan_layers`) and stay whole.

    Returns:
      Over `tensor_axis`: the last dimension of the `w` [D, N*H or K*H] and
      `b` of a 'query', 'key' or 'value' projection inside a module named
      '...attention', and of an MLP's (a module named '...mlp') `w_in`
      [D, F] and `b`; the rows of the attention 'output' `w` [N*H, D] and
      of `w_out` [F, D]. None (replicated) for everything else, the
      output projections' biases included.
    """
    names = _names(path)
    if len(names) < 3:
      return None
    parent, module, leaf_name = names[-3:]
    ndim = len(getattr(leaf, "shape", ()))
    if parent.endswith("attention"):
      columns, rows = module in _HEAD_COLUMNS, module in _HEAD_ROWS
    elif parent.endswith("mlp"):
      columns, rows = module in _HIDDEN_COLUMNS, module in _HIDDEN_ROWS
    else:
      return None
    if columns and leaf_name in ("w", "b") and ndim >= 1:
      return P(*([None] * (ndim - 1)), self.tensor_axis)
    if rows and leaf_name == "w" and ndim >= 2:
      return P(*([None] * (ndim - 2)), self.tensor_axis, None)
    return None


def tensor_parameter_sharding(tensor_axis: str = "model") -> TensorParallelSharding:
  """A `fit(..., parameter_sharding=...)` rule splitting heads and hidden units.

  For `Transformer` and `DiffusionTransformer` (any `MultiHeadAttention`
  and GELU `MLP` named as they name them): each device holds 1/n of every
  query, key, value and output projection (N/n query heads, K/n key/value
  heads) and of the MLP weights (F/n hidden units), and their optimizer
  state; norms, embeddings and adaLN projections are replicated. `fit`
  keeps each batch whole along `tensor_axis` (split over the other mesh
  axes: data parallelism, and time over a `sequence_axis`).

  On a mesh whose axes are Explicit the model sees its weights' layout in
  their types: attention runs per head shard and the row-split products are
  all-reduced (two [B', T, D] all-reduces per block forward, B' the rows per
  device). N and K must be multiples of n, and the MLP must be GELU: otherwise
  tracing the loss (before anything is compiled) raises a ValueError naming
  the parameter. On Auto axes the parameters are placed alike and XLA's
  partitioner chooses how to compute with them (an attention kernel then
  gathers the weights: docs/guide/scaling.md).

  Compose it with another rule for other layers:
  `lambda path, leaf: expert_rule(path, leaf) or tp(path, leaf)` (a lambda
  has no `tensor_axis`: set one on it, or fit splits the batch over that
  axis too).

  Args:
    tensor_axis: the mesh axis to split over.

  Returns:
    A `TensorParallelSharding`: `rule(path, leaf) -> PartitionSpec | None`
    with the attribute `tensor_axis`.

  Raises:
    ValueError: when `tensor_axis` is not a non-empty string.
  """
  if not isinstance(tensor_axis, str) or not tensor_axis:
    raise ValueError(f"`tensor_axis` must be a mesh axis name, got {tensor_axis!r}")
  return TensorParallelSharding(tensor_axis)


__all__ = ("TensorParallelSharding", "tensor_parameter_sharding")
