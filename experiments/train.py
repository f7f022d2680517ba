r"""The main training job: a small Transformer learns to sort, with `fit()`.

    JAX_PLATFORMS=cpu python -m experiments.train --steps=300 \
        --output_dir=/tmp/probjax_hk_train

Run the same command again with a larger `--steps` (e.g. 600) and it resumes
from the newest checkpoint in `--output_dir/checkpoints`, continuing the step
count, the data order and the loss history exactly where they stopped
(Ctrl-C also leaves a checkpoint). `--stream` feeds freshly generated batches
through `fit()`'s prefetching stream instead of an in-memory data set.

The task needs no download: each example is `--seq_len` random tokens from a
vocabulary of `--vocab`, and the target at position t is the t-th smallest
token (the sequence sorted). A bidirectional Transformer must count, over the
whole sequence, how many tokens lie below each value, so the per-token
cross-entropy falls from log(vocab) (chance) towards zero only as attention
learns to do that. Only `--model=transformer` exists yet.

Writes to `--output_dir`: `checkpoints/` (orbax, the last
`--keep_checkpoints`), `history.json` (loss per step, validation loss) and,
when matplotlib is installed, `loss.png`.

Several hosts (one process per host, all devices of all hosts in one mesh;
`--output_dir` on a file system every host sees):

    python -m experiments.train --distributed \
        --coordinator_address=host0:1234 --num_processes=2 --process_id=$RANK \
        --output_dir=/shared/probjax_hk_train
"""

import json
import os
import tempfile
import time

from absl import app
from absl import flags
from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import probjax_hk as pk

_MODEL = flags.DEFINE_enum("model", "transformer", ["transformer"],
                           "Which model to train.")
_STEPS = flags.DEFINE_integer("steps", 300, "Total training steps.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Sequences per step.")
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", None, "Checkpoints and history; default a new temp dir.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 16, "Tokens per sequence.")
_VOCAB = flags.DEFINE_integer("vocab", 8, "Number of token values.")
_NUM_EXAMPLES = flags.DEFINE_integer(
    "num_examples", 8192, "In-memory training set size (without --stream).")
_STREAM = flags.DEFINE_bool(
    "stream", False, "Train on an endless generated stream instead.")
_MODEL_DIM = flags.DEFINE_integer("model_dim", 64, "Transformer width D.")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 4, "Attention heads.")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 2, "Transformer blocks.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 3e-3, "Adam's peak rate.")
_DECAY_STEPS = flags.DEFINE_integer(
    "decay_steps", 2000, "Length of the warmup-cosine learning-rate schedule.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Activation dtype (parameters stay float32).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 100, "Steps between evals.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 25, "Steps between printouts.")
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 100, "Steps between checkpoints.")
_KEEP_CHECKPOINTS = flags.DEFINE_integer("keep_checkpoints", 2,
                                         "Checkpoints kept.")
_RESUME = flags.DEFINE_bool("resume", True,
                            "Continue from the newest checkpoint, if any.")
_SEED = flags.DEFINE_integer("seed", 0, "Drives data, init and order.")
_PROGRESS = flags.DEFINE_bool("progress", False, "Show a tqdm progress bar.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() first (several"
    " hosts; the coordinator flags below, or auto-detection on SLURM/TPU).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Process count.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process' index.")


def make_sorting_data(rng: np.random.RandomState, num_examples: int,
                      seq_len: int, vocab: int) -> dict[str, np.ndarray]:
  """tokens [N, T] int32 and targets [N, T] = each row of tokens sorted."""
  tokens = rng.randint(0, vocab, size=(num_examples, seq_len)).astype(np.int32)
  return {"tokens": tokens, "targets": np.sort(tokens, axis=1)}


def sorting_stream(seed: int, batch_size: int, seq_len: int, vocab: int):
  """An endless generator of fresh sorting batches (host numpy).

  With several processes each one yields its own rows: batch_size / P of them,
  from its own seed.
  """
  rng = np.random.RandomState([seed, jax.process_index()])
  while True:
    yield make_sorting_data(rng, batch_size // jax.process_count(), seq_len,
                            vocab)


def make_loss(seq_len: int, vocab: int, model_dim: int, num_heads: int,
              num_layers: int, dtype) -> hk.Transformed:
  """hk.transform of batch -> (mean cross-entropy, {'accuracy'})."""

  def loss(batch):
    x = jax.nn.one_hot(batch["tokens"], vocab, dtype=dtype)  # [B, T, V]
    position = hk.get_parameter("position", [seq_len, model_dim], jnp.float32,
                                init=hk.initializers.TruncatedNormal(0.02))
    x = pk.Linear(model_dim, name="embed")(x) + position.astype(dtype)
    h = pk.Transformer(model_dim, num_heads, num_layers, is_causal=False)(
        x, is_training=True)  # [B, T, D]
    logits = pk.Linear(vocab, name="head")(h).astype(jnp.float32)  # [B, T, V]
    labels = batch["targets"]  # [B, T]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return jnp.mean(ce), {"accuracy": accuracy}

  return hk.transform(loss)


