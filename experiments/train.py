r"""The main training job: one of the package's models on a generated task, with `fit()`.

    JAX_PLATFORMS=cpu python -m experiments.train --model=transformer \
        --steps=300 --output_dir=/tmp/probjax_hk_train

`--model` picks the model and its task; none needs a download:

  transformer  a bidirectional `Transformer` learns to sort: each example is
               `--seq_len` random tokens from a vocabulary of `--vocab`, the
               target at position t is the t-th smallest token. It must count,
               over the whole sequence, how many tokens lie below each value, so
               the per-token cross-entropy falls from log(vocab) (chance)
               towards zero only as attention learns to do that.
  moe          the same sorting task with a Transformer-like stack whose MLPs
               are top-k `MoELayer`s (`hk.transform_with_state`: the layers'
               `aux_loss` state is added to the loss, the load-balance loss is
               logged).
  ssm          a causal `SSMModel` learns to copy: `--seq_len` random tokens,
               then as many blanks, during which it must emit the tokens again
               (loss on the second half only). `--ssm_cell` picks the cell:
               lru, mamba, ssd, mamba2 or gated_delta_net (the multi-head
               cells get `--num_heads` heads).
  dit          a `DiffusionTransformer` over the 4x4 patches (tokens) of
               `--image_size`^2 grey images of random rectangles, discs and
               gradients, drawn procedurally; DDPM noise prediction (cosine
               schedule); samples with a deterministic DDIM sampler (both
               from `probjax_hk.diffusion`).
  unet         a `UNet` (NHWC) on the same images and objective.
  lm           a character-level causal language model on Python source that
               ships with Python (the standard-library modules in
               `LM_TRAIN_MODULES`; `LM_VALIDATION_MODULES` is held out for
               validation), one byte per token (256 values; `--vocab` is
               unused): windows of `--seq_len` bytes, next-byte cross-entropy
               in bits per character (8 is chance). A `pk.TokenModel` around
               a causal `Transformer` with rotary positions, or around an
               `SSMModel` when `--ssm_cell` is given. Every `--sample_every`
               steps and at the end it prints `--sample_length` characters
               sampled with `pk.generate` after `--prompt` (`--temperature`,
               `--sample_top_k`), as they come out: the text grows more
               Python-like as the loss falls. `--dtype=bfloat16` trains and
               samples in bfloat16 (`TokenModel(..., dtype=)`: float32
               parameters and logits).

A character model on the CPU (300 steps took two to three minutes on two
cores: the loss fell from 8 bits per character to about 2 on the training
text and 2.6-2.7 on the held-out module, and the samples took up
indentation, `self.`, `return` and `def`):

    JAX_PLATFORMS=cpu python -m experiments.train --model=lm --steps=300
    JAX_PLATFORMS=cpu python -m experiments.train --model=lm --ssm_cell=mamba2

Every numeric flag is checked before anything runs (a bad value ends the
program with one line naming the flag). `--parameter_sharding=fsdp` splits the
parameters and optimizer state over the devices (fit()'s 'fsdp'); the default
'replicated' keeps a copy on each. `--progress` shows a tqdm bar, with the
printed lines above it.

Run the same command again with a larger `--steps` (e.g. 600) and it resumes
from the newest checkpoint in `--output_dir/checkpoints`, continuing the step
count, the data order and the loss history exactly where they stopped
(Ctrl-C also leaves a checkpoint). `--stream` feeds freshly generated batches
through `fit()`'s prefetching stream instead of an in-memory data set.

Writes to `--output_dir`: `checkpoints/` (orbax, the last
`--keep_checkpoints`; the final one is the trained model), `history.json`
(loss per step, validation loss), `loss.png` and, for dit and unet,
`samples.png` (training images beside `--num_samples` samples); for lm,
`samples.json` (each sample's step, generated tokens and printed text).

lm samples inside its one `fit()` call, from a callback that gets the
parameters at each validation pass (`Callback.on_eval_params`): its
validation passes come every `--sample_every` steps (`--eval_every` is unused)
and at the end, each with its validation loss and a sample.

Several hosts (one process per host, all devices of all hosts in one mesh;
`--output_dir` on a file system every host sees):

    python -m experiments.train --distributed \
        --coordinator_address=host0:1234 --num_processes=2 --process_id=$RANK \
        --output_dir=/shared/probjax_hk_train
"""

import dataclasses
import functools
import importlib
import inspect
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Callable

from absl import app
from absl import flags
from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

import probjax_hk as pk
from probjax_hk import diffusion

MODELS = ("transformer", "moe", "ssm", "dit", "unet", "lm")
SSM_CELLS = {"lru": pk.LRUCell, "mamba": pk.MambaCell, "ssd": pk.SSDCell,
             "mamba2": pk.Mamba2Cell, "gated_delta_net": pk.GatedDeltaNetCell}
PATCH = 4  # dit: pixels per side of a patch (token)
UNET_LEVELS = (1, 2)  # unet: each level's channels, in units of --model_dim
WARMUP_STEPS = 50  # the learning rate's linear warmup, inside --decay_steps
MAX_SEED = 2 ** 32 - 2  # numpy's seeds stop at 2**32 - 1; the stream uses seed + 1
# lm: the text, Python source from the standard library (fixed lists, so every
# run of one Python version reads the same bytes).
LM_TRAIN_MODULES = ("argparse", "calendar", "contextlib", "copy", "dataclasses",
                    "functools", "heapq", "json.decoder", "json.encoder",
                    "pprint", "string")
