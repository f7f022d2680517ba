"""Gaussian diffusion: noise schedules, the forward process, the DDPM loss and
the DDIM sampler, for any noise-predicting model.

Ho, Jain & Abbeel, "Denoising Diffusion Probabilistic Models" (2020),
https://arxiv.org/abs/2006.11239 (the noise-prediction loss, the linear
schedule); Nichol & Dhariwal, "Improved Denoising Diffusion Probabilistic
Models" (2021), https://arxiv.org/abs/2102.09672 (the cosine schedule); Song,
Meng & Ermon, "Denoising Diffusion Implicit Models" (2021),
https://arxiv.org/abs/2010.02502 (the sampler).

Glossary of shapes: B batch; `...` the shape of one example ([H, W, C] for
NHWC images, [T, D] for tokens).

Time is continuous, t in [0, 1] (t = 0 clean data, t = 1 pure noise). A
schedule maps t to `alpha_bar(t)`, the fraction of signal variance left::

    x_t = sqrt(alpha_bar(t)) * x_0 + sqrt(1 - alpha_bar(t)) * noise.

The model sees `t * time_scale` (1000 by default, the discrete step count
DDPM's time embeddings were designed for; `probjax_hk.TimestepEmbedding`
expects that range). Its signature is Haiku's apply style,
`apply_fn(params, x_t, t) -> predicted noise`, which
`hk.without_apply_rng(hk.transform(f)).apply` has; inside an `hk.transform`
the loss takes the untransformed `f(x_t, t)` directly.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from probjax_hk import arguments

Schedule = Callable[[jax.Array], jax.Array]  # t [...] in [0, 1] -> alpha_bar [...]

DEFAULT_TIME_SCALE = 1000.0  # the model sees t * this: DDPM's step numbers


def _check_floor(min_alpha_bar: float) -> None:
  arguments.check_positive_numbers(min_alpha_bar=min_alpha_bar)
  if not min_alpha_bar < 1:
    raise ValueError(f"`min_alpha_bar` must be in (0, 1), got {min_alpha_bar=}")


def _check_batched(x: jax.Array, name: str) -> None:
  if jnp.ndim(x) < 1:
    raise ValueError(f"`{name}` must be [B, ...] with a batch axis, got a scalar")


def _per_example(values: jax.Array, ndim: int) -> jax.Array:
  """[B] (or a scalar) -> [B, 1, ..., 1] broadcasting over an example of rank ndim - 1."""
  return jnp.reshape(values, jnp.shape(values) + (1,) * (ndim - jnp.ndim(values)))


def cosine_schedule(t: jax.Array, *, offset: float = 0.008,
                    min_alpha_bar: float = 1e-5) -> jax.Array:
  """The cosine schedule of Nichol & Dhariwal (2021).

  `alpha_bar(t) = f(t) / f(0)`, `f(t) = cos((t + offset) / (1 + offset) *
  pi / 2) ** 2`, clipped below at `min_alpha_bar` (at t = 1 it would be 0,
  where the noise fully hides the data and `x_0 = x_t / sqrt(alpha_bar)`
  divides by zero).

  Args:
    t: times in [0, 1], any shape.
    offset: `s` of the paper: keeps the noise at small t from vanishing.
    min_alpha_bar: the floor, in (0, 1).

  Returns:
    alpha_bar(t), float32, the shape of `t`; 1 at t = 0, decreasing.

  Raises:
    ValueError: `offset` is not positive or `min_alpha_bar` not in (0, 1).
    TypeError: either is not a number.
  """
  arguments.check_positive_numbers(offset=offset)
  _check_floor(min_alpha_bar)
  t = jnp.asarray(t, jnp.float32)
  f = lambda u: jnp.cos((u + offset) / (1.0 + offset) * (jnp.pi / 2)) ** 2
  return jnp.clip(f(t) / f(0.0), min_alpha_bar, 1.0)


def linear_schedule(t: jax.Array, *, beta_min: float = 0.1,
                    beta_max: float = 20.0,
                    min_alpha_bar: float = 1e-5) -> jax.Array:
  """DDPM's linear schedule in continuous time (the VP SDE of Song et al. 2021).

  The noise rate grows linearly, `beta(t) = beta_min + t (beta_max -
  beta_min)`, and `alpha_bar(t) = exp(-integral_0^t beta)`. The defaults are
  DDPM's betas from 1e-4 to 0.02 over 1000 steps, scaled by 1000:
  `alpha_bar(k / 1000)` is DDPM's discrete `prod_{i<=k} (1 - beta_i)` to
  within 1e-3.

  Args:
    t: times in [0, 1], any shape.
    beta_min: the noise rate at t = 0, >= 0.
    beta_max: the noise rate at t = 1, >= `beta_min`.
    min_alpha_bar: the floor, in (0, 1).

  Returns:
    alpha_bar(t), float32, the shape of `t`; 1 at t = 0, decreasing.

  Raises:
    ValueError: `beta_min < 0`, `beta_max < beta_min`, `beta_max` 0, or
      `min_alpha_bar` not in (0, 1).
    TypeError: one of them is not a number.
  """
  arguments.check_nonnegative_numbers(beta_min=beta_min, beta_max=beta_max)
  if not 0 <= beta_min <= beta_max or not beta_max > 0:
    raise ValueError(f"`beta_min` and `beta_max` must satisfy 0 <= beta_min <="
                     f" beta_max and beta_max > 0, got {beta_min=} {beta_max=}")
  _check_floor(min_alpha_bar)
  t = jnp.asarray(t, jnp.float32)
  log_alpha_bar = -(beta_min * t + 0.5 * (beta_max - beta_min) * t ** 2)
  return jnp.clip(jnp.exp(log_alpha_bar), min_alpha_bar, 1.0)


def q_sample(x0: jax.Array, t: jax.Array, noise: jax.Array, *,
             schedule: Schedule = cosine_schedule) -> jax.Array:
  """The forward (noising) process: `x_t` given `x_0`, t and the noise.

  Args:
    x0: clean examples [B, ...].
    t: times in [0, 1], [B] (or a scalar for all).
    noise: standard normal noise [B, ...], the shape of `x0`.
    schedule: `t -> alpha_bar(t)`.

  Returns:
    `sqrt(alpha_bar) * x0 + sqrt(1 - alpha_bar) * noise` [B, ...], in the
    dtype of `x0` (the mixing weights are float32).

  Raises:
    ValueError: `x0` has no batch axis, `noise` is not the shape of `x0`, or
      `t` is neither a scalar nor [B].
    TypeError: `schedule` is not callable.
  """
  arguments.check_callables(schedule=schedule)
  _check_batched(x0, "x0")
  if noise.shape != x0.shape:
    raise ValueError(f"`noise` must have the shape of `x0`, got"
                     f" {noise.shape=} {x0.shape=}")
  t = jnp.asarray(t)
  if t.ndim and t.shape != x0.shape[:1]:
    raise ValueError(f"`t` must be a scalar or [B]=({x0.shape[0]},), got shape"
                     f" {t.shape}")
  alpha_bar = _per_example(schedule(t), x0.ndim)
  x_t = (jnp.sqrt(alpha_bar) * x0.astype(jnp.float32)
         + jnp.sqrt(1.0 - alpha_bar) * noise.astype(jnp.float32))
  return x_t.astype(x0.dtype)


def ddpm_loss(predict_noise: Callable[[jax.Array, jax.Array], jax.Array],
              x0: jax.Array, rng: jax.Array, *,
              schedule: Schedule = cosine_schedule,
              time_scale: float = DEFAULT_TIME_SCALE) -> jax.Array:
  """The DDPM objective: mean squared error of the predicted noise.

  Each example gets its own time t ~ U[0, 1] and noise; the model sees `x_t`
  and `t * time_scale`. Inside an `hk.transform`, pass the model's forward
  function and `hk.next_rng_key()`; outside, `functools.partial(apply_fn,
  params)` and a key.

  Args:
    predict_noise: `(x_t [B, ...], t [B] float32) -> noise [B, ...]`.
    x0: clean examples [B, ...] (any float dtype; `x_t` has it).
    rng: a JAX PRNG key (the time and noise draws).
    schedule: `t -> alpha_bar(t)`.
    time_scale: the model's time unit (positive).

  Returns:
    The loss, a float32 scalar (about 1 for a model that predicts zeros).

  Raises:
    ValueError: `x0` has no batch axis or is not floating point, or
      `time_scale` is not positive; or the prediction does not have the
      shape of `x0`.
    TypeError: `predict_noise` or `schedule` is not callable, `rng` is not a
      key, or `time_scale` is not a number.
  """
  arguments.check_callables(predict_noise=predict_noise, schedule=schedule)
  _check_batched(x0, "x0")
  if not jnp.issubdtype(x0.dtype, jnp.floating):
    raise ValueError(f"`x0` must be floating point, got {x0.dtype=}")
  arguments.check_key(rng=rng)
  arguments.check_positive_numbers(time_scale=time_scale)
  t_key, noise_key = jax.random.split(rng)
  t = jax.random.uniform(t_key, x0.shape[:1])  # [B]
  noise = jax.random.normal(noise_key, x0.shape, x0.dtype)  # [B, ...]
  x_t = q_sample(x0, t, noise, schedule=schedule)
  predicted = predict_noise(x_t, t * time_scale)
  if predicted.shape != x0.shape:
    raise ValueError(f"`predict_noise` must return the shape of `x0`"
                     f" {x0.shape}, got {predicted.shape}")
  error = predicted.astype(jnp.float32) - noise.astype(jnp.float32)
  return jnp.mean(error ** 2)


def ddim_sample(apply_fn: Callable[[Any, jax.Array, jax.Array], jax.Array],
                params: Any, rng: jax.Array, shape: Sequence[int], *,
                num_steps: int, schedule: Schedule = cosine_schedule,
                eta: float = 0.0, clip_x0: float | None = 1.0,
                time_scale: float = DEFAULT_TIME_SCALE) -> jax.Array:
  """DDIM: samples from pure noise at t = 1 down to t = 0 in `num_steps` steps.

  The times are evenly spaced. Each step predicts the noise in `x_t`, the
  clean sample it implies, `x0 = (x_t - sqrt(1 - ab_t) eps) / sqrt(ab_t)`
  (clipped to `[-clip_x0, clip_x0]`: near t = 1 it divides by a tiny
  `sqrt(ab_t)`), and moves to the next time s along
  `x_s = sqrt(ab_s) x0 + sqrt(1 - ab_s - sigma^2) eps + sigma z`, where
  `sigma = eta sqrt((1 - ab_s) / (1 - ab_t)) sqrt(1 - ab_t / ab_s)`: eta = 0
  is deterministic given `rng` (the probability-flow path), eta = 1 is
  DDPM's ancestral sampler. The whole loop is one `lax.fori_loop`; wrap the
  call in `jax.jit` (with `num_steps` static) to compile it once.

  Args:
    apply_fn: `apply_fn(params, x_t [B, ...] float32, t [B] float32) ->
      predicted noise [B, ...]`, t in model units (`t * time_scale`), e.g.
      `hk.without_apply_rng(hk.transform(f)).apply` (bind a Haiku state or
      an rng with `functools.partial` or a lambda).
    params: passed to `apply_fn` unchanged.
    rng: a JAX PRNG key: the starting noise (and with eta > 0 each step's).
    shape: the samples' shape (B, ...), B first.
    num_steps: model evaluations, >= 1.
    schedule: `t -> alpha_bar(t)`, the one the model was trained with.
    eta: the noise kept at each step, >= 0 (0: deterministic DDIM).
    clip_x0: clip each step's `x0` prediction to this magnitude (the data's
      range; 1.0 for data in [-1, 1]), or None for no clipping.
    time_scale: the model's time unit (positive).

  Returns:
    Samples [shape] float32, the last step's prediction of x0 (the
    schedule's last x_s still holds the noise of alpha_bar(0) where that is
    below 1; the prediction does not).

  Raises:
    ValueError: `shape` is empty or holds a non-positive size, `num_steps`
      < 1, `eta` < 0, `clip_x0` not positive, or `time_scale` not positive;
      or `apply_fn` returns another shape.
    TypeError: `apply_fn` or `schedule` is not callable, `rng` is not a key,
      `shape` is not a sequence, `num_steps` or a size in `shape` is not an
      integer, or `eta`, `clip_x0` or `time_scale` is not a number.
  """
  arguments.check_callables(apply_fn=apply_fn, schedule=schedule)
  arguments.check_key(rng=rng)
  if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
    raise TypeError(f"`shape` must be a sequence (B, ...) of sizes, got {shape=}")
  shape = tuple(shape)
  if not shape:
    raise ValueError("`shape` must be (B, ...), a batch size first, got ()")
  for size in shape:
    arguments.check_positive_ints(shape=size)
  arguments.check_positive_ints(num_steps=num_steps)
  arguments.check_nonnegative_numbers(eta=eta)
  arguments.check_positive_numbers_or_none(clip_x0=clip_x0)
  arguments.check_positive_numbers(time_scale=time_scale)

  times = jnp.linspace(1.0, 0.0, num_steps + 1)  # [num_steps + 1]
  start_key, step_key = jax.random.split(rng)
  x = jax.random.normal(start_key, shape, jnp.float32)

  def body(i, carry):
    x_t, _ = carry
    ab_t, ab_s = schedule(times[i]), schedule(times[i + 1])
    t_model = jnp.full(shape[:1], times[i] * time_scale, jnp.float32)
    eps = apply_fn(params, x_t, t_model)
    if jnp.shape(eps) != shape:  # raised while tracing, before any step runs
      raise ValueError(f"`apply_fn` must return the shape of its input {shape},"
                       f" got {jnp.shape(eps)}")
    eps = eps.astype(jnp.float32)
    x0 = (x_t - jnp.sqrt(1.0 - ab_t) * eps) / jnp.sqrt(ab_t)
    if clip_x0 is not None:
      x0 = jnp.clip(x0, -clip_x0, clip_x0)
    sigma = eta * jnp.sqrt((1.0 - ab_s) / (1.0 - ab_t) * (1.0 - ab_t / ab_s))
    x_s = jnp.sqrt(ab_s) * x0 + jnp.sqrt(jnp.maximum(1.0 - ab_s - sigma ** 2, 0.0)) * eps
    if eta:
      x_s = x_s + sigma * jax.random.normal(jax.random.fold_in(step_key, i), shape)
    return x_s, x0

  return jax.lax.fori_loop(0, num_steps, body, (x, x))[1]
