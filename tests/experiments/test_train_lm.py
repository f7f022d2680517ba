"""experiments/train.py --model=lm: a character model on the standard
library's source, trained in one fit() call that samples from a callback at
each validation pass.

The job runs in this process (its `train()` after parsing tiny flags); each
run compiles a one-layer model of width 16.
"""

import contextlib
import io
import json
import math
import os

from absl import flags
import numpy as np
import pytest

from experiments import train

_TINY = ["--model=lm", "--batch_size=8", "--num_examples=64",
         "--num_validation=16", "--seq_len=16", "--model_dim=16",
         "--num_heads=2", "--num_layers=1", "--learning_rate=0.03",
         "--checkpoint_every=100", "--eval_every=100", "--log_every=5",
         "--sample_every=10", "--sample_length=24"]


def _run(argv):
  """(train()'s result, what it printed) under `argv`."""
  screen = io.StringIO()
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["train"] + argv)
  try:
    with contextlib.redirect_stdout(screen), contextlib.redirect_stderr(screen):
      result = train.train()
  finally:
    flags.FLAGS.unparse_flags()
  return result, screen.getvalue()


def _read(path):
  with open(path) as f:
    return json.load(f)


def _check_samples(path, printed, steps, length, prompt="def ", first=0):
  """samples.json holds a sample of `length` bytes at each of `steps`, each
  from the `first` on printed as its text after a header naming its step and
  length."""
  samples = _read(path / "samples.json")
  assert samples["step"] == steps
  prompt_tokens = list(prompt.encode())
  for step, tokens, text in zip(samples["step"], samples["tokens"],
                                samples["text"]):
    assert len(tokens) == length
    assert all(0 <= t < train.LM_VOCAB for t in tokens)
    assert text == train.decode_text(np.array(prompt_tokens + tokens))
    assert text.startswith(prompt)
    header = (f"step {step:5d}  sample (temperature 0.8, {length} bytes"
              " after the prompt):")
    assert (f"{header}\n{text}\n" in printed) == (step >= first), printed


def _mean_loss(history, first: bool, n: int = 5):
  loss = np.asarray(history["loss"])
  return loss[:n].mean() if first else loss[-n:].mean()


def test_the_transformer_learns_and_prints_samples_as_it_trains(tmp_path):
  result, printed = _run(_TINY + ["--steps=20", f"--output_dir={tmp_path}"])
  assert result.step == 20
  history = _read(tmp_path / "history.json")
  assert history["step"] == list(range(1, 21))
  # Bits per character: about 8 (chance) at first, then falling.
  assert abs(_mean_loss(history, True) - math.log2(256)) < 1.5
  assert _mean_loss(history, False) < _mean_loss(history, True) - 2
  # A validation pass with its sample every --sample_every steps (not at
  # --eval_every=100).
  assert history["val_step"] == [10, 20]
  assert history["val_loss"][-1] < history["val_loss"][0] - 1
  assert "step    20  loss " in printed and " bits/char" in printed
  assert "step    10  validation loss " in printed
  assert "resumed" not in printed
  _check_samples(tmp_path, printed, [10, 20], 24)
  assert f"samples: {tmp_path / 'samples.json'}" in printed

  # More steps resume from the last checkpoint and keep the earlier samples;
  # the end, between two multiples of --sample_every, has one too.
  result, printed = _run(_TINY + ["--steps=25", f"--output_dir={tmp_path}"])
  assert result.step == 25
  assert printed.count("resumed from the checkpoint at step 20") == 1
  _check_samples(tmp_path, printed, [10, 20, 25], 24, first=25)
  # Again at the last step: no training, one validation pass, its sample
  # replaces the one of step 25 (the same parameters and key).
  again, printed = _run(_TINY + ["--steps=25", f"--output_dir={tmp_path}"])
  assert again.step == 25
  _check_samples(tmp_path, printed, [10, 20, 25], 24, first=25)


def test_an_ssm_body_learns_and_samples(tmp_path):
  result, printed = _run(_TINY + ["--steps=20", "--sample_every=100",
                                  "--ssm_cell=lru",
                                  "--sample_length=7", "--prompt=import ",
                                  f"--output_dir={tmp_path}"])
  assert "an SSMModel (lru)" in printed
  assert result.step == 20
  assert any("block_0/cell" in name for name in result.params)
  history = _read(tmp_path / "history.json")
  assert _mean_loss(history, False) < _mean_loss(history, True) - 1
  _check_samples(tmp_path, printed, [20], 7, prompt="import ")


def test_text_windows_predict_the_next_byte():
  text = train.stdlib_text(("textwrap",))
  assert text.dtype == np.uint8
  assert bytes(text[:200]).decode().startswith('"""Text wrapping')
  data = train.make_text_windows(np.random.RandomState(0), 32, text, 10)
  assert data["tokens"].shape == data["targets"].shape == (32, 10)
  assert data["tokens"].dtype == np.int32
  np.testing.assert_array_equal(data["tokens"][:, 1:], data["targets"][:, :-1])
  as_bytes = bytes(text)
  for tokens, targets in zip(data["tokens"], data["targets"]):
    window = bytes(tokens.astype(np.uint8)) + bytes([targets[-1]])
    assert window in as_bytes
  with pytest.raises(ValueError, match="seq_len"):
    train.make_text_windows(np.random.RandomState(0), 1, text[:10], 10)


def test_samples_print_as_text_with_nothing_that_acts_on_a_terminal():
  tokens = np.array(list("def f(x):\n\treturn x\r".encode()) + [0x1B, 0xFF]
                    + list("é".encode()))
  assert train.decode_text(tokens) == "def f(x):\n\treturn x\ufffd\ufffd\ufffdé"


def test_a_seq_len_longer_than_the_held_out_text_is_refused(tmp_path):
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["train", "--model=lm", "--seq_len=1000000"])
  try:
    with pytest.raises(flags.ValidationError, match=r"--seq_len=1000000 must"
                       r" be below \d+, the bytes of the held-out text"):
      train.make_task("lm")
  finally:
    flags.FLAGS.unparse_flags()
