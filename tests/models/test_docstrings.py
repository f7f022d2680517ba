"""Every public name documents its arguments: `help()` on a function or a
constructor shows an `Args:` section (a dataclass's `Attributes:`), never
Haiku's generic `hk.Module.__init__` text, and every module's `__call__` says
the shapes it maps. A public submodule has a docstring and its own public
functions and classes follow the same rules."""

import inspect
import types

import haiku as hk
import pytest

import ops
import probjax_hk

_PUBLIC = [(m.__name__, n) for m in (probjax_hk, ops) for n in m.__all__]


def _public_names(module: types.ModuleType) -> list[str]:
  """`module.__all__`, else the functions and classes it defines without a `_`."""
  return list(getattr(module, "__all__", None) or [
      n for n, v in vars(module).items()
      if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
      and v.__module__ == module.__name__])


def _module_problem(module: types.ModuleType) -> str | None:
  """What is missing from a public submodule's documentation, or None."""
  if not (inspect.getdoc(module) or "").strip():
    return "no module docstring"
  problems = [f"{n}: {p}" for n in _public_names(module)
              if (p := _problem(getattr(module, n))) is not None]
  return "; ".join(problems) or None


def _problem(obj) -> str | None:
  """What is missing from `obj`'s documentation, or None."""
  if inspect.ismodule(obj):
    return _module_problem(obj)
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


@pytest.mark.parametrize("module, name", _PUBLIC, ids=lambda v: v)
def test_public_name_documents_its_arguments(module, name):
  obj = getattr({"ops": ops, "probjax_hk": probjax_hk}[module], name)
  assert _problem(obj) is None, f"{module}.{name}: {_problem(obj)}"


def test_a_submodule_is_checked_function_by_function():
  names = _public_names(probjax_hk.diffusion)
  # Its own functions, not the helpers or the names it imports (jax, math).
  assert {"cosine_schedule", "ddim_sample", "ddpm_loss", "q_sample"} <= set(names)
  assert not {"jax", "math", "arguments", "Schedule"} & set(names)
  assert not any(n.startswith("_") for n in names)


def test_the_check_can_fail():
  class Undocumented(hk.Module):
    def __init__(self, width: int, name=None):
      super().__init__(name=name)

    def __call__(self, x):
      return x

  def no_args(x, y):
    """Adds."""

  def documented(x):
    """Returns x.

    Args:
      x: anything.
    """
    return x

  assert "hk.Module's" in _problem(Undocumented)
  assert _problem(no_args) == "no Args: section"

  bare = types.ModuleType("bare")
  assert _problem(bare) == "no module docstring"
  module = types.ModuleType("fake", "A documented module.")
  for fn in (no_args, documented):
    fn.__module__ = "fake"
    setattr(module, fn.__name__, fn)
  module._private = no_args  # private names are not checked
  assert _problem(module) == "no_args: no Args: section"
  del module.no_args
  assert _problem(module) is None
