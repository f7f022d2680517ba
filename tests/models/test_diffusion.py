"""probjax_hk.diffusion: schedules, q_sample, the DDPM loss and the DDIM sampler.

The sampler is checked against exact denoisers: for data that is one point
x0, or a mixture of two, the noise in x_t is known in closed form, so a
correct sampler must land on the data.
"""

import functools
import os
import subprocess
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probjax_hk import diffusion

_REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))  # where `experiments` imports from
SCHEDULES = {"cosine": diffusion.cosine_schedule,
             "linear": diffusion.linear_schedule}


def _exact_noise(points, schedule=diffusion.cosine_schedule, time_scale=1000.0):
  """The exact noise predictor `(params, x_t, t) -> eps` for data spread evenly
  over `points` [K, ...]: eps = (x_t - sqrt(ab) E[x0 | x_t]) / sqrt(1 - ab)."""
  flat = points.reshape(len(points), -1)  # [K, F]

  def apply_fn(params, x_t, t):
    del params
    ab = schedule(t / time_scale)[:, None]  # [B, 1]
    x = x_t.reshape(len(x_t), -1)  # [B, F]
    distance = jnp.sum((x[:, None] - jnp.sqrt(ab)[:, None] * flat) ** 2, -1)  # [B, K]
    weights = jax.nn.softmax(-distance / (2 * (1 - ab)), axis=-1)
    mean = weights @ flat  # [B, F]
    return ((x - jnp.sqrt(ab) * mean) / jnp.sqrt(1 - ab)).reshape(x_t.shape)

  return apply_fn


def _image(seed=1):
  return jax.random.uniform(jax.random.key(seed), (1, 8, 8, 1), minval=-1, maxval=1)


# --- schedules ----------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_falls_from_one_to_its_floor(name):
  t = jnp.linspace(0.0, 1.0, 101)
  ab = SCHEDULES[name](t)
  assert ab.shape == t.shape and ab.dtype == jnp.float32
  np.testing.assert_allclose(ab[0], 1.0, rtol=1e-6)
  assert np.all(np.diff(np.asarray(ab)) < 0)
  assert 1e-5 <= ab[-1] < 1e-4
  assert SCHEDULES[name](jnp.zeros((2, 3))).shape == (2, 3)


def test_linear_schedule_is_ddpms_discrete_product():
  betas = np.linspace(1e-4, 0.02, 1000)
  steps = np.arange(1, 1001)
  np.testing.assert_allclose(diffusion.linear_schedule(steps / 1000.0),
                             np.cumprod(1 - betas), atol=1e-3)


def test_cosine_schedule_is_the_papers_formula():
  t = np.array([0.1, 0.5, 0.9])
  f = lambda u: np.cos((u + 0.008) / 1.008 * np.pi / 2) ** 2
  np.testing.assert_allclose(diffusion.cosine_schedule(t), f(t) / f(0), rtol=1e-5)


@pytest.mark.parametrize("fn, kwargs", [
    (diffusion.cosine_schedule, dict(offset=0.0)),
    (diffusion.cosine_schedule, dict(min_alpha_bar=0.0)),
    (diffusion.linear_schedule, dict(beta_min=-0.1)),
    (diffusion.linear_schedule, dict(beta_min=2.0, beta_max=1.0)),
    (diffusion.linear_schedule, dict(min_alpha_bar=1.0)),
])
def test_schedule_rejects_bad_parameters(fn, kwargs):
  with pytest.raises(ValueError, match=f"`{next(iter(kwargs))}`"):
    fn(jnp.zeros(2), **kwargs)


# --- q_sample and the loss ----------------------------------------------------


