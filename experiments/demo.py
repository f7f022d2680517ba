"""A two-minute demo: a causal Transformer learns a delayed-copy task on CPU.

    JAX_PLATFORMS=cpu python -m experiments.demo

Each sequence is random tokens; the target at position t is the token at
t - 2 (the first two targets are token 0). A model can only solve it by
attending to an earlier position, so the loss falling from log(vocab) to
near zero shows attention, the stack and the optimizer working together.
"""

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import optax

import probjax_hk as pk

_STEPS = flags.DEFINE_integer("steps", 300, "Training steps.")
_VOCAB = flags.DEFINE_integer("vocab", 8, "Number of token values.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 32, "Tokens per sequence.")
_BATCH = flags.DEFINE_integer("batch", 32, "Sequences per step.")
_DELAY = flags.DEFINE_integer("delay", 2, "How far back the target token lies.")


def make_batch(key, batch, seq_len, vocab, delay):
  tokens = jax.random.randint(key, (batch, seq_len), 0, vocab)
  targets = jnp.pad(tokens, ((0, 0), (delay, 0)))[:, :seq_len]
  return tokens, targets


def main(argv):
  del argv
  vocab = _VOCAB.value

  def logits_fn(tokens):
    x = jax.nn.one_hot(tokens, vocab)  # [B, T, V]
    h = pk.Transformer(64, 4, 2, is_causal=True, use_rope=True)(x)  # [B, T, 64]
    return pk.Linear(vocab, name="head")(h)  # [B, T, V]

  model = hk.without_apply_rng(hk.transform(logits_fn))
  optimizer = optax.adam(3e-3)

  def loss_fn(params, tokens, targets):
    logits = model.apply(params, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @jax.jit
  def step(params, opt_state, key):
    tokens, targets = make_batch(key, _BATCH.value, _SEQ_LEN.value, vocab, _DELAY.value)
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  key = jax.random.key(0)
  params = model.init(key, jnp.zeros((1, _SEQ_LEN.value), jnp.int32))
  opt_state = optimizer.init(params)
  print(f"delayed-copy task: vocab {vocab}, chance loss {jnp.log(vocab):.3f}")
  for i in range(_STEPS.value):
    params, opt_state, loss = step(params, opt_state, jax.random.fold_in(key, i))
    if i % 25 == 0 or i == _STEPS.value - 1:
      print(f"step {i:4d}  loss {float(loss):.4f}")


if __name__ == "__main__":
  app.run(main)
