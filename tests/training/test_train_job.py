"""experiments/train.py: every `--model` trains a few steps and writes its files.

The job runs in this process (its `train()` after parsing tiny flags), so the
models compile once each at toy sizes.
"""

import contextlib
import io
import json
import os

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import train
from tests import simulated_devices

_TINY = ["--steps=3", "--batch_size=8", "--num_examples=32",
         "--num_validation=16", "--seq_len=8", "--model_dim=16",
         "--num_heads=2", "--num_layers=1", "--image_size=4",
         "--num_samples=4", "--sample_steps=2", "--eval_every=3",
         "--checkpoint_every=3", "--log_every=1"]


def _run(argv, screen=None):
  """train() under `argv`; with a `screen`, its stdout and stderr both go
  there, as on a terminal."""
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["train"] + argv)
  try:
    if screen is None:
      return train.train()
    with contextlib.redirect_stdout(screen), contextlib.redirect_stderr(screen):
      return train.train()
  finally:
    flags.FLAGS.unparse_flags()


def _lines_as_seen(screen: str) -> list[str]:
  """Each line of a terminal's output as it ends up on screen (a carriage
  return starts the line over; tqdm clears its bar with spaces)."""
  return [line.split("\r")[-1].rstrip() for line in screen.split("\n")]


@pytest.mark.parametrize("model", train.MODELS)
def test_each_model_trains_and_writes_checkpoint_and_pictures(model, tmp_path,
                                                              monkeypatch):
  # One UNet level: the job's wiring is under test, the levels in test_unet.py.
  monkeypatch.setattr(train, "UNET_LEVELS", (1,))
  # The ssm case also shows the progress bar (on stderr, the same screen).
  progress = ["--progress"] if model == "ssm" else []
  # lm runs in bfloat16 (float32 parameters); its float32 model is tests/models'.
  dtype = ["--dtype=bfloat16"] if model == "lm" else []
  screen = io.StringIO()
  result = _run(_TINY + progress + dtype + [f"--model={model}",
                                            f"--output_dir={tmp_path}"], screen)
  assert result.step == 3
  assert os.listdir(tmp_path / "checkpoints") == ["3"]
  with open(tmp_path / "history.json") as f:
    history = json.load(f)
  assert history["step"] == [1, 2, 3]
  assert all(np.isfinite(history["loss"])) and len(history["val_loss"]) == 1
  pictures = ["loss.png"] + (["samples.png"] if model in ("dit", "unet")
                             else [])
  for name in pictures:
    with open(tmp_path / name, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".png")) == \
      sorted(pictures)
  printed = screen.getvalue()
  assert "pictures: " + " ".join(str(tmp_path / p) for p in pictures) in printed
  if progress:  # tqdm.write puts every printed line above the bar, none on it
    assert "3/3" in printed  # the bar was drawn
    seen = _lines_as_seen(printed)
    losses = [line for line in seen if "step " in line and "loss" in line]
    assert len(losses) == 5 and all(line.startswith(("step", "done"))
                                    for line in losses), losses
  if model == "moe":  # the router's state reaches the loss and the history
    assert "load_balance_loss" in history and result.state is not None
    assert history["loss"][0] > history["cross_entropy"][0]
  if model == "transformer":  # the same command with more steps resumes
    result = _run(_TINY + [f"--model={model}", f"--output_dir={tmp_path}",
                           "--steps=5"], screen)
    assert result.step == 5
    assert "resumed from the checkpoint at step 3" in screen.getvalue()
    with open(tmp_path / "history.json") as f:
      assert json.load(f)["step"] == [1, 2, 3, 4, 5]


def test_tasks_are_what_the_docstring_says():
  rs = np.random.RandomState(0)
  sort = train.make_sorting_data(rs, 4, 6, 5)
  np.testing.assert_array_equal(sort["targets"], np.sort(sort["tokens"], 1))
  copy = train.make_copy_data(rs, 4, 6, 5)
  np.testing.assert_array_equal(copy["targets"][:, 6:], copy["tokens"][:, :6])
  assert np.all(copy["tokens"][:, 6:] == 0) and np.all(copy["tokens"][:, :6] > 0)
  images = train.make_shape_images(rs, 64, 16)["images"]
  assert images.shape == (64, 16, 16, 1) and images.dtype == np.float32
  assert images.min() >= -1 and images.max() <= 1
  assert np.all(images.std(axis=(1, 2, 3)) > 0.05)  # every image has a shape
  np.testing.assert_array_equal(
      train.unpatchify(train.patchify(jnp.asarray(images)), 16), images)


_FSDP_SCRIPT = r"""
import json, sys
from absl import flags
import jax
from experiments import train

assert jax.device_count() == 8, jax.devices()
out = {}
flags.FLAGS(["train"] + sys.argv[1:])
result = train.train()
# --model_dim=16: the MLP's [16, 64] weights (1024 elements) are split 8 ways.
NAME = [k for k in result.params if k.endswith("block_0/mlp/w_in")]
assert len(NAME) == 1, list(result.params)
w = result.params[NAME[0]]["w"]
out["spec"] = list(w.sharding.spec)
out["shard_shape"] = list(w.addressable_shards[0].data.shape)
out["step"] = result.step
# The job's own init creates them split (no device holds them all).
example = {"tokens": jax.numpy.zeros((8, 8), "int32"),
           "targets": jax.numpy.zeros((8, 8), "int32")}
init = train.init_params(train.make_task("transformer").net,
                         jax.random.PRNGKey(0), example, "fsdp")
w = init[NAME[0]]["w"]
out["init_shard_shape"] = list(w.addressable_shards[0].data.shape)
flags.FLAGS.unparse_flags()
flags.FLAGS(["train", "--batch_size=12", "--num_examples=32"])
try:
  train.main([])
except SystemExit as e:
  out["exit"] = str(e.code)
print("RESULT " + json.dumps(out))
"""


def test_fsdp_and_the_device_count_on_8_devices(tmp_path):
  """--parameter_sharding=fsdp reaches fit() (the parameters come back split
  over the 8 devices); a batch size the devices cannot split is one line."""
  out = simulated_devices.run(
      _FSDP_SCRIPT, *_TINY, "--model=transformer", "--steps=2", "--log_every=2",
      "--parameter_sharding=fsdp", f"--output_dir={tmp_path}")
  assert out["step"] == 2
  assert out["spec"] == [None, "data"]
  assert out["shard_shape"] == out["init_shard_shape"] == [16, 8]
  assert out["exit"] == ("FATAL Flags error: --batch_size=12 must be a multiple"
                         " of the device count 8")