def test_q_sample_mixes_signal_and_noise_in_the_inputs_dtype():
  x0 = jax.random.normal(jax.random.key(0), (3, 4, 5))
  noise = jax.random.normal(jax.random.key(1), (3, 4, 5))
  t = jnp.array([0.0, 0.5, 1.0])
  x_t = diffusion.q_sample(x0, t, noise, schedule=diffusion.linear_schedule)
  ab = np.asarray(diffusion.linear_schedule(t))[:, None, None]
  np.testing.assert_allclose(x_t, np.sqrt(ab) * x0 + np.sqrt(1 - ab) * noise,
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(x_t[0], x0[0], rtol=1e-6)  # alpha_bar(0) = 1
  scalar_t = diffusion.q_sample(x0, 0.5, noise)
  np.testing.assert_allclose(
      scalar_t, diffusion.q_sample(x0, jnp.full((3,), 0.5), noise), atol=1e-6)
  bf16 = diffusion.q_sample(x0.astype(jnp.bfloat16), t, noise.astype(jnp.bfloat16))
  assert bf16.dtype == jnp.bfloat16


@pytest.mark.parametrize("kwargs, match", [
    (dict(x0=jnp.float32(1.0), t=0.5, noise=jnp.float32(1.0)), "`x0`"),
    (dict(x0=jnp.zeros((2, 3)), t=0.5, noise=jnp.zeros((2, 4))), "`noise`"),
    (dict(x0=jnp.zeros((2, 3)), t=jnp.zeros(3), noise=jnp.zeros((2, 3))), "`t`"),
])
def test_q_sample_rejects_bad_shapes(kwargs, match):
  with pytest.raises(ValueError, match=match):
    diffusion.q_sample(**kwargs)


@pytest.mark.parametrize("name", SCHEDULES)
def test_ddpm_loss_is_zero_for_the_exact_predictor_and_one_for_zeros(name):
  schedule = SCHEDULES[name]
  x0 = jnp.broadcast_to(_image(), (64, 8, 8, 1))
  # The exact predictor needs the model's time unit: a wrong one is not exact.
  exact = functools.partial(_exact_noise(_image(), schedule, time_scale=10.0), None)
  loss = diffusion.ddpm_loss(exact, x0, jax.random.key(0), schedule=schedule,
                             time_scale=10.0)
  assert loss.dtype == jnp.float32 and loss.shape == ()
  assert loss < 1e-4
  wrong_unit = diffusion.ddpm_loss(exact, x0, jax.random.key(0), schedule=schedule)
  assert wrong_unit > 0.1
  zeros = diffusion.ddpm_loss(lambda x, t: jnp.zeros_like(x), x0, jax.random.key(0),
                              schedule=schedule)
  np.testing.assert_allclose(zeros, 1.0, atol=0.1)  # E[noise^2]: 4096 draws, sd 0.02


def test_ddpm_loss_inside_hk_transform_trains_a_haiku_model():
  def loss(x0):
    model = lambda x, t: hk.Linear(x.shape[-1])(x) + 0.0 * t[:, None]
    return diffusion.ddpm_loss(model, x0, hk.next_rng_key())

  net = hk.transform(loss)
  x0 = jax.random.normal(jax.random.key(0), (16, 4))
  params = net.init(jax.random.key(1), x0)
  value, grads = jax.value_and_grad(net.apply)(params, jax.random.key(2), x0)
  assert np.isfinite(value)
  assert all(np.all(np.isfinite(g)) and np.any(g != 0)
             for g in jax.tree.leaves(grads))
  assert value == net.apply(params, jax.random.key(2), x0)  # a key fixes t, noise
  assert value != net.apply(params, jax.random.key(3), x0)


@pytest.mark.parametrize("args, kwargs, error, match", [
    (("not callable", jnp.zeros((2, 3))), {}, TypeError, "`predict_noise`"),
    ((jnp.zeros_like, jnp.zeros(())), {}, ValueError, "`x0`"),
    ((jnp.zeros_like, jnp.zeros((2, 3), jnp.int32)), {}, ValueError, "floating"),
    ((jnp.zeros_like, jnp.zeros((2, 3))), dict(time_scale=0.0), ValueError, "`time_scale`"),
    ((lambda x, t: x[:, :1], jnp.zeros((2, 3))), {}, ValueError,
     "`predict_noise` must return"),
])
def test_ddpm_loss_rejects_bad_arguments(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    diffusion.ddpm_loss(*args, jax.random.key(0), **kwargs)


# --- the sampler --------------------------------------------------------------


@pytest.fixture(scope="module")
def haiku_model():
  """A small noise predictor in Haiku's apply style, and its parameters."""
  def predict(x, t):  # [B, 8, 8, 1], [B] -> [B, 8, 8, 1]
    h = jnp.concatenate([x, jnp.broadcast_to(t[:, None, None, None] / 1000.0,
                                             x.shape)], axis=-1)
    return hk.Conv2D(1, 3)(jax.nn.tanh(hk.Conv2D(4, 3)(h)))

  net = hk.without_apply_rng(hk.transform(predict))
  params = net.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)), jnp.zeros((1,)))
  return net.apply, params


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_ddim_is_a_function_of_its_key(haiku_model, eta):
  apply_fn, params = haiku_model
  sample = jax.jit(functools.partial(diffusion.ddim_sample, apply_fn,
                                     shape=(3, 8, 8, 1), num_steps=4, eta=eta))
  a = sample(params, jax.random.key(0))
  assert a.shape == (3, 8, 8, 1) and a.dtype == jnp.float32
  assert np.all(np.abs(a) <= 1.0)  # clip_x0=1.0
  np.testing.assert_array_equal(a, sample(params, jax.random.key(0)))
  assert not np.allclose(a, sample(params, jax.random.key(1)))
  unjitted = diffusion.ddim_sample(apply_fn, params, jax.random.key(0),
                                   (3, 8, 8, 1), num_steps=4, eta=eta)
  np.testing.assert_allclose(a, unjitted, atol=1e-5)