class _PrintLoss(pk.training.Callback):
  """Prints the loss every `every` steps and each validation loss."""

  def __init__(self, every: int):
    self.every = every
    self.start = time.perf_counter()

  def on_train_begin(self, step):
    if step:
      print(f"resumed from the checkpoint at step {step}", flush=True)

  def on_step_end(self, step, metrics):
    if step % self.every == 0:
      print(f"step {step:5d}  loss {metrics['loss']:.4f}  accuracy"
            f" {metrics['accuracy']:.3f}  ({time.perf_counter() - self.start:.1f}"
            " s)", flush=True)

  def on_eval_end(self, step, metrics):
    print(f"step {step:5d}  validation loss {metrics['val_loss']:.4f}",
          flush=True)


def _write_plot(history: dict, path: str) -> bool:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(history["step"], history["loss"], label="train")
  if "val_loss" in history:
    ax.plot(history["val_step"], history["val_loss"], "o-", label="validation")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy")
  ax.legend()
  fig.savefig(path, dpi=100, bbox_inches="tight")
  plt.close(fig)
  return True


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO
    logging.set_verbosity(logging.WARNING)
  if _DISTRIBUTED.value:
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value,
                               _PROCESS_ID.value)
  output_dir = _OUTPUT_DIR.value or tempfile.mkdtemp(prefix="probjax_hk_train_")
  os.makedirs(output_dir, exist_ok=True)
  seq_len, vocab = _SEQ_LEN.value, _VOCAB.value
  dtype = jnp.dtype(_DTYPE.value)
  net = make_loss(seq_len, vocab, _MODEL_DIM.value, _NUM_HEADS.value,
                  _NUM_LAYERS.value, dtype)
  rng = np.random.RandomState(_SEED.value)
  validation = make_sorting_data(rng, 512, seq_len, vocab)
  if _STREAM.value:
    data = sorting_stream(_SEED.value + 1, _BATCH_SIZE.value, seq_len, vocab)
  else:
    data = make_sorting_data(rng, _NUM_EXAMPLES.value, seq_len, vocab)
  # Independent of --steps: a resumed run with more steps follows the same
  # schedule as one uninterrupted run.
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, _LEARNING_RATE.value, 50, _DECAY_STEPS.value,
      _LEARNING_RATE.value / 10)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))

  print(f"sorting task: {seq_len} tokens of {vocab} values, chance loss"
        f" {np.log(vocab):.3f}; {jax.device_count()} {jax.default_backend()}"
        f" device(s); output in {output_dir}", flush=True)
  result = pk.fit_model(
      net, data, rng=_SEED.value, optimizer=optimizer,
      batch_size=_BATCH_SIZE.value, num_steps=_STEPS.value,
      validation_data=validation, eval_every=_EVAL_EVERY.value,
      callbacks=[_PrintLoss(_LOG_EVERY.value)],
      checkpoint_dir=os.path.join(output_dir, "checkpoints"),
      checkpoint_every=_CHECKPOINT_EVERY.value,
      keep_checkpoints=_KEEP_CHECKPOINTS.value, resume=_RESUME.value,
      progress=_PROGRESS.value, log_every=_LOG_EVERY.value)  # logs with -v 0

  history = {k: v.tolist() for k, v in result.history.items()}
  with open(os.path.join(output_dir, "history.json"), "w") as f:
    json.dump(history, f)
  plotted = _write_plot(history, os.path.join(output_dir, "loss.png"))
  loss = result.history["loss"]
  first = loss[: max(1, _LOG_EVERY.value)].mean() if len(loss) else float("nan")
  last = loss[-max(1, _LOG_EVERY.value):].mean() if len(loss) else float("nan")
  print(f"done: step {result.step}, loss {first:.4f} -> {last:.4f} (mean of"
        f" first/last {_LOG_EVERY.value} steps), {result.steps_per_sec:.1f}"
        f" steps/s", flush=True)
  print(f"checkpoints: {output_dir}/checkpoints; history:"
        f" {output_dir}/history.json"
        + (f"; loss curve: {output_dir}/loss.png" if plotted else
           " (install matplotlib for loss.png)"), flush=True)


if __name__ == "__main__":
  app.run(main)
