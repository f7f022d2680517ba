"""experiments/train.py's flags: every bad value is refused at parse time, in
one line naming the flag; every `--ssm_cell` builds its cell.

Parsing runs in this process (nothing compiles); two subprocesses show what a
user of `python -m experiments.train` sees.
"""

import os
import subprocess
import sys

from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import train
import probjax_hk as pk


def _parse(argv):
  flags.FLAGS.unparse_flags()
  try:
    flags.FLAGS(["train"] + argv)
  finally:
    flags.FLAGS.unparse_flags()


@pytest.mark.parametrize("argv, flag", [
    (["--steps=0"], "steps"),
    (["--steps=-1"], "steps"),
    (["--batch_size=0"], "batch_size"),
    (["--seq_len=0"], "seq_len"),
    (["--vocab=1"], "vocab"),
    (["--image_size=0"], "image_size"),
    (["--model=dit", "--image_size=6"], "image_size"),
    (["--model=unet", "--image_size=5"], "image_size"),
    (["--num_examples=0"], "num_examples"),
    (["--num_examples=63"], "num_examples"),  # below the default batch of 64
    (["--num_examples=16", "--batch_size=32"], "num_examples"),
    (["--num_validation=0"], "num_validation"),
    (["--model_dim=0"], "model_dim"),
    (["--num_heads=0"], "num_heads"),
    (["--num_heads=3"], "num_heads"),  # does not divide 64
    (["--model=ssm", "--ssm_cell=ssd", "--num_heads=3"], "num_heads"),
    (["--model=ssm", "--ssm_cell=gated_delta_net", "--model_dim=20",
      "--num_heads=8"], "num_heads"),
    (["--model=ssm", "--ssm_cell=mamba2", "--model_dim=12", "--num_heads=5"],
     "num_heads"),
    (["--model=unet", "--num_heads=3"], "num_heads"),  # 32 channels below
    (["--num_layers=0"], "num_layers"),
    (["--num_experts=0"], "num_experts"),
    (["--top_k=0"], "top_k"),
    (["--model=moe", "--top_k=5"], "top_k"),
    (["--ssm_cell=s4"], "ssm_cell"),
    (["--learning_rate=0"], "learning_rate"),
    (["--learning_rate=-1"], "learning_rate"),
    (["--learning_rate=nan"], "learning_rate"),
    (["--decay_steps=50"], "decay_steps"),
    (["--sample_steps=0"], "sample_steps"),
    (["--num_samples=0"], "num_samples"),
    (["--eval_every=0"], "eval_every"),
    (["--log_every=0"], "log_every"),
    (["--checkpoint_every=0"], "checkpoint_every"),
    (["--keep_checkpoints=0"], "keep_checkpoints"),
    (["--steps_per_call=0"], "steps_per_call"),
    (["--seed=-1"], "seed"),
    (["--seed=4294967295"], "seed"),
    (["--num_processes=0"], "num_processes"),
    (["--process_id=-1"], "process_id"),
    (["--num_processes=2", "--process_id=2"], "process_id"),
    (["--parameter_sharding=zero3"], "parameter_sharding"),
    (["--model=lm", "--num_heads=3"], "num_heads"),  # the Transformer's 64
    (["--model=lm", "--ssm_cell=mamba2", "--model_dim=12", "--num_heads=5"],
     "num_heads"),
    (["--sample_every=0"], "sample_every"),
    (["--sample_length=0"], "sample_length"),
    (["--temperature=-0.5"], "temperature"),
    (["--temperature=inf"], "temperature"),
    (["--sample_top_k=0"], "sample_top_k"),
    (["--sample_top_k=257"], "sample_top_k"),  # 256 byte values
    (["--prompt="], "prompt"),
])
def test_a_bad_value_is_refused_in_one_line_naming_the_flag(argv, flag):
  with pytest.raises(flags.IllegalFlagValueError) as error:
    _parse(argv)
  message = str(error.value)
  assert "\n" not in message
  assert f"--{flag}=" in message or f" {flag}=" in message, message