def test_ddim_eta_adds_fresh_noise_each_step(haiku_model):
  apply_fn, params = haiku_model
  run = lambda eta: diffusion.ddim_sample(apply_fn, params, jax.random.key(0),
                                          (3, 8, 8, 1), num_steps=4, eta=eta)
  assert not np.allclose(run(0.0), run(1.0))


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("num_steps, eta", [(1, 0.0), (3, 0.0), (3, 1.0)])
def test_ddim_with_the_exact_noise_of_one_image_recovers_it(name, num_steps, eta):
  x0 = _image()  # [1, 8, 8, 1]
  schedule = SCHEDULES[name]
  out = diffusion.ddim_sample(_exact_noise(x0, schedule), None,
                              jax.random.key(0), (3, 8, 8, 1),
                              num_steps=num_steps, schedule=schedule, eta=eta)
  np.testing.assert_allclose(out, jnp.broadcast_to(x0, out.shape), atol=1e-4)


def test_ddim_with_the_exact_denoiser_of_two_points_lands_on_them():
  """The probability-flow path splits the noise between the two points."""
  points = jnp.stack([jnp.full((16,), 0.5), jnp.linspace(-0.8, 0.8, 16)])
  out = diffusion.ddim_sample(_exact_noise(points), None, jax.random.key(0),
                              (64, 16), num_steps=10)
  distance = jnp.max(jnp.abs(out[:, None] - points[None]), axis=-1)  # [64, 2]
  assert np.all(distance.min(axis=1) < 1e-3)
  nearest = np.asarray(distance.argmin(axis=1))
  assert 10 < nearest.sum() < 54  # both points are drawn


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(apply_fn=None), TypeError, "`apply_fn`"),
    (dict(shape=()), ValueError, "`shape`"),
    (dict(shape=(2, 0)), ValueError, "`shape`"),
    (dict(shape=(2, 3.0)), TypeError, "`shape`"),
    (dict(num_steps=0), ValueError, "`num_steps`"),
    (dict(num_steps=2.5), TypeError, "`num_steps`"),
    (dict(eta=-0.5), ValueError, "`eta`"),
    (dict(clip_x0=0.0), ValueError, "`clip_x0`"),
    (dict(time_scale=-1.0), ValueError, "`time_scale`"),
    (dict(apply_fn=lambda p, x, t: x[:, :1]), ValueError, "`apply_fn` must return"),
])
def test_ddim_rejects_bad_arguments(kwargs, error, match):
  args = dict(apply_fn=lambda p, x, t: x, params=None, rng=jax.random.key(0),
              shape=(2, 3), num_steps=2)
  args.update(kwargs)
  with pytest.raises(error, match=match):
    diffusion.ddim_sample(args.pop("apply_fn"), args.pop("params"),
                          args.pop("rng"), args.pop("shape"), **args)


def test_importing_the_module_defines_no_flags():
  """A user's absl program can import it (its flags stay its own); the main
  job, imported after it, is the control: it does define flags."""
  code = ("import probjax_hk.diffusion; from absl import flags;"
          " owners = lambda: sorted(m for m in flags.FLAGS.flags_by_module_dict()"
          " if not m.startswith('absl'));"
          " print(owners()); import experiments.train; print(owners())")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True, cwd=_REPOSITORY,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.stdout.split("\n")[:2] == ["[]", "['experiments.train']"]
