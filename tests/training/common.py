"""Shared pieces of the training tests: a tiny MLP regression, a compile counter.

The loss functions and optimizers are module-level objects, so every test that
uses them shares one compiled step (the cache of `fit()` is keyed on them).
"""

import contextlib

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

NUM_EXAMPLES = 96
NUM_FEATURES = 4

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
# The suite runs with a persistent compilation cache (tests/conftest.py): a
# program lowered again but found there is no backend compile, and still a
# compile for these tests (it means jit's own cache missed).
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_compile_events = []


def _duration_listener(event, duration, **kwargs):
  del duration, kwargs
  if event == _BACKEND_COMPILE:
    _compile_events.append(event)


def _event_listener(event, **kwargs):
  del kwargs
  if event == _CACHE_HIT:
    _compile_events.append(event)


jax.monitoring.register_event_duration_secs_listener(_duration_listener)
jax.monitoring.register_event_listener(_event_listener)


@contextlib.contextmanager
def count_compiles():
  """Yields a list whose length is the number of XLA compilations inside
  (persistent-cache hits included)."""
  start = len(_compile_events)
  out = []
  yield out
  out.extend(_compile_events[start:])


def make_data(num_examples=NUM_EXAMPLES, seed=0):
  """A smooth regression task: y = tanh(x . w / 2), one w for every seed."""
  x = np.random.RandomState(seed).randn(num_examples, NUM_FEATURES)
  x = x.astype(np.float32)
  w = np.random.RandomState(1234).randn(NUM_FEATURES).astype(np.float32)
  return {"x": x, "y": np.tanh(x @ w / 2).astype(np.float32)}


def _mlp_loss(batch):
  pred = hk.nets.MLP([16, 1])(batch["x"])[:, 0]  # [B]
  return jnp.mean((pred - batch["y"]) ** 2)


NET = hk.transform(_mlp_loss)
OPTIMIZER = optax.adam(3e-2)


def loss_fn(params, rng, batch):
  return NET.apply(params, rng, batch)


def masked_loss_fn(params, rng, batch, mask):
  """Mean squared error over the real rows only ([B] bool mask)."""
  pred = hk.transform(
      lambda x: hk.nets.MLP([16, 1])(x)[:, 0]).apply(params, rng, batch["x"])
  err = jnp.where(mask, (pred - batch["y"]) ** 2, 0.0)
  return jnp.sum(err) / jnp.maximum(jnp.sum(mask), 1)


def init_params(seed=0):
  return NET.init(jax.random.PRNGKey(seed), make_data(2))


def stream(data, batch_size):
  """A generator over consecutive batches of in-memory data."""
  n = len(data["y"])
  for start in range(0, n, batch_size):
    yield {k: v[start:start + batch_size] for k, v in data.items()}
