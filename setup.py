"""Build shim: everything about the package is in pyproject.toml.

Kept for tools that still run `python setup.py ...` or look for this file;
`pip install .` and `python -m build` read pyproject.toml directly.
"""

import setuptools

setuptools.setup()