@pytest.mark.parametrize("argv", [
    [],
    ["--model=unet", "--image_size=6"],  # a multiple of 2 (two levels)
    ["--model=ssm", "--ssm_cell=lru", "--num_heads=3"],  # the lru has no heads
    ["--model=ssm", "--ssm_cell=mamba2", "--model_dim=12", "--num_heads=3"],
    ["--model=transformer", "--top_k=5"],  # a moe flag, unused here
    ["--num_examples=10", "--stream"],  # a stream needs no data set
    ["--num_examples=32", "--batch_size=32"],
    ["--model=unet", "--num_examples=32"],  # unet's default batch is 32
    ["--learning_rate=1e-9", "--decay_steps=51", "--seed=4294967294"],
    ["--num_processes=2", "--process_id=1", "--parameter_sharding=fsdp"],
    ["--model=lm", "--num_examples=32"],  # lm's default batch is 32
    ["--model=lm", "--ssm_cell=lru", "--num_heads=3"],  # the lru has no heads
    ["--model=lm", "--ssm_cell=mamba2", "--model_dim=12", "--num_heads=3"],
    ["--model=lm", "--temperature=0", "--sample_top_k=256", "--prompt=class"],
    ["--model=transformer", "--dtype=bfloat16"],
    ["--model=lm", "--dtype=bfloat16"],
])
def test_good_values_are_accepted(argv):
  _parse(argv)


def _user_runs(*argv):
  return subprocess.run(
      [sys.executable, "-m", "experiments.train", *argv], capture_output=True,
      text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)


@pytest.mark.parametrize("argv, line", [
    (["--batch_size=0"],
     "FATAL Flags parsing error: flag --batch_size=0: 0 is not a positive"
     " integer"),
    (["--model=dit", "--image_size=6"],
     "FATAL Flags parsing error: flags image_size=6, model=dit: --image_size"
     " must be a multiple of 4 for --model=dit, got 6"),
], ids=["a_bound", "two_flags"])
def test_the_user_sees_one_line_and_nothing_runs(argv, line):
  run = _user_runs(*argv)
  assert run.returncode == 1
  assert run.stdout == ""  # nothing trained (the job prints its first line)
  assert run.stderr.splitlines()[0] == line
  assert "Traceback" not in run.stderr


@pytest.mark.parametrize("cell", sorted(train.SSM_CELLS))
def test_every_ssm_cell_is_selectable(cell):
  """`--ssm_cell` builds that cell (its parameters are those of the cell built
  directly, `--num_heads` heads where it has heads) into a model whose loss
  traces to a scalar."""
  direct = {"lru": lambda: pk.LRUCell(name="cell"),
            "mamba": lambda: pk.MambaCell(name="cell"),
            "ssd": lambda: pk.SSDCell(4, name="cell"),
            "mamba2": lambda: pk.Mamba2Cell(head_dim=8, name="cell"),  # 32 / 4
            "gated_delta_net": lambda: pk.GatedDeltaNetCell(4, name="cell")}
  assert set(direct) == set(train.SSM_CELLS)
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["train", "--model=ssm", f"--ssm_cell={cell}", "--model_dim=16",
               "--num_heads=4", "--num_layers=1", "--seq_len=8"])
  try:
    task = train.make_task("ssm")
  finally:
    flags.FLAGS.unparse_flags()
  batch = task.make_data(np.random.RandomState(0), 2)
  params = jax.eval_shape(task.net.init, jax.random.key(0), batch)
  prefix = next(name for name in params if name.endswith("block_0/cell"))[:-4]
  built = {name[len(prefix):]: jax.tree.map(lambda x: x.shape, leaves)
           for name, leaves in params.items()
           if name == prefix + "cell" or name.startswith(prefix + "cell/")}
  expected = jax.eval_shape(hk.transform(lambda x: direct[cell]()(x)).init,
                            jax.random.key(0), jnp.zeros((2, 16, 16)))
  assert built == jax.tree.map(lambda x: x.shape, expected)
  loss, _ = jax.eval_shape(task.net.apply, params, jax.random.key(1), batch)
  assert loss.shape == ()


def test_an_unset_size_takes_the_default_and_a_zero_stays_zero():
  """Only None is unset (`value or default` would read `--batch_size=0` as
  unset and train with 64); a 0 reaches the validator above."""
  assert train.batch_size_of("transformer", None) == 64
  assert train.batch_size_of("unet", None) == 32
  assert train.batch_size_of("transformer", 0) == 0
  assert train.model_dim_of("unet", None) == 16
  assert train.model_dim_of("dit", 0) == 0
  assert train.batch_size_of("lm", None) == 32
  assert train.seq_len_of("lm", None) == 128
  assert train.seq_len_of("ssm", None) == 16
  assert train.seq_len_of("lm", 0) == 0


def test_the_ssm_cell_is_lru_for_ssm_and_the_transformer_for_lm_when_unset():
  assert train.ssm_cell_of("ssm", None) == "lru"
  assert train.ssm_cell_of("ssm", "mamba2") == "mamba2"
  assert train.ssm_cell_of("lm", None) is None
  assert train.ssm_cell_of("lm", "mamba2") == "mamba2"
  assert train.ssm_cell_of("transformer", "mamba2") is None
