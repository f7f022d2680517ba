"""The model cases and their jitted forward and train step.

The cases `benchmark_gpu_nn` times and `gpu_check` runs, apart from their
programs (which define absl flags). Standard profile (`STANDARD`): width 256,
8 heads of 32, 4 layers for the attention models; `SSMModel(16, 128, 16, 4)`
for the SSMs; MoELayer(8 experts, top-2, d_model 256, d_hidden 512); UNet(3,
(64, 128, 256)) on 32 x 32 images. `SMALL` shrinks every one of them, for a
run on the CPU.
"""

import dataclasses
import functools
from typing import Callable

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from experiments import harness
import probjax_hk as pk


@dataclasses.dataclass(frozen=True)
class Profile:
  """The size of every model case."""
  width: int           # D: the attention models', MoE layer's and SSMs' width
  num_heads: int       # the attention models' heads
  num_layers: int      # the attention models' and SSMs' depth
  unet_channels: tuple[int, ...]  # the UNet's channels per level
  unet_res_blocks: int            # the UNet's residual blocks per level


STANDARD = Profile(256, 8, 4, (64, 128, 256), 2)
SMALL = Profile(32, 2, 1, (8,), 1)
def implementation_arg(name: str) -> str | None:
  """A flag value ('default', 'pallas', 'xla', ...) as an `implementation` argument."""
  return None if name == "default" else name


def _attention_fn(attention: str) -> Callable:
  return functools.partial(pk.dot_product_attention,
                           implementation=implementation_arg(attention))


def transformer_case(attention_fn, batch, tokens, dtype, profile=STANDARD):
  model = hk.transform_with_state(lambda x, t: pk.Transformer(
      profile.width, profile.num_heads, profile.num_layers, attention_fn=attention_fn)(x))
  x = jax.random.normal(jax.random.key(1), (batch, tokens, profile.width), dtype)
  return model, (x, jnp.zeros((batch,)))


def dit_case(attention_fn, batch, tokens, dtype, profile=STANDARD):
  model = hk.transform_with_state(lambda x, t: pk.DiffusionTransformer(
      profile.width, profile.num_heads, profile.num_layers, attention_fn=attention_fn)(x, t))
  x = jax.random.normal(jax.random.key(1), (batch, tokens, profile.width), dtype)
  return model, (x, jax.random.uniform(jax.random.key(2), (batch,)) * 1000)


def ssm_case(cell_name, **cell_kwargs):
  """SSMModel(16, D, 16, layers), the SSM benchmark profile, with one cell.

  The case's `implementation` ('default', 'pallas', 'xla') goes to the cell's
  scan op.
  """
  def case(implementation, batch, tokens, dtype, profile=STANDARD):
    cell = getattr(pk, cell_name)
    kwargs = dict(cell_kwargs, implementation=implementation_arg(implementation))
    width = 128 if profile == STANDARD else profile.width
    model = hk.transform_with_state(lambda x, t: pk.SSMModel(
        16, width, 16, profile.num_layers, cell=cell, cell_kwargs=kwargs)(x))
    x = jax.random.normal(jax.random.key(1), (batch, tokens, 16), dtype)
    return model, (x, jnp.zeros((batch,)))
  return case


def moe_case(dropless_impl, batch, tokens, dtype, profile=STANDARD):
  """MoELayer(8 experts, top-2, d_hidden 2 D) on [batch, tokens, D] tokens;
  `dropless_impl` 'default' is 'auto'."""
  impl = "auto" if dropless_impl == "default" else dropless_impl
  model = hk.transform_with_state(lambda x, t: pk.MoELayer(
      8, 2, 2 * profile.width, dropless_impl=impl)(x))
  x = jax.random.normal(jax.random.key(1), (batch, tokens, profile.width), dtype)
  return model, (x, jnp.zeros((batch,)))


def unet_case(attention, batch, tokens, dtype, profile=STANDARD):
  """UNet(3, channels) on [batch, tokens, tokens, 3] images (`tokens`: the side)."""
  model = hk.transform_with_state(lambda x, t: pk.UNet(
      3, profile.unet_channels, num_res_blocks=profile.unet_res_blocks,
      norm_groups=min(32, profile.unet_channels[0]), attention_fn=_attention_fn(attention))(x, t))
  x = jax.random.normal(jax.random.key(1), (batch, tokens, tokens, 3), dtype)
  return model, (x, jax.random.uniform(jax.random.key(2), (batch,)) * 1000)


# name -> (attention_fn, SSM implementation, dropless_impl or attention name,
#          batch, tokens, dtype, profile=STANDARD) -> (transformed model, inputs).
MODELS = {
    "transformer": transformer_case,
    "dit": dit_case,
    "ssm_lru": ssm_case("LRUCell"),
    "ssm_mamba": ssm_case("MambaCell"),
    "ssm_ssd": ssm_case("SSDCell", num_heads=2),  # heads of 64
    "ssm_mamba2": ssm_case("Mamba2Cell"),
    "ssm_gated_delta_net": ssm_case("GatedDeltaNetCell", num_heads=2),
    "moe": moe_case,
    "unet": unet_case,
}
# Models with attention run once per --attention value, the SSMs once per
# --ssm_implementation value.
ATTENTION_MODELS = ("transformer", "dit")


def check_attention(attention, tokens, batch, dtype, profile=STANDARD):
  """Raises harness.Unsupported when the attention cannot take this case."""
  q = jax.ShapeDtypeStruct((batch, tokens, profile.num_heads,
                            profile.width // profile.num_heads), dtype)
  try:
    pk.choose_attention_implementation(q, q, q, implementation=implementation_arg(attention))
  except ValueError as e:
    raise harness.Unsupported(str(e)) from e


def _make_case(model_name, choice, batch, tokens, dtype, profile):
  """`choice`: the attention implementation or, for an SSM, the op
  implementation (for the MoE layer its `dropless_impl`)."""
  if model_name in ATTENTION_MODELS:
    check_attention(choice, tokens, batch, dtype, profile)
    choice = _attention_fn(choice)
  return MODELS[model_name](choice, batch, tokens, dtype, profile=profile)


def build_forward(model_name, choice, batch, tokens, dtype, *, profile=STANDARD):
  def build():
    model, inputs = _make_case(model_name, choice, batch, tokens, dtype, profile)
    params, state = jax.jit(model.init)(jax.random.key(0), *inputs)
    return jax.jit(lambda p, *a: model.apply(p, state, None, *a)[0]), (params, *inputs)
  return build


def build_train_step(model_name, choice, batch, tokens, dtype, *, donate=True,
                     profile=STANDARD):
  """Adam on the mean square of the output; params and optimizer state donated.

  `donate=False` keeps the arguments reusable (for a profiler that replays
  one set of them).
  """
  def build():
    model, inputs = _make_case(model_name, choice, batch, tokens, dtype, profile)
    params, state = jax.jit(model.init)(jax.random.key(0), *inputs)
    optimizer = optax.adam(1e-4)
    opt_state = optimizer.init(params)

    def loss_fn(p, *a):
      out = model.apply(p, state, None, *a)[0]
      return jnp.mean(jnp.square(out.astype(jnp.float32)))

    # Donated as in training; the harness feeds each call's state to the next.
    @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
    def step(p, s, *a):
      loss, grads = jax.value_and_grad(loss_fn)(p, *a)
      updates, s = optimizer.update(grads, s, p)
      return optax.apply_updates(p, updates), s, loss

    return step, (params, opt_state, *inputs)
  return build
