"""Sphinx configuration of the probjax_hk documentation (`make docs`).

Markdown pages through MyST, the API reference through autodoc and napoleon
(Google-style docstrings), the furo theme. The build runs with `-W
--keep-going` and `nitpicky = True`: every cross-reference must resolve.
"""

import importlib.metadata
import os
import sys

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
    ("py:class", r"(jax|jaxlib|haiku|optax|numpy|chex)(\..*)?"),
    ("py:class", r"collections\.abc\..*"),
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

html_theme = "furo"
html_title = f"probjax_hk {release}".strip()
html_static_path = []
