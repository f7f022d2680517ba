"""The README's Python examples run as written, in order, in one namespace.

Users copy these first; a renamed argument or a changed default should fail
here rather than in their hands. The one edit: `fit_model`'s checkpoint
directory points into the test's temporary directory. After each example the
test checks what its comments promise (shapes, dtypes, decoding = the
sequence path, a checkpoint written, the attention mods against the reference).
"""

import os
import re

import jax.numpy as jnp
import numpy as np

_README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _check_fit(ns, tmp_path):
  loss = ns["result"].history["loss"]
  assert len(loss) == 4 * 256 // 32 and loss[-1] < loss[0] / 2, loss
  assert os.listdir(tmp_path / "run"), "fit_model wrote no checkpoint"


def _check_transformer(ns, tmp_path):
  assert ns["y"].shape == (8, 1024, 256) and ns["y"].dtype == jnp.bfloat16


def _check_ssm_decoding(ns, tmp_path):
  assert ns["y"].shape == (2, 32, 16)
  np.testing.assert_allclose(ns["y_steps"].swapaxes(0, 1), ns["y"], rtol=1e-4, atol=1e-4)


def _check_ssd(ns, tmp_path):
  assert ns["y"].shape == (2, 256, 4, 32) and ns["y"].dtype == jnp.bfloat16
  assert ns["final_state"].shape == (2, 4, 32, 32)


def _check_flex_mods(ns, tmp_path):
  import ops  # pylint: disable=g-import-not-at-top
  from ops.flex_attention import reference  # pylint: disable=g-import-not-at-top
  q = ns["q"].astype(jnp.float32)
  want = reference.flex_attention_reference(
      q, q, q, scale=32 ** -0.5, mask_mod=ns["prefix_lm"], score_mod=ns["alibi"])
  assert ns["out"].shape == (2, 256, 4, 32) and ns["out"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(ns["out"], np.float32), want, atol=2e-2)
  # The mods change the result: plain attention differs.
  plain = ops.flex_attention(ns["q"], ns["q"], ns["q"])
  assert not np.allclose(np.asarray(plain, np.float32), want, atol=2e-2)


def _check_scaling(ns, tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  assert len(ns["result"].history["loss"]) == 10
  for leaf in jax.tree.leaves(ns["result"].params):  # 'fsdp' splits the large ones
    if leaf.size >= 1024 and any(d % jax.device_count() == 0 for d in leaf.shape):
      assert leaf.addressable_shards[0].data.size == leaf.size // jax.device_count()


_CHECKS = (_check_fit, _check_transformer, _check_ssm_decoding, _check_ssd,
           _check_flex_mods, _check_scaling)


def test_readme_examples_run(tmp_path):
  with open(_README) as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
  assert len(blocks) == len(_CHECKS), (
      f"README has {len(blocks)} Python examples; this test checks {len(_CHECKS)}")
  namespace = {}
  for i, (block, check) in enumerate(zip(blocks, _CHECKS)):
    block = block.replace('"/tmp/run"', repr(str(tmp_path / "run")))
    exec(compile(block, f"README.md, Python example {i}", "exec"), namespace)
    check(namespace, tmp_path)
