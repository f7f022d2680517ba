"""fit() compiles a program once, whoever builds the Python objects again.

Each check counts compilations twice: JAX's compile log (`jax_log_compiles`:
one 'Compiling ...' line per program lowered for XLA) and the backend-compile
events of `common.count_compiles` (persistent-cache hits included).
"""

import contextlib
import logging

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import probjax_hk as pk
from probjax_hk.training import programs
from tests.training import common


@pytest.fixture
def compiles(caplog):
  """`with compiles() as seen:` -> seen['log'] (the compile log's lines) and
  seen['events'] (backend compiles), filled when the block ends."""
  previous = jax.config.jax_log_compiles
  jax.config.update("jax_log_compiles", True)

  @contextlib.contextmanager
  def count():
    seen = {}
    start = len(caplog.records)
    with caplog.at_level(logging.WARNING), common.count_compiles() as events:
      yield seen
    seen["log"] = [r.getMessage()[:120] for r in caplog.records[start:]
                   if r.getMessage().startswith("Compiling ")]
    seen["events"] = list(events)

  yield count
  jax.config.update("jax_log_compiles", previous)


def _assert_none(seen):
  assert not seen["log"], seen["log"]
  assert not seen["events"], seen["events"]


def _assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


_KW = dict(batch_size=32, num_steps=4, progress=False, rng=3)


def _fit(loss_fn, optimizer, **kw):
  return pk.fit(loss_fn, common.init_params(), common.make_data(),
                optimizer=optimizer, **dict(_KW, **kw))


def _make_loss():
  """A loss function defined anew on every call (as a notebook cell run
  again defines it)."""
  def loss(params, rng, batch):
    return common.NET.apply(params, rng, batch)
  return loss


def test_inline_optimizer_compiles_nothing_the_second_time(compiles):
  validation = common.make_data(40, seed=1)
  with compiles() as first:
    r1 = _fit(common.loss_fn, optax.adam(0.0131), validation_data=validation,
              eval_every=2)
  with compiles() as second:
    r2 = _fit(common.loss_fn, optax.adam(0.0131), validation_data=validation,
              eval_every=2)
  assert first["log"] and first["events"]
  _assert_none(second)
  _assert_trees_equal(r1.params, r2.params)
  np.testing.assert_array_equal(r1.history["val_loss"], r2.history["val_loss"])


def test_redefined_loss_function_compiles_nothing(compiles):
  optimizer = optax.adam(0.0132)
  loss_a, loss_b = _make_loss(), _make_loss()
  assert loss_a is not loss_b
  with compiles() as first:
    r1 = _fit(loss_a, optimizer)
  with compiles() as second:
    r2 = _fit(loss_b, optax.adam(0.0132))
  assert first["log"]
  _assert_none(second)
  _assert_trees_equal(r1.params, r2.params)


def test_new_transform_of_the_same_model_compiles_nothing(compiles):
  data = common.make_data()
  for parameter_sharding in ("replicated", "fsdp"):  # fsdp: a compiled init
    kw = dict(optimizer=optax.adam(0.0133), parameter_sharding=parameter_sharding,
              **_KW)
    with compiles() as first:
      r1 = pk.fit_model(hk.transform(common._mlp_loss), data, **kw)  # pylint: disable=protected-access
    kw["optimizer"] = optax.adam(0.0133)
    with compiles() as second:
      r2 = pk.fit_model(hk.transform(common._mlp_loss), data, **kw)  # pylint: disable=protected-access
    assert first["log"], parameter_sharding
    _assert_none(second)
    _assert_trees_equal(r1.params, r2.params)


def test_closed_over_values_enter_the_program(compiles):
  def make_loss(scale):
    scale = jnp.asarray(scale, jnp.float32)  # a constant of the jaxpr
    def loss(params, rng, batch):
      return scale * common.NET.apply(params, rng, batch)
    return loss
  optimizer = optax.sgd(0.0134)
  r1 = _fit(make_loss(2.0), optimizer)
  with compiles() as same:
    r2 = _fit(make_loss(2.0), optimizer)
  with compiles() as other:
    r3 = _fit(make_loss(3.0), optimizer)
  _assert_none(same)
  _assert_trees_equal(r1.params, r2.params)
  assert other["log"] and other["events"]
  # The first step's loss is at the same parameters: scaled by 3 / 2.
  np.testing.assert_allclose(r3.history["loss"][0],
                             1.5 * r1.history["loss"][0], rtol=1e-6)