LM_VALIDATION_MODULES = ("textwrap",)
LM_VOCAB = 256  # lm: one token per byte of the UTF-8 text

_MODEL = flags.DEFINE_enum("model", "transformer", MODELS,
                           "Which model (and task) to train.")
_STEPS = flags.DEFINE_integer("steps", 300, "Total training steps.",
                              lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", None, "Examples per step (default 64; unet, lm 32); a multiple"
    " of the device count.", lower_bound=1)
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", None, "Checkpoints, history and pictures; default a new temp"
    " dir.")
_SEQ_LEN = flags.DEFINE_integer(
    "seq_len", None, "Tokens per sequence (default 16; ssm: tokens to copy;"
    " lm: characters per training window, default 128).", lower_bound=1)
_VOCAB = flags.DEFINE_integer("vocab", 8, "Number of token values.",
                              lower_bound=2)
_IMAGE_SIZE = flags.DEFINE_integer(
    "image_size", 16, f"Side of the square images (dit: a multiple of the"
    f" {PATCH}-pixel patch; unet: of 2 ** (levels - 1) ="
    f" {2 ** (len(UNET_LEVELS) - 1)}).", lower_bound=1)
_NUM_EXAMPLES = flags.DEFINE_integer(
    "num_examples", 8192, "In-memory training set size (without --stream; at"
    " least --batch_size).", lower_bound=1)
_NUM_VALIDATION = flags.DEFINE_integer("num_validation", 512,
                                       "Validation set size.", lower_bound=1)
_STREAM = flags.DEFINE_bool(
    "stream", False, "Train on an endless generated stream instead.")
_MODEL_DIM = flags.DEFINE_integer(
    "model_dim", None, "Width D (default 64; unet: the first level's"
    " channels, default 16, doubled at the second level).", lower_bound=1)
_NUM_HEADS = flags.DEFINE_integer(
    "num_heads", 4, "Attention heads (ssm: the heads of ssd, mamba2 and"
    " gated_delta_net); must divide the width they split.", lower_bound=1)
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 2, "Blocks (not unet).",
                                   lower_bound=1)
_NUM_EXPERTS = flags.DEFINE_integer("num_experts", 4, "moe: experts per layer.",
                                    lower_bound=1)
_TOP_K = flags.DEFINE_integer("top_k", 2, "moe: experts per token (at most"
                              " --num_experts).", lower_bound=1)
_SSM_CELL = flags.DEFINE_enum(
    "ssm_cell", None, list(SSM_CELLS), "ssm: the recurrent cell (default lru);"
    " lm: an SSMModel with this cell instead of the Transformer.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 3e-3,
                                    "Adam's peak rate (positive).")
_DECAY_STEPS = flags.DEFINE_integer(
    "decay_steps", 2000, f"Length of the warmup-cosine learning-rate schedule"
    f" (more than its {WARMUP_STEPS} warmup steps).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Activation dtype (parameters stay float32).")
_PARAMETER_SHARDING = flags.DEFINE_enum(
    "parameter_sharding", "replicated", ["replicated", "fsdp"],
    "fit()'s parameter_sharding: a copy of the parameters and optimizer state"
    " per device, or each large one split over the devices.")
_SAMPLE_STEPS = flags.DEFINE_integer(
    "sample_steps", 50, "dit/unet: DDIM steps of the sampler.", lower_bound=1)
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 16,
                                    "dit/unet: samples drawn at the end.",
                                    lower_bound=1)
_SAMPLE_EVERY = flags.DEFINE_integer(
    "sample_every", 100, "lm: steps between printed samples (one more at the"
    " end).", lower_bound=1)
_SAMPLE_LENGTH = flags.DEFINE_integer(
    "sample_length", 120, "lm: characters (bytes) per sample, after the"
    " prompt (the Transformer reads positions up to --seq_len best, the ones"
    " it trained on).", lower_bound=1)
_PROMPT = flags.DEFINE_string("prompt", "def ",
                              "lm: the text every sample starts from.")
_TEMPERATURE = flags.DEFINE_float(
    "temperature", 0.8, "lm: sampling temperature (>= 0; 0 decodes"
    " greedily).")
_SAMPLE_TOP_K = flags.DEFINE_integer(
    "sample_top_k", None, f"lm: sample among the k most likely bytes only"
    f" (default: all {LM_VOCAB}).", lower_bound=1, upper_bound=LM_VOCAB)
_EVAL_EVERY = flags.DEFINE_integer(
    "eval_every", 100, "Steps between evals (lm: --sample_every instead).",
    lower_bound=1)
_LOG_EVERY = flags.DEFINE_integer("log_every", 25, "Steps between printouts.",
                                  lower_bound=1)
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 100, "Steps between checkpoints.", lower_bound=1)
_KEEP_CHECKPOINTS = flags.DEFINE_integer("keep_checkpoints", 2,
                                         "Checkpoints kept.", lower_bound=1)
_RESUME = flags.DEFINE_bool("resume", True,
                            "Continue from the newest checkpoint, if any.")
_STEPS_PER_CALL = flags.DEFINE_integer(
    "steps_per_call", 1, "Steps per compiled call (fit's steps_per_call).",
    lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Drives data, init and order.",
                             lower_bound=0, upper_bound=MAX_SEED)
_PROGRESS = flags.DEFINE_bool("progress", False, "Show a tqdm progress bar.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() first (several"
    " hosts; the coordinator flags below, or auto-detection on SLURM/TPU).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Process count.",
                                      lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process' index.",
                                   lower_bound=0)


# --- flag checks: each failure is one line naming the flag --------------------

