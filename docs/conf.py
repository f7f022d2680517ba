"""Sphinx configuration of the probjax_hk documentation (`make docs`).

Markdown pages through MyST, the API reference through autodoc and napoleon
(Google-style docstrings), the furo theme. The build runs with `-W
--keep-going` and `nitpicky = True`: every cross-reference must resolve.
"""

import importlib.metadata
import os
import re
import sys

from sphinx.util.docstrings import prepare_docstring

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)  # `probjax_hk` and `ops` from this checkout
# Importing the packages must not claim a GPU the build does not need.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "probjax_hk"
author = "the probjax_hk authors"
copyright = "the probjax_hk authors"
try:
  release = importlib.metadata.version("probjax_hk")
except importlib.metadata.PackageNotFoundError:
  release = ""
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

# docs/benchmarks holds the benchmark JSON and figures that the performance
# pages read; its files are data, not pages.
exclude_patterns = ["_build", "benchmarks"]

# Docstrings quote code in single backticks (Markdown habit): show it as code
# rather than as a cross-reference that cannot resolve.
default_role = "literal"

nitpicky = True
# Third-party types in signatures: the build has no network for intersphinx,
# so references to these packages' own pages cannot resolve.
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|haiku|optax|numpy|chex)(\..*)?"),
    (r"py:.*", r"collections\.abc\..*"),
]

# MyST: ::: fences for admonitions, anchors on headings for links across pages.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Returns sections name their outputs (`y: [B, T, D] ...`): keep the name as
# text instead of turning it into a return-type cross-reference.
napoleon_use_rtype = False

autodoc_member_order = "bysource"
autoclass_content = "both"  # the class docstring, then the constructor's Args
autodoc_preserve_defaults = True  # `attention_fn=dot_product_attention`, not a repr
autodoc_default_options = {
    "members": True,
    "special-members": "__call__",
}
add_module_names = False
# The summary tables that open the API pages link to the entries below them
# on the same page; no generated stub pages.
autosummary_generate = False

html_theme = "furo"
html_title = f"probjax_hk {release}".strip()
html_static_path = []


_NAMED_OUTPUT = re.compile(r"(\w+): (.*)")


def _named_returns_as_list(app, what, name, obj, options, lines):
  """A `Returns:` section naming several outputs becomes a list of them.

  The recurrences document `y: ...` and `final_state: ...` one per line.
  napoleon reads a Returns section as one `type: description`, so it would
  take `y` for a type and run `final_state` into the same paragraph.
  """
  del app, what, name, obj, options
  for start, line in enumerate(lines):
    if line.strip() != "Returns:":
      continue
    header = len(line) - len(line.lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip()
                                or len(lines[end]) - len(lines[end].lstrip()) > header):
      end += 1
    body = [l for l in lines[start + 1:end] if l.strip()]
    if not body:
      continue
    base = min(len(l) - len(l.lstrip()) for l in body)
    top = [l[base:] for l in body if len(l) - len(l.lstrip()) == base]
    matches = [_NAMED_OUTPUT.fullmatch(l) for l in top]
    if len(top) < 2 or not all(matches):
      continue
    pad = " " * base
    names = ", ".join(m.group(1) for m in matches)
    rewritten = [f"{pad}The tuple ``({names})``.", ""]  # no colon: napoleon would split there
    for l in body:
      m = _NAMED_OUTPUT.fullmatch(l[base:])
      if len(l) - len(l.lstrip()) == base and m:
        rewritten.append(f"{pad}- ``{m.group(1)}``: {m.group(2)}")
      else:
        rewritten.append(f"{pad}  {l.strip()}")
    lines[start + 1:end] = rewritten + [""]
    return


_OBJECT_REPR = re.compile(r"<(?:function|class) '?([\w.]+?)'?(?: at 0x[0-9a-f]+)?>")
_CATCH_ALL = re.compile(r",\s*\*\*unknown(?=\))")


def _readable_signature(app, what, name, obj, options, signature, return_annotation):
  """Defaults that are functions or classes show their names; `**unknown` goes.

  Haiku wraps each module's `__init__`, so `autodoc_preserve_defaults` cannot
  read them from the source, and a repr such as `<function f>` would make
  the whole signature unparsable (shown as raw text). `fit()` collects
  misspelt keywords in `**unknown` only to name them in its error: it takes
  no other arguments, so the page does not list one.
  """
  del app, what, name, obj, options
  if signature is None:
    return None
  signature = _OBJECT_REPR.sub(lambda m: m.group(1).rsplit(".", 1)[-1], signature)
  return _CATCH_ALL.sub("", signature), return_annotation


_NAMEDTUPLE_NEW = re.compile(r"Create new instance of \w+\(.*\)")


def _drop_python_docstrings(app, what, name, obj, options, lines):
  """Drops the docstrings that Python writes rather than the library.

  A NamedTuple's `__new__` says "Create new instance of KVCache(key, value)",
  which `autoclass_content = "both"` would append to the class docstring; a
  module constant such as `FSDP_MIN_SIZE` has only its type's docstring
  (`int`'s), so its page gives the description instead.
  """
  del app, name, options
  if what == "class":
    lines[:] = [l for l in lines if not _NAMEDTUPLE_NEW.fullmatch(l.strip())]
  elif what == "data" and type(obj).__doc__:
    own = [l.strip() for l in lines if l.strip()]
    inherited = [l.strip() for l in prepare_docstring(type(obj).__doc__) if l.strip()]
    if own == inherited:
      lines.clear()


def setup(app):
  app.connect("autodoc-process-docstring", _named_returns_as_list, priority=400)
  app.connect("autodoc-process-docstring", _drop_python_docstrings)
  app.connect("autodoc-process-signature", _readable_signature)
