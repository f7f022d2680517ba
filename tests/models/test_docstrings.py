"""Every public name documents its arguments: `help()` on a function or a
constructor shows an `Args:` section (a dataclass's `Attributes:`), never
Haiku's generic `hk.Module.__init__` text, and every module's `__call__` says
the shapes it maps."""

import inspect

import haiku as hk
import pytest

import ops
import probjax_hk

_PUBLIC = [(m.__name__, n) for m in (probjax_hk, ops) for n in m.__all__]
# Names whose docstrings still lack an Args section (probjax_hk/layers.py and
# probjax_hk/stacking.py).
_PENDING = {"AdaLNModulation", "LayerNorm", "Linear", "MLP", "RMSNorm",
            "TimestepEmbedding", "modulate", "stack_layer_params",
            "unstack_layer_params"}


def _problem(obj) -> str | None:
  """What is missing from `obj`'s documentation, or None."""
  if not inspect.signature(obj).parameters:
    return None
  if not inspect.isclass(obj):
    return None if "Args:" in (inspect.getdoc(obj) or "") else "no Args: section"
  init_doc = inspect.getdoc(obj.__init__) or ""
  if issubclass(obj, hk.Module):
    if "Initializes the current module" in init_doc or "Args:" not in init_doc:
      return "the constructor has no docstring with Args: (help() shows hk.Module's)"
    if "[" not in (inspect.getdoc(obj.__call__) or ""):
      return "__call__ does not give its shapes"
    return None
  class_doc = inspect.getdoc(obj) or ""
  if not any(s in doc for doc in (init_doc, class_doc) for s in ("Args:", "Attributes:")):
    return "neither the class nor its constructor has Args: / Attributes:"
  return None


@pytest.mark.parametrize("module, name", [
    pytest.param(m, n, marks=pytest.mark.xfail(reason="Args: still to write"))
    if n in _PENDING else (m, n) for m, n in _PUBLIC], ids=lambda v: v)
def test_public_name_documents_its_arguments(module, name):
  obj = getattr({"ops": ops, "probjax_hk": probjax_hk}[module], name)
  assert _problem(obj) is None, f"{module}.{name}: {_problem(obj)}"


def test_the_check_can_fail():
  class Undocumented(hk.Module):
    def __init__(self, width: int, name=None):
      super().__init__(name=name)

    def __call__(self, x):
      return x

  def no_args(x, y):
    """Adds."""
  assert "hk.Module's" in _problem(Undocumented)
  assert _problem(no_args) == "no Args: section"
