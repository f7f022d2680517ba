"""Test-session setup shared by every test module."""

import os
import types

import pytest

# XLA:CPU sizes its thread pool by the cores (2 on CI) unless PJRT_NPROC says
# otherwise. Mosaic GPU interpret mode runs a block's three warpgroups as
# threads whose barrier waits are host callbacks, and those callbacks run on
# that pool: with two threads, two waiting warpgroups starve the third, which
# would arrive, and the test hangs. Set before any test creates the CPU client.
os.environ.setdefault("PJRT_NPROC", "8")


@pytest.fixture
def hopper_lowering(monkeypatch):
  """Lowering for a Hopper GPU (compute capability 9.0) on the CPU, without a
  GPU: JAX 0.11.2 (pinned) asks this module for the GPU's compute capability
  while lowering a Triton kernel, so we state the H200's; and the ops run
  their compiled kernel paths (interpret mode off)."""
  from jax._src.pallas.triton import pallas_call_registration as triton_registration
  from ops import _backend
  monkeypatch.setattr(triton_registration, "gpu_info_lib", types.SimpleNamespace(
      get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90)))
  monkeypatch.setattr(_backend, "pallas_interpret", lambda: False)
