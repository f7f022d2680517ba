"""Bad arguments to `fit()` / `fit_model()` raise an error naming the argument
before any training step (most before anything is compiled)."""

import numpy as np
import optax
import pytest

import probjax_hk
from probjax_hk import fit
from tests.training import common


@pytest.fixture(scope="module")
def setup():
  # Built outside the compile counts: making them compiles small programs
  # the first time a worker process does it.
  return common.init_params(), common.make_data()


def _bad_arguments(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  data = common.make_data()
  return [
      # Orbax failed only at the first save, after the training steps.
      (dict(checkpoint_dir=str(a_file)), ValueError, "`checkpoint_dir` must be a directory"),
      (dict(checkpoint_dir=str(a_file / "sub")), ValueError, "`checkpoint_dir` must be a directory"),
      (dict(checkpoint_dir=5), TypeError, "`checkpoint_dir` must be a path"),
      # AttributeError / TypeError from deep inside.
      (dict(optimizer=optax.adam), TypeError, "`optimizer` must be an optax"),
      (dict(callbacks=lambda step, metrics: None), TypeError, "`callbacks` must be a sequence"),
      (dict(mesh="cpu"), TypeError, "`mesh` must be a jax.sharding.Mesh"),
      # Failed only at the first evaluation, after the training steps.
      (dict(validation_data={"x": data["x"]}), ValueError, "`validation_data` batches do not fit"),
      (dict(validation_data=[{"x": data["x"][:8, :3], "y": data["y"][:8]}]), ValueError,
       "`validation_data` batches do not fit"),
      # range() arg 3 must not be zero, at the first evaluation.
      (dict(validation_data={k: v[:0] for k, v in data.items()}), ValueError,
       "`validation_data` holds no examples"),
      # Silent: a validation loss of 0.0 was recorded.
      (dict(validation_data=[]), ValueError, "`validation_data` is empty"),
  ]


@pytest.mark.parametrize("case", range(10))
def test_bad_arguments_raise_before_training(setup, tmp_path, case):
  params, data = setup
  kwargs, error, match = _bad_arguments(tmp_path)[case]
  with common.count_compiles() as compiles:
    with pytest.raises(error, match=match):
      fit(common.loss_fn, params, data, batch_size=16, num_steps=2,
          optimizer=kwargs.pop("optimizer", common.OPTIMIZER), progress=False,
          **kwargs)
  assert not compiles
  assert not any(p.name.isdigit() for p in tmp_path.rglob("*"))  # no checkpoint


def test_loss_fn_must_be_callable(setup):
  params, data = setup
  with pytest.raises(TypeError, match="`loss_fn` must be callable"):
    fit(3, params, data, batch_size=16, num_steps=2, progress=False)


def test_data_without_examples_raises(setup):
  params, data = setup
  # ZeroDivisionError without a batch_size.
  with pytest.raises(ValueError, match="`data` holds no examples"):
    fit(common.loss_fn, params, {k: v[:0] for k, v in data.items()}, epochs=1,
        progress=False)


@pytest.mark.parametrize("kwargs, match", [
    # TypeError: slice indices must be integers (from the init batch).
    (dict(batch_size="16", epochs=1), "`batch_size` must be a positive integer"),
    (dict(batch_size=16, num_steps=1, steps_per_call=-2),
     "`steps_per_call` must be a positive integer"),
])
def test_fit_model_checks_arguments_before_init(kwargs, match):
  calls = []
  net = common.NET
  transformed = type(net)(lambda *a, **k: calls.append(1) or net.init(*a, **k), net.apply)
  with pytest.raises(ValueError, match=match):
    probjax_hk.fit_model(transformed, common.make_data(), progress=False, **kwargs)
  assert not calls  # transformed.init never ran


def test_fit_model_checkpoint_dir_is_checked_before_init(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  calls = []
  net = common.NET
  transformed = type(net)(lambda *a, **k: calls.append(1) or net.init(*a, **k), net.apply)
  with pytest.raises(ValueError, match="`checkpoint_dir` must be a directory"):
    probjax_hk.fit_model(transformed, common.make_data(), batch_size=16, num_steps=1,
                         checkpoint_dir=str(a_file), progress=False)
  assert not calls
  np.testing.assert_equal(a_file.read_text(), "")
