"""The standard-profile model cases and their jitted forward and train step.

The cases `benchmark_gpu_nn` times, apart from its program (which defines
absl flags). Standard profile: width 256, 8 heads of 32, 4 layers for the
attention models; `SSMModel(16, 128, 16, 4)` for the SSMs.
"""

import functools
from typing import Callable

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from experiments import harness
import probjax_hk as pk

MODEL_DIM, NUM_HEADS, NUM_LAYERS = 256, 8, 4


def implementation_arg(name: str) -> str | None:
  """A flag value ('default', 'pallas', 'xla', ...) as an `implementation` argument."""
  return None if name == "default" else name


def _attention_fn(attention: str) -> Callable:
  return functools.partial(pk.dot_product_attention,
                           implementation=implementation_arg(attention))


def transformer_case(attention_fn, batch, tokens, dtype):
  model = hk.transform(lambda x, t: pk.Transformer(
      MODEL_DIM, NUM_HEADS, NUM_LAYERS, attention_fn=attention_fn)(x))
  x = jax.random.normal(jax.random.key(1), (batch, tokens, MODEL_DIM), dtype)
  return model, (x, jnp.zeros((batch,)))


def dit_case(attention_fn, batch, tokens, dtype):
  model = hk.transform(lambda x, t: pk.DiffusionTransformer(
      MODEL_DIM, NUM_HEADS, NUM_LAYERS, attention_fn=attention_fn)(x, t))
  x = jax.random.normal(jax.random.key(1), (batch, tokens, MODEL_DIM), dtype)
  return model, (x, jax.random.uniform(jax.random.key(2), (batch,)) * 1000)


def ssm_case(cell_name, **cell_kwargs):
  """SSMModel(16, 128, 16, 4), the SSM benchmark profile, with one cell.

  The case's `implementation` ('default', 'pallas', 'xla') goes to the cell's
  scan op.
  """
  def case(implementation, batch, tokens, dtype):
    cell = getattr(pk, cell_name)
    kwargs = dict(cell_kwargs, implementation=implementation_arg(implementation))
    model = hk.transform(lambda x, t: pk.SSMModel(16, 128, 16, 4, cell=cell,
                                                  cell_kwargs=kwargs)(x))
    x = jax.random.normal(jax.random.key(1), (batch, tokens, 16), dtype)
    return model, (x, jnp.zeros((batch,)))
  return case


# name -> (attention_fn or SSM implementation, batch, tokens, dtype)
#      -> (transformed model, inputs).
MODELS = {
    "transformer": transformer_case,
    "dit": dit_case,
    "ssm_lru": ssm_case("LRUCell"),
    "ssm_mamba": ssm_case("MambaCell"),
    "ssm_ssd": ssm_case("SSDCell", num_heads=2),  # heads of 64
    "ssm_mamba2": ssm_case("Mamba2Cell"),
    "ssm_gated_delta_net": ssm_case("GatedDeltaNetCell", num_heads=2),
}
# Models with attention run once per --attention value, the SSMs once per
# --ssm_implementation value.
ATTENTION_MODELS = ("transformer", "dit")


def check_attention(attention, tokens, batch, dtype):
  """Raises harness.Unsupported when the attention cannot take this case."""
  q = jax.ShapeDtypeStruct((batch, tokens, NUM_HEADS, MODEL_DIM // NUM_HEADS), dtype)
  try:
    pk.choose_attention_implementation(q, q, q, implementation=implementation_arg(attention))
  except ValueError as e:
    raise harness.Unsupported(str(e)) from e


def _make_case(model_name, choice, batch, tokens, dtype):
  """`choice`: the attention implementation or, for an SSM, the op implementation."""
  if model_name in ATTENTION_MODELS:
    check_attention(choice, tokens, batch, dtype)
    choice = _attention_fn(choice)
  return MODELS[model_name](choice, batch, tokens, dtype)


def build_forward(model_name, choice, batch, tokens, dtype):
  def build():
    model, inputs = _make_case(model_name, choice, batch, tokens, dtype)
    params = model.init(jax.random.key(0), *inputs)
    return jax.jit(lambda p, *a: model.apply(p, None, *a)), (params, *inputs)
  return build


def build_train_step(model_name, choice, batch, tokens, dtype, *, donate=True):
  """Adam on the mean square of the output; params and optimizer state donated.

  `donate=False` keeps the arguments reusable (for a profiler that replays
  one set of them).
  """
  def build():
    model, inputs = _make_case(model_name, choice, batch, tokens, dtype)
    params = model.init(jax.random.key(0), *inputs)
    optimizer = optax.adam(1e-4)
    opt_state = optimizer.init(params)

    def loss_fn(p, *a):
      out = model.apply(p, None, *a)
      return jnp.mean(jnp.square(out.astype(jnp.float32)))

    # Donated as in training; the harness feeds each call's state to the next.
    @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
    def step(p, s, *a):
      loss, grads = jax.value_and_grad(loss_fn)(p, *a)
      updates, s = optimizer.update(grads, s, p)
      return optax.apply_updates(p, updates), s, loss

    return step, (params, opt_state, *inputs)
  return build