def batch_size_of(model: str, flag_value: int | None) -> int:
  """`--batch_size`, or `model`'s default when unset (`is None`, not
  falsiness: a 0 must not become the default)."""
  if flag_value is not None:
    return flag_value
  return 32 if model in ("unet", "lm") else 64


def model_dim_of(model: str, flag_value: int | None) -> int:
  """`--model_dim`, or `model`'s default when unset."""
  return (16 if model == "unet" else 64) if flag_value is None else flag_value


def seq_len_of(model: str, flag_value: int | None) -> int:
  """`--seq_len`, or `model`'s default when unset."""
  return (128 if model == "lm" else 16) if flag_value is None else flag_value


def ssm_cell_of(model: str, flag_value: str | None) -> str | None:
  """The SSM cell `model` uses: `--ssm_cell` (ssm: lru when unset), None for a
  model without one (lm without `--ssm_cell`: the Transformer)."""
  if model == "ssm":
    return flag_value or "lru"
  return flag_value if model == "lm" else None


def image_size_multiple(model: str) -> int:
  """What `--image_size` must be a multiple of for `model` (1: any)."""
  if model == "dit":
    return PATCH
  if model == "unet":
    return 2 ** (len(UNET_LEVELS) - 1)  # one 2x downsampling per extra level
  return 1


def head_width(model: str, ssm_cell: str, model_dim: int) -> int | None:
  """The width `--num_heads` splits (None: the model has no heads)."""
  if model == "unet":
    return UNET_LEVELS[-1] * model_dim  # attention at the lowest resolution
  cell = ssm_cell_of(model, ssm_cell)
  if cell is not None:
    return {"ssd": model_dim, "gated_delta_net": model_dim,
            "mamba2": 2 * model_dim}.get(cell)  # mamba2: expand 2
  return model_dim


def _fail(message: str) -> None:
  raise flags.ValidationError(message)


@flags.validator("learning_rate", "must be a positive number")
def _check_learning_rate(value):
  return math.isfinite(value) and value > 0


@flags.validator("decay_steps", f"must exceed the {WARMUP_STEPS} warmup steps")
def _check_decay_steps(value):
  return value > WARMUP_STEPS


@flags.multi_flags_validator(["image_size", "model"])
def _check_image_size(values):
  m = image_size_multiple(values["model"])
  if values["image_size"] % m:
    _fail(f"--image_size must be a multiple of {m} for --model="
          f"{values['model']}, got {values['image_size']}")
  return True


@flags.multi_flags_validator(["num_heads", "model_dim", "model", "ssm_cell"])
def _check_num_heads(values):
  model_dim = model_dim_of(values["model"], values["model_dim"])
  width = head_width(values["model"], values["ssm_cell"], model_dim)
  if width is not None and width % values["num_heads"]:
    _fail(f"--num_heads={values['num_heads']} must divide the width {width}"
          f" its heads split (--model_dim={model_dim}, --model="
          f"{values['model']})")
  return True


@flags.multi_flags_validator(["top_k", "num_experts", "model"])
def _check_top_k(values):
  if values["model"] == "moe" and values["top_k"] > values["num_experts"]:
    _fail(f"--top_k={values['top_k']} must be at most"
          f" --num_experts={values['num_experts']}")
  return True


@flags.multi_flags_validator(["num_examples", "batch_size", "model", "stream"])
def _check_num_examples(values):
  batch_size = batch_size_of(values["model"], values["batch_size"])
  if not values["stream"] and values["num_examples"] < batch_size:
    _fail(f"--num_examples={values['num_examples']} must be at least the"
          f" batch size {batch_size} (--batch_size)")
  return True


@flags.validator("temperature", "must be a number >= 0 (0: greedy)")
def _check_temperature(value):
  return math.isfinite(value) and value >= 0


@flags.validator("prompt", "must be non-empty text (lm samples continue it)")
def _check_prompt(value):
  return bool(value)


@flags.multi_flags_validator(["process_id", "num_processes"])
def _check_process_id(values):
  process_id, count = values["process_id"], values["num_processes"]
  if process_id is not None and count is not None and process_id >= count:
    _fail(f"--process_id={process_id} must be below --num_processes={count}")
  return True


# --- data ---------------------------------------------------------------------

def make_sorting_data(rng: np.random.RandomState, num_examples: int,
                      seq_len: int, vocab: int) -> dict[str, np.ndarray]:
  """tokens [N, T] int32 and targets [N, T] = each row of tokens sorted."""
  tokens = rng.randint(0, vocab, size=(num_examples, seq_len)).astype(np.int32)
  return {"tokens": tokens, "targets": np.sort(tokens, axis=1)}


def make_copy_data(rng: np.random.RandomState, num_examples: int,
                   seq_len: int, vocab: int) -> dict[str, np.ndarray]:
  """tokens [N, 2T]: T tokens in 1..vocab-1 then T blanks (0); targets [N, 2T]:
  blanks, then the first T tokens again."""
  first = rng.randint(1, vocab, size=(num_examples, seq_len)).astype(np.int32)
  blank = np.zeros_like(first)
  return {"tokens": np.concatenate([first, blank], axis=1),
          "targets": np.concatenate([blank, first], axis=1)}


def stdlib_text(modules: tuple[str, ...]) -> np.ndarray:
  """The UTF-8 bytes [L] (uint8) of the source of standard-library `modules`,
  in the given order, each followed by a blank line."""
  return np.frombuffer(b"".join(
      inspect.getsource(importlib.import_module(name)).encode("utf-8") + b"\n\n"
      for name in modules), np.uint8)


