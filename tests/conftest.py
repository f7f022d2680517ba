"""Test-session setup shared by every test module."""

import os

# XLA:CPU sizes its thread pool by the cores (2 on CI) unless PJRT_NPROC says
# otherwise. Mosaic GPU interpret mode runs a block's three warpgroups as
# threads whose barrier waits are host callbacks, and those callbacks run on
# that pool: with two threads, two waiting warpgroups starve the third, which
# would arrive, and the test hangs. Set before any test creates the CPU client.
os.environ.setdefault("PJRT_NPROC", "8")