def test_a_changed_program_compiles(compiles):
  base = _fit(common.loss_fn, optax.adam(0.0135))
  with compiles() as learning_rate:
    other_rate = _fit(common.loss_fn, optax.adam(0.0136))
  assert learning_rate["log"] and learning_rate["events"]
  assert not np.array_equal(base.history["loss"], other_rate.history["loss"])
  assert base.history["loss"][0] == other_rate.history["loss"][0]

  with compiles() as optimizer:
    _fit(common.loss_fn, optax.sgd(0.0135))
  assert optimizer["log"] and optimizer["events"]

  wide = hk.transform(lambda batch: jnp.mean(
      (hk.nets.MLP([24, 1])(batch["x"])[:, 0] - batch["y"]) ** 2))
  with compiles() as width:
    pk.fit_model(wide, common.make_data(), optimizer=optax.adam(0.0135), **_KW)
  assert width["log"] and width["events"]


def _custom_vjp_grad(factor):
  """grad of a custom_vjp function whose backward rule scales by `factor`:
  the forward jaxprs are equal, the gradient programs are not."""
  @jax.custom_vjp
  def f(x):
    return jnp.sin(x)
  f.defvjp(lambda x: (jnp.sin(x), None), lambda _, g: (factor * g,))
  return jax.grad(lambda x: f(x).sum())


def test_program_key_separates_what_compiles_differently(compiles):
  mesh = pk.training.default_mesh()
  x = np.ones(3, np.float32)
  with compiles() as first:
    two = programs.Program(_custom_vjp_grad(2.0), mesh)(x)
  with compiles() as again:
    two_again = programs.Program(_custom_vjp_grad(2.0), mesh)(x)
  with compiles() as other:
    three = programs.Program(_custom_vjp_grad(3.0), mesh)(x)
  assert first["log"] and other["log"]
  _assert_none(again)
  np.testing.assert_array_equal(two, two_again)
  np.testing.assert_array_equal(three, np.full(3, 3.0, np.float32))

  def key(fn, *args):
    sig = programs.signature(args, ())
    return programs.program_key(jax.jit(fn).trace(*args), sig, mesh)[0]
  assert key(lambda v: v * 0.0, x) != key(lambda v: v * -0.0, x)
  assert key(lambda v: v + 1, x) == key(lambda v: v + 1, x)
  assert key(lambda v: v + 1, x) != key(lambda v: v + 1, x.astype(np.int32))
  consts = np.arange(3, dtype=np.float32)
  assert key(lambda v: v + consts, x) != key(lambda v: v + consts[::-1], x)


def test_executables_cache_is_bounded_and_signatures_switch(compiles,
                                                           monkeypatch):
  monkeypatch.setattr(programs, "CACHE_SIZE", 2)
  mesh = pk.training.default_mesh()
  make = lambda c: lambda v: v * c + 0.0137  # a new function every call
  for c in range(3):
    programs.Program(make(c), mesh)(np.ones(2, np.float32))
  assert len(programs._executables) == 2  # pylint: disable=protected-access
  with compiles() as evicted:  # the oldest was dropped
    programs.Program(make(0), mesh)(np.ones(2, np.float32))
  with compiles() as kept:
    programs.Program(make(2), mesh)(np.ones(2, np.float32))
  assert evicted["log"]
  _assert_none(kept)

  program = programs.Program(make(2), mesh)
  np.testing.assert_allclose(program(np.ones(2, np.float32)), [2.0137] * 2)
  with compiles() as other_shape:
    np.testing.assert_allclose(program(np.ones(3, np.float32)), [2.0137] * 3)
  with compiles() as back:
    program(np.ones(2, np.float32))
  assert other_shape["log"]
  _assert_none(back)