def make_text_windows(rng: np.random.RandomState, num_examples: int,
                      text: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
  """tokens [N, T] int32: windows of `text` at random offsets; targets [N, T]:
  each window shifted by one byte (the byte after each token)."""
  if len(text) <= seq_len:
    raise ValueError(f"`seq_len` must be below the text's {len(text)} bytes,"
                     f" got {seq_len=}")
  starts = rng.randint(0, len(text) - seq_len, size=num_examples)  # [N]
  windows = text[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return {"tokens": windows[:, :-1], "targets": windows[:, 1:]}


def decode_text(tokens: np.ndarray) -> str:
  """Bytes [L] (ints in [0, 256)) -> printable text: UTF-8 with
  errors='replace', and every control character but newline and tab shown as
  U+FFFD too (a sampled escape or carriage return must not act on the
  terminal)."""
  text = bytes(np.asarray(tokens, np.uint8)).decode("utf-8", errors="replace")
  return text.translate(_CONTROL_CHARACTERS)


_CONTROL_CHARACTERS = {c: "\ufffd" for c in
                       [*range(0x20), *range(0x7F, 0xA0)] if c not in (9, 10)}


def make_shape_images(rng: np.random.RandomState, num_examples: int,
                      size: int) -> dict[str, np.ndarray]:
  """images [N, size, size, 1] float32 in [-1, 1]: a faint linear gradient and
  one to three axis-aligned rectangles or discs of random grey levels."""
  yy, xx = np.meshgrid(np.linspace(0, 1, size), np.linspace(0, 1, size),
                       indexing="ij")  # [S, S]
  n = num_examples
  angle = rng.uniform(0, 2 * np.pi, (n, 1, 1))
  amplitude = rng.uniform(0.0, 0.4, (n, 1, 1))
  images = amplitude * (np.cos(angle) * xx + np.sin(angle) * yy)  # [N, S, S]
  images = images - images.min(axis=(1, 2), keepdims=True)
  for k in range(3):
    present = (rng.uniform(size=(n, 1, 1)) < (1.0 if k == 0 else 0.5))
    level = rng.uniform(0.4, 1.0, (n, 1, 1))
    cy, cx = rng.uniform(0.15, 0.85, (2, n, 1, 1))
    hy, hx = rng.uniform(0.08, 0.3, (2, n, 1, 1))
    rect = (np.abs(yy - cy) <= hy) & (np.abs(xx - cx) <= hx)
    disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= hy ** 2
    is_disc = rng.uniform(size=(n, 1, 1)) < 0.5
    shape = np.where(is_disc, disc, rect) & present
    images = np.where(shape, level, images)
  images = np.clip(images, 0.0, 1.0) * 2.0 - 1.0
  return {"images": images[..., None].astype(np.float32)}


def patchify(images: jax.Array) -> jax.Array:
  """[B, S, S, C] -> [B, (S/P)^2, P*P*C] tokens."""
  b, s, _, c = images.shape
  g = s // PATCH
  x = images.reshape(b, g, PATCH, g, PATCH, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, g * g, PATCH * PATCH * c)


def unpatchify(tokens: jax.Array, size: int) -> jax.Array:
  """The inverse of `patchify`."""
  b, _, d = tokens.shape
  g, c = size // PATCH, d // (PATCH * PATCH)
  x = tokens.reshape(b, g, g, PATCH, PATCH, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, size, size, c)


# --- the tasks ----------------------------------------------------------------

@dataclasses.dataclass
class Task:
  """A model with its generated data.

  Attributes:
    description: one line for the log.
    make_data: (np RandomState, N) -> a dict of arrays [N, ...].
    net: the `hk.transform[_with_state]` of batch -> (loss, aux dict).
    loss_fn: what `fit()` gets (None: `fit_model(net)`).
    loss_label: the y-axis of loss.png.
    sample: (params, rng) -> images [K, S, S, 1] in [-1, 1], for diffusion.
    make_validation: like `make_data`, for the validation set (None:
      `make_data`).
    sample_text: lm: (params, rng) -> (generated tokens [G], the prompt and
      them as printable text), drawn at each validation pass (every
      `--sample_every` steps).
  """
  description: str
  make_data: Callable[[np.random.RandomState, int], dict[str, np.ndarray]]
  net: Any
  loss_fn: Callable[..., Any] | None = None
  loss_label: str = "cross-entropy"
  sample: Callable[..., jax.Array] | None = None
  make_validation: Callable[[np.random.RandomState, int],
                            dict[str, np.ndarray]] | None = None
  sample_text: Callable[..., tuple[np.ndarray, str]] | None = None


def _cross_entropy(logits, labels, weights=None):
  """(mean cross-entropy, {'accuracy'}) over the positions with weight 1."""
  logits = logits.astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [B, T]
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  if weights is None:
    return jnp.mean(ce), {"accuracy": jnp.mean(correct)}
  total = jnp.sum(weights)
  return (jnp.sum(ce * weights) / total,
          {"accuracy": jnp.sum(correct * weights) / total})


def _embed_tokens(tokens, seq_len, vocab, model_dim, dtype):
  x = jax.nn.one_hot(tokens, vocab, dtype=dtype)  # [B, T, V]
  position = hk.get_parameter("position", [seq_len, model_dim], jnp.float32,
                              init=hk.initializers.TruncatedNormal(0.02))
  return pk.Linear(model_dim, name="embed")(x) + position.astype(dtype)


def make_loss(seq_len: int, vocab: int, model_dim: int, num_heads: int,
              num_layers: int, dtype) -> hk.Transformed:
  """The sorting Transformer: hk.transform of batch -> (mean CE, {'accuracy'})."""

  def loss(batch):
    x = _embed_tokens(batch["tokens"], seq_len, vocab, model_dim, dtype)
    h = pk.Transformer(model_dim, num_heads, num_layers, is_causal=False)(
        x, is_training=True)  # [B, T, D]
    return _cross_entropy(pk.Linear(vocab, name="head")(h), batch["targets"])

  return hk.transform(loss)


def make_moe_loss(seq_len: int, vocab: int, model_dim: int, num_heads: int,
                  num_layers: int, num_experts: int, top_k: int, dtype):
  """The sorting task with MoE blocks.

  Returns:
    (net, loss_fn): `net = hk.transform_with_state(batch -> (CE, aux))` and
    `loss_fn(params, state, rng, batch) -> ((CE + sum of the layers' aux_loss,
    aux), new_state)` for `fit()`.
  """

  def forward(batch):
    x = _embed_tokens(batch["tokens"], seq_len, vocab, model_dim, dtype)
    for i in range(num_layers):  # pre-norm blocks: attention, then MoE MLP
      h = pk.RMSNorm(name=f"attention_norm_{i}")(x)
      x = x + pk.MultiHeadAttention(num_heads, name=f"attention_{i}")(h)
      h = pk.RMSNorm(name=f"moe_norm_{i}")(x)
      x = x + pk.MoELayer(num_experts, top_k, 2 * model_dim,
                          name=f"moe_{i}")(h)  # [B, T, D]
    x = pk.RMSNorm(name="final_norm")(x)
    return _cross_entropy(pk.Linear(vocab, name="head")(x), batch["targets"])

  net = hk.transform_with_state(forward)

  def loss_fn(params, state, rng, batch):
    (ce, aux), new_state = net.apply(params, state, rng, batch)
    layers = [s for s in new_state.values() if "aux_loss" in s]
    aux_loss = sum(s["aux_loss"] for s in layers)
    balance = sum(s["load_balance_loss"] for s in layers) / len(layers)
    return (ce + aux_loss, dict(aux, cross_entropy=ce,
                                load_balance_loss=balance)), new_state

  return net, loss_fn


def ssm_cell_kwargs(cell: str, model_dim: int, num_heads: int) -> dict:
  """The `cell_kwargs` of `SSMModel` for `cell`: `num_heads` heads where the
  cell has heads (mamba2's head size follows from its 2x expanded width)."""
  if cell in ("ssd", "gated_delta_net"):
    return {"num_heads": num_heads}
  if cell == "mamba2":
    return {"head_dim": 2 * model_dim // num_heads}
  return {}


def make_ssm_loss(seq_len: int, vocab: int, model_dim: int, num_layers: int,
                  cell: str, num_heads: int, dtype) -> hk.Transformed:
  """The copy task: a causal SSMModel with the `SSM_CELLS[cell]` cell, CE on
  the second half."""
  cell_kwargs = ssm_cell_kwargs(cell, model_dim, num_heads)

  def loss(batch):
    x = jax.nn.one_hot(batch["tokens"], vocab, dtype=dtype)  # [B, 2T, V]
    logits = pk.SSMModel(vocab, model_dim, vocab, num_layers,
                         cell=SSM_CELLS[cell], cell_kwargs=cell_kwargs)(
                             x, is_training=True)  # [B, 2T, V]
    weights = (jnp.arange(2 * seq_len) >= seq_len).astype(jnp.float32)  # [2T]
    weights = jnp.broadcast_to(weights, batch["targets"].shape)
    return _cross_entropy(logits, batch["targets"], weights)

  return hk.transform(loss)


def make_lm(model_dim: int, num_heads: int, num_layers: int,
            cell: str | None, dtype=jnp.float32
            ) -> tuple[hk.Transformed, Callable[[], Any]]:
  """The character model: a `TokenModel` over bytes around a causal
  Transformer (rotary positions), or an SSMModel with the `SSM_CELLS[cell]`
  cell, computing in `dtype` (float32 parameters and logits); it samples in
  `dtype` too.

  Returns:
    (net: hk.transform of batch -> (mean cross-entropy in bits,
    {'accuracy'}), model_fn: builds the model, for `pk.generate`).
  """

  def model_fn():
    if cell is None:
      body = pk.Transformer(model_dim, num_heads, num_layers, is_causal=True,
                            use_rope=True)
    else:
      body = pk.SSMModel(model_dim, model_dim, model_dim, num_layers,
                         cell=SSM_CELLS[cell],
                         cell_kwargs=ssm_cell_kwargs(cell, model_dim, num_heads))
    return pk.TokenModel(body, LM_VOCAB, dtype=dtype, name="lm")

  def loss(batch):
    logits = model_fn()(batch["tokens"], is_training=True)  # [B, T, 256]
    ce, aux = _cross_entropy(logits, batch["targets"])
    return ce / math.log(2), aux

  return hk.transform(loss), model_fn


def _to_host(x: jax.Array) -> np.ndarray:
  """A replicated array's value (every process holds all of it)."""
  return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def make_text_sampler(model_fn: Callable[[], Any], prompt: str, length: int,
                      temperature: float, top_k: int | None):
  """(params, rng) -> (generated tokens [length] int32, prompt + them as
  printable text): one sequence from `pk.generate` (compiled once)."""
  prompt_tokens = np.frombuffer(prompt.encode("utf-8"), np.uint8).astype(
      np.int32)  # [P]

  def sample(params, rng):
    tokens = pk.generate(model_fn, params, prompt_tokens[None], length, rng=rng,
                         temperature=temperature, top_k=top_k)  # [1, G]
    tokens = _to_host(tokens)[0]
    return tokens, decode_text(np.concatenate([prompt_tokens, tokens]))

  return sample


def make_diffusion(model: str, image_size: int, model_dim: int,
                   num_heads: int, num_layers: int, dtype):
  """(net: batch -> (noise MSE, {}), predict_noise(params, x_t, t))."""

  def predict(x_t, t):  # [B, S, S, 1], [B] -> [B, S, S, 1]
    x_t = x_t.astype(dtype)
    if model == "dit":
      out = pk.DiffusionTransformer(model_dim, num_heads, num_layers,
                                    name="dit")(patchify(x_t), t)
      return unpatchify(out, image_size)
    groups = math.gcd(8, model_dim)  # divides every level's channels
    channels = tuple(k * model_dim for k in UNET_LEVELS)
    return pk.UNet(1, channels, num_res_blocks=1, num_heads=num_heads,
                   norm_groups=groups, name="unet")(x_t, t)

  def loss(batch):
    return diffusion.ddpm_loss(predict, batch["images"], hk.next_rng_key()), {}

  predictor = hk.without_apply_rng(hk.transform(predict))
  return hk.transform(loss), predictor.apply


def make_task(model: str) -> Task:
  """The `Task` of `--model`, from the flags."""
  seq_len, vocab = seq_len_of(model, _SEQ_LEN.value), _VOCAB.value
  dtype = jnp.dtype(_DTYPE.value)
  heads, layers = _NUM_HEADS.value, _NUM_LAYERS.value
  dim = model_dim_of(model, _MODEL_DIM.value)
  if model == "transformer":
    return Task(
        f"sorting {seq_len} tokens of {vocab} values with a Transformer;"
        f" chance loss {math.log(vocab):.3f}",
        functools.partial(make_sorting_data, seq_len=seq_len, vocab=vocab),
        make_loss(seq_len, vocab, dim, heads, layers, dtype))
  if model == "moe":
    net, loss_fn = make_moe_loss(seq_len, vocab, dim, heads, layers,
                                 _NUM_EXPERTS.value, _TOP_K.value, dtype)
    return Task(
        f"sorting {seq_len} tokens of {vocab} values with {layers} MoE blocks"
        f" ({_NUM_EXPERTS.value} experts, top-{_TOP_K.value}); chance loss"
        f" {math.log(vocab):.3f}",
        functools.partial(make_sorting_data, seq_len=seq_len, vocab=vocab),
        net, loss_fn, "cross-entropy + router losses")
  cell = ssm_cell_of(model, _SSM_CELL.value)
  if model == "ssm":
    return Task(
        f"copying {seq_len} tokens of {vocab - 1} values with a causal"
        f" SSMModel ({cell}); chance loss {math.log(vocab - 1):.3f}",
        functools.partial(make_copy_data, seq_len=seq_len, vocab=vocab),
        make_ssm_loss(seq_len, vocab, dim, layers, cell, heads, dtype))
  if model == "lm":
    return make_lm_task(seq_len, dim, heads, layers, cell, dtype)
  size = _IMAGE_SIZE.value
  net, predict_noise = make_diffusion(model, size, dim, heads, layers, dtype)
  sampler = jax.jit(functools.partial(
      diffusion.ddim_sample, predict_noise,
      shape=(_NUM_SAMPLES.value, size, size, 1),
      num_steps=_SAMPLE_STEPS.value))  # (params, rng) -> samples
  return Task(
      f"denoising {size}x{size} images of rectangles and discs with a"
      f" {'DiffusionTransformer' if model == 'dit' else 'UNet'}; noise MSE"
      " starts near 1",
      functools.partial(make_shape_images, size=size),
      net, loss_label="noise MSE", sample=sampler)


def make_lm_task(seq_len: int, model_dim: int, num_heads: int, num_layers: int,
                 cell: str | None, dtype=jnp.float32) -> Task:
  """The lm `Task`: reads the text (raising `flags.ValidationError` for a
  `--seq_len` the held-out text cannot fill) and builds the model and
  sampler."""
  train_text = stdlib_text(LM_TRAIN_MODULES)
  validation_text = stdlib_text(LM_VALIDATION_MODULES)
  if seq_len >= len(validation_text):
    raise flags.ValidationError(
        f"--seq_len={seq_len} must be below {len(validation_text)}, the bytes"
        f" of the held-out text ({', '.join(LM_VALIDATION_MODULES)}) its"
        " windows are cut from")
  net, model_fn = make_lm(model_dim, num_heads, num_layers, cell, dtype)
  body = ("a causal Transformer" if cell is None
          else f"an SSMModel ({cell})")
  return Task(
      f"next byte of Python source ({len(train_text) // 1000} kB of"
      f" {len(LM_TRAIN_MODULES)} standard-library modules; validation:"
      f" {', '.join(LM_VALIDATION_MODULES)}) with {body}, windows of {seq_len};"
      f" chance loss {math.log2(LM_VOCAB):.0f} bits/char",
      functools.partial(make_text_windows, text=train_text, seq_len=seq_len),
      net, loss_label="cross-entropy (bits per character)",
      make_validation=functools.partial(make_text_windows,
                                        text=validation_text, seq_len=seq_len),
      sample_text=make_text_sampler(model_fn, _PROMPT.value,
                                    _SAMPLE_LENGTH.value, _TEMPERATURE.value,
                                    _SAMPLE_TOP_K.value))


# --- output -------------------------------------------------------------------

def say(line: str) -> None:
  """Prints `line` to stdout above the progress bar, if one is on.

  `tqdm.write` clears the bar, writes the line and redraws the bar below it
  (a plain print would land on the bar's line); with no bar it prints.
  """
  tqdm.tqdm.write(line, file=sys.stdout)
  sys.stdout.flush()


class _PrintLoss(pk.training.Callback):
  """Prints the loss every `every` steps and each validation loss (followed
  by `unit`)."""

  def __init__(self, every: int, unit: str = ""):
    self.every = every
    self.unit = unit
    self.start = time.perf_counter()

  def on_train_begin(self, step):
    if step:
      say(f"resumed from the checkpoint at step {step}")

  def on_step_end(self, step, metrics):
    if step % self.every == 0:
      extra = (f"  accuracy {metrics['accuracy']:.3f}" if "accuracy" in metrics
               else "")
      say(f"step {step:5d}  loss {metrics['loss']:.4f}{self.unit}{extra}"
          f"  ({time.perf_counter() - self.start:.1f} s)")

  def on_eval_end(self, step, metrics):
    say(f"step {step:5d}  validation loss {metrics['val_loss']:.4f}{self.unit}")


class _SampleText(pk.training.Callback):
  """lm: prints a sample of `sample_text(params, rng)` at each validation
  pass and keeps all of them in `path` (samples.json: `step`, `tokens`,
  `text`, one entry per sample). A resumed fit keeps the samples up to the
  step it resumes from; a fit from step 0 starts the file afresh.

  Args:
    sample_text: `Task.sample_text`, (params, rng) -> (tokens [G], text).
    path: where the samples go.
    seed: the sampling key of step s is `fold_in(PRNGKey(seed), s)`.
    header: what the printed header says after "sample (".
  """

  def __init__(self, sample_text, path: str, seed: int, header: str):
    self.sample_text = sample_text
    self.path = path
    self.key = jax.random.PRNGKey(seed)
    self.header = header
    self.samples = {"step": [], "tokens": [], "text": []}

  def on_train_begin(self, step):
    self.samples = {"step": [], "tokens": [], "text": []}
    if step and os.path.exists(self.path):
      with open(self.path) as f:  # a resumed run keeps the earlier samples
        earlier = json.load(f)
      keep = [i for i, s in enumerate(earlier["step"]) if s <= step]
      self.samples = {k: [v[i] for i in keep] for k, v in earlier.items()}

  def on_eval_params(self, step, params, state):
    del state  # the lm has no Haiku state
    tokens, text = self.sample_text(params, jax.random.fold_in(self.key, step))
    say(f"step {step:5d}  sample ({self.header}, {len(tokens)} bytes after"
        f" the prompt):\n{text}")
    if self.samples["step"] and self.samples["step"][-1] == step:
      for values in self.samples.values():  # a run resumed at its last step
        values.pop()
    self.samples["step"].append(step)
    self.samples["tokens"].append(tokens.tolist())
    self.samples["text"].append(text)
    with open(self.path, "w") as f:
      json.dump(self.samples, f)


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def write_loss_plot(history: dict, path: str, title: str, label: str) -> None:
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(history["step"], history["loss"], label="train", lw=0.8)
  if "val_loss" in history:
    ax.plot(history["val_step"], history["val_loss"], "o-", label="validation")
  ax.set_xlabel("step")
  ax.set_ylabel(label)
  ax.set_title(title, fontsize=9)
  ax.legend()
  fig.savefig(path, dpi=100, bbox_inches="tight")
  plt.close(fig)


def _grid(images: np.ndarray, columns: int) -> np.ndarray:
  """[K, S, S, 1] -> one [rows*(S+1), columns*(S+1)] picture (1px gaps)."""
  k, s = images.shape[:2]
  rows = -(-k // columns)
  out = np.ones((rows * (s + 1) - 1, columns * (s + 1) - 1), np.float32)
  for i in range(k):
    r, c = divmod(i, columns)
    out[r * (s + 1):r * (s + 1) + s, c * (s + 1):c * (s + 1) + s] = images[i, ..., 0]
  return out


def write_samples(data: np.ndarray, samples: np.ndarray, path: str,
                  title: str) -> None:
  """Training images beside model samples, both in [-1, 1]."""
  plt = _pyplot()
  columns = max(1, int(math.ceil(math.sqrt(len(samples)))))
  fig, axes = plt.subplots(1, 2, figsize=(8, 4.4))
  for ax, images, name in ((axes[0], data, "training data"),
                           (axes[1], samples, "samples (DDIM)")):
    ax.imshow(_grid((images + 1) / 2, columns), cmap="gray", vmin=0, vmax=1,
              interpolation="nearest")
    ax.set_title(name)
    ax.axis("off")
  fig.suptitle(title, fontsize=9)
  fig.savefig(path, dpi=100, bbox_inches="tight")
  plt.close(fig)


def check_batch_size(batch_size: int) -> None:
  """`batch_size` must split evenly over every device of every process.

  Checked once JAX has started (after `jax.distributed.initialize`), so not
  by a flag validator; raises `flags.ValidationError` naming the flag.
  """
  if batch_size % jax.device_count():
    raise flags.ValidationError(
        f"--batch_size={batch_size} must be a multiple of the device count"
        f" {jax.device_count()}")


def init_params(net, key: jax.Array, example, parameter_sharding: str):
  """`net.init(key, example)`, compiled (op by op, a UNet's init compiles
  hundreds of small kernels). Under 'fsdp' each parameter is created in the
  layout fit() gives it (`pk.training.fsdp_spec` on fit's default mesh), so
  that no device holds them all; the Haiku state is replicated."""
  if parameter_sharding == "replicated":
    return jax.jit(net.init)(key, example)
  mesh = pk.training.default_mesh()
  with_state = isinstance(net, hk.TransformedWithState)
  shapes = jax.eval_shape(net.init, key, example)
  placed = jax.tree.map(
      lambda x: jax.sharding.NamedSharding(
          mesh, pk.training.fsdp_spec(x.shape, mesh)),
      shapes[0] if with_state else shapes)
  if with_state:
    placed = (placed, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))
  with jax.set_mesh(mesh):  # the ops inside init run per shard, as in fit()
    return jax.jit(net.init, out_shardings=placed)(key, example)


def train() -> pk.FitResult:
  """Runs the job the flags describe; returns fit()'s result."""
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO
    logging.set_verbosity(logging.WARNING)
  if _DISTRIBUTED.value:
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value,
                               _PROCESS_ID.value)
  model = _MODEL.value
  output_dir = _OUTPUT_DIR.value or tempfile.mkdtemp(prefix="probjax_hk_train_")
  os.makedirs(output_dir, exist_ok=True)
  batch_size = batch_size_of(model, _BATCH_SIZE.value)
  check_batch_size(batch_size)
  task = make_task(model)
  rng = np.random.RandomState(_SEED.value)
  validation = (task.make_validation or task.make_data)(
      rng, _NUM_VALIDATION.value)

  if _STREAM.value:
    def stream(seed):  # with several processes each yields its own rows
      rs = np.random.RandomState([seed, jax.process_index()])
      while True:
        yield task.make_data(rs, batch_size // jax.process_count())
    data = stream(_SEED.value + 1)
  else:
    data = task.make_data(rng, _NUM_EXAMPLES.value)
  # Independent of --steps: a resumed run with more steps follows the same
  # schedule as one uninterrupted run.
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, _LEARNING_RATE.value, WARMUP_STEPS, _DECAY_STEPS.value,
      _LEARNING_RATE.value / 10)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))

  say(f"{model}: {task.description}; {jax.device_count()}"
      f" {jax.default_backend()} device(s); output in {output_dir}")
  lm = task.sample_text is not None
  callbacks = [_PrintLoss(_LOG_EVERY.value, " bits/char" if lm else "")]
  samples_path = os.path.join(output_dir, "samples.json")
  if lm:  # a sample at each validation pass, from the parameters fit() holds
    top_k = _SAMPLE_TOP_K.value
    callbacks.append(_SampleText(
        task.sample_text, samples_path, _SEED.value + 7,
        f"temperature {_TEMPERATURE.value:g}"
        f"{f', top-{top_k}' if top_k else ''}"))
  kwargs = dict(
      rng=_SEED.value, optimizer=optimizer, batch_size=batch_size,
      num_steps=_STEPS.value, validation_data=validation,
      eval_every=_SAMPLE_EVERY.value if lm else _EVAL_EVERY.value,
      callbacks=callbacks,
      checkpoint_dir=os.path.join(output_dir, "checkpoints"),
      checkpoint_every=_CHECKPOINT_EVERY.value,
      keep_checkpoints=_KEEP_CHECKPOINTS.value, resume=_RESUME.value,
      progress=_PROGRESS.value, log_every=_LOG_EVERY.value,  # logs with -v 0
      steps_per_call=_STEPS_PER_CALL.value,
      parameter_sharding=_PARAMETER_SHARDING.value)
  example = jax.tree.map(lambda x: x[:batch_size], validation)
  init = init_params(task.net, jax.random.fold_in(
      jax.random.PRNGKey(_SEED.value), 3), example, _PARAMETER_SHARDING.value)
  if task.loss_fn is None:
    result = pk.fit_model(task.net, data, params=init, **kwargs)
  else:  # a Haiku-state model whose loss_fn wraps net.apply
    params, state = init
    result = pk.fit(task.loss_fn, params, data, state=state, **kwargs)

  history = {k: v.tolist() for k, v in result.history.items()}
  with open(os.path.join(output_dir, "history.json"), "w") as f:
    json.dump(history, f)
  pictures = [os.path.join(output_dir, "loss.png")]
  write_loss_plot(history, pictures[0], f"{model}: {task.description}",
                  task.loss_label)
  if task.sample is not None:
    samples = np.asarray(task.sample(result.params,
                                     jax.random.PRNGKey(_SEED.value + 7)))
    pictures.append(os.path.join(output_dir, "samples.png"))
    write_samples(validation["images"][:len(samples)], samples, pictures[1],
                  f"{model}, step {result.step}: {_SAMPLE_STEPS.value} DDIM"
                  " steps from noise")
  loss = result.history["loss"]
  n = max(1, min(_LOG_EVERY.value, len(loss) // 2))
  first = loss[:n].mean() if len(loss) else float("nan")
  last = loss[-n:].mean() if len(loss) else float("nan")
  say(f"done: step {result.step}, loss {first:.4f} -> {last:.4f} (mean of"
      f" first/last {n} steps), {result.steps_per_sec:.1f} steps/s")
  say(f"checkpoints: {output_dir}/checkpoints (final: step {result.step});"
      f" history: {output_dir}/history.json")
  say("pictures: " + " ".join(pictures))
  if lm:
    say(f"samples: {samples_path}")
  return result


def main(argv):
  del argv
  try:
    train()
  except flags.ValidationError as e:  # a flag that does not fit the devices
    sys.exit(f"FATAL Flags error: {e}")


if __name__ == "__main__":
  app.run(main)
