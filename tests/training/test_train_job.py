"""experiments/train.py: every `--model` trains a few steps and writes its files.

The job runs in this process (its `train()` after parsing tiny flags), so the
models compile once each at toy sizes.
"""

import json
import os

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import train

_TINY = ["--steps=3", "--batch_size=8", "--num_examples=32",
         "--num_validation=16", "--seq_len=8", "--model_dim=16",
         "--num_heads=2", "--num_layers=1", "--image_size=4",
         "--num_samples=4", "--sample_steps=2", "--eval_every=3",
         "--checkpoint_every=3", "--log_every=1"]


def _run(argv):
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["train"] + argv)
  try:
    return train.train()
  finally:
    flags.FLAGS.unparse_flags()


@pytest.mark.parametrize("model", train.MODELS)
def test_each_model_trains_and_writes_checkpoint_and_pictures(model, tmp_path,
                                                              capsys):
  result = _run(_TINY + [f"--model={model}", f"--output_dir={tmp_path}"])
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
  printed = capsys.readouterr().out
  assert "pictures: " + " ".join(str(tmp_path / p) for p in pictures) in printed
  if model == "moe":  # the router's state reaches the loss and the history
    assert "load_balance_loss" in history and result.state is not None
    assert history["loss"][0] > history["cross_entropy"][0]
  if model == "transformer":  # the same command with more steps resumes
    result = _run(_TINY + [f"--model={model}", f"--output_dir={tmp_path}",
                           "--steps=5"])
    assert result.step == 5
    assert "resumed from the checkpoint at step 3" in capsys.readouterr().out
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


def test_ddim_with_the_exact_noise_of_one_image_recovers_it():
  """For data = one image x0, eps(x_t, t) = (x_t - sqrt(ab) x0) / sqrt(1 - ab)
  is the exact noise predictor; deterministic DDIM must land on x0."""
  x0 = jnp.asarray(train.make_shape_images(np.random.RandomState(1), 1, 8)
                   ["images"])  # [1, 8, 8, 1]

  def exact_noise(params, x, t_steps):
    del params
    ab = train.alpha_bar(t_steps / 1000.0)[:, None, None, None]
    return (x - jnp.sqrt(ab) * x0) / jnp.sqrt(1.0 - ab)

  out = train.ddim_sample(exact_noise, None, jax.random.PRNGKey(0),
                          (3, 8, 8, 1), num_steps=10)
  np.testing.assert_allclose(out, jnp.broadcast_to(x0, out.shape), atol=1e-3)
