"""Bad configurations and inputs raise a ValueError naming the argument.

Each case builds (or calls) a model inside `hk.transform` and expects the
error at construction or at the start of the call, not a shape error from
deep inside jnp. Arguments already covered by the per-model test files are
not repeated here.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import probjax_hk as pk

B, T, D = 2, 4, 16
X = jnp.ones((B, T, D))


def _init(fn, *args):
  hk.transform_with_state(fn).init(jax.random.key(0), *args)


@pytest.mark.parametrize("fn, argument", [
    (lambda: pk.Transformer(D, 4, 1, widening_factor=0)(X), "widening_factor"),
    (lambda: pk.DiffusionTransformer(D, 4, 1, widening_factor=-1)(X, 0.0), "widening_factor"),
    (lambda: pk.MultiHeadAttention(0)(X), "num_heads"),
    (lambda: pk.MultiHeadAttention(4, num_kv_heads=-1)(X), "num_kv_heads"),
    (lambda: pk.MultiHeadAttention(4, head_dim=0)(X), "head_dim"),
    (lambda: pk.MultiHeadAttention(4)(X[..., :14]), "num_heads"),   # 4 does not divide 14
    (lambda: pk.MultiHeadAttention(4)(X[0]), "`x`"),
    (lambda: pk.MultiHeadAttention(4)(X[None]), "`x`"),
    (lambda: pk.MultiHeadAttention(4)(X, jnp.ones((B + 1, T, D))), "`context`"),
    (lambda: pk.MultiHeadAttention(4)(X, jnp.ones((T, D))), "`context`"),
    (lambda: pk.MLP(0)(X), "hidden_dim"),
    (lambda: pk.MLP(8, output_dim=0)(X), "output_dim"),
    (lambda: pk.Linear(0)(X), "output_size"),
    (lambda: pk.AdaLNModulation(D, 0)(X[:, 0]), "num_chunks"),
    (lambda: pk.AdaLNModulation(0, 2)(X[:, 0]), "model_dim"),
    (lambda: pk.TimestepEmbedding(0)(jnp.ones((B,))), "`dim`"),
    (lambda: pk.TimestepEmbedding(D, frequency_dim=7)(jnp.ones((B,))), "frequency_dim"),
    (lambda: pk.TimestepEmbedding(D)(jnp.ones((B, 1))), "`t`"),
    (lambda: pk.MoELayer(4, 2, 8)(jnp.ones(())), "`x`"),
    (lambda: pk.MoELayer(4, 2, 8)(jnp.ones((B, 0))), "`x`"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_module_arguments_raise(fn, argument):
  with pytest.raises(ValueError, match=argument):
    _init(fn)


@pytest.mark.parametrize("kwargs, argument", [
    ({"out_channels": 0}, "out_channels"),
    ({"out_channels": -1}, "out_channels"),
    ({"context_dim": 0}, "context_dim"),
    ({"context_dim": -3}, "context_dim"),
])
def test_bad_unet_arguments_raise(kwargs, argument):
  with pytest.raises(ValueError, match=argument):
    _init(lambda: pk.UNet(3, (8, 16), norm_groups=4, num_heads=2, **kwargs))


@pytest.mark.parametrize("fn, argument", [
    (lambda: pk.sinusoidal_embedding(jnp.ones((B,)), 0), "`dim`"),
    (lambda: pk.sinusoidal_embedding(jnp.ones((B,)), -2), "`dim`"),
    (lambda: pk.sinusoidal_embedding(jnp.ones((B, 1)), 8), "`t`"),
    (lambda: pk.sinusoidal_embedding(jnp.ones(()), 8), "`t`"),
    (lambda: pk.rotary_embedding(X, jnp.arange(T)), "`x`"),
    (lambda: pk.rotary_embedding(X.reshape(B, T, 2, 8), jnp.arange(T + 1)), "positions"),
    (lambda: pk.rotary_embedding(X.reshape(B, T, 2, 8), jnp.zeros((B + 1, T))), "positions"),
    (lambda: pk.dot_product_attention(X[..., None], X[..., None], X[..., None],
                                      local_window_size=-1), "local_window_size"),
    (lambda: pk.dot_product_attention(X[..., None], X[..., None], X[..., None],
                                      local_window_size=(1, 2, 3)), "local_window_size"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_function_arguments_raise(fn, argument):
  with pytest.raises(ValueError, match=argument):
    fn()


_SEQUENCE_MODELS = {
    "transformer": lambda x: pk.Transformer(D, 4, 1)(x),
    "dit": lambda x: pk.DiffusionTransformer(D, 4, 1)(x, 0.0),
    "lru": lambda x: pk.SSMModel(D, D, D, 1)(x),
    "ssd": lambda x: pk.SSMModel(D, D, D, 1, cell=pk.SSDCell, cell_kwargs={"num_heads": 2})(x),
}


@pytest.mark.parametrize("model", list(_SEQUENCE_MODELS))
@pytest.mark.parametrize("shape, axis", [((0, T, D), "B"), ((B, 0, D), "T")])
def test_empty_batch_or_time_axes_raise_naming_the_axis(model, shape, axis):
  """A ZeroDivisionError from a reshape inside the attention (or an op's
  `v needs T >= 1`), before."""
  with pytest.raises(ValueError, match=f"`x` must be .*{axis} >= 1"):
    _init(_SEQUENCE_MODELS[model], jnp.ones(shape))


@pytest.mark.parametrize("shape", [(0, 4, 4, 3), (B, 0, 4, 3)])
def test_unet_empty_axes_raise(shape):
  with pytest.raises(ValueError, match="`x` must be .*B, H, W >= 1"):
    _init(lambda x: pk.UNet(3, (8,), norm_groups=4, num_heads=2)(x, 0.0), jnp.ones(shape))


def test_token_wise_layers_map_an_empty_batch_to_an_empty_output():
  model = hk.transform_with_state(
      lambda x: (pk.MLP(8)(pk.Linear(D)(x)), pk.MoELayer(4, 2, 8)(pk.RMSNorm()(x))))
  params, state = jax.eval_shape(model.init, jax.random.key(0), X[0])
  (mlp, moe), _ = jax.eval_shape(model.apply, params, state, None, X[0, :0])
  assert mlp.shape == moe.shape == (0, D)


def test_good_rotary_positions_still_run():
  q = X.reshape(B, T, 2, 8)
  for positions in (jnp.arange(T), jnp.arange(T)[None], jnp.tile(jnp.arange(T), (B, 1))):
    assert pk.rotary_embedding(q, positions).shape == q.shape


# --- SSM decoding ---------------------------------------------------------------

CELLS = {
    "lru": (pk.LRUCell, {"state_dim": 4}),
    "mamba": (pk.MambaCell, {"state_dim": 4}),
    "ssd": (pk.SSDCell, {"num_heads": 2, "state_dim": 4}),
    "mamba2": (pk.Mamba2Cell, {"head_dim": 8, "state_dim": 4}),
    "gated_delta_net": (pk.GatedDeltaNetCell, {"num_heads": 2}),
}
I, O = 3, 5
BAD_STATES = {
    "batch+1": lambda s: jax.tree.map(lambda a: jnp.concatenate([a, a[:1]]), s),
    "batch_1": lambda s: jax.tree.map(lambda a: a[:1], s),
    "width+1": lambda s: jax.tree.map(lambda a: jnp.concatenate([a, a[..., :1]], -1), s),
    "none": lambda s: None,
}


@pytest.mark.parametrize("bad", list(BAD_STATES))
@pytest.mark.parametrize("cell", list(CELLS))
def test_cell_step_with_a_wrong_state_raises(cell, bad):
  cls, kwargs = CELLS[cell]

  def f():
    c = cls(**kwargs, model_dim=D)
    return c.step(jnp.ones((B, D)), BAD_STATES[bad](c.initial_state(B)))
  with pytest.raises(ValueError, match="`state`"):
    _init(f)


@pytest.mark.parametrize("cell", list(CELLS))
def test_cell_bad_input_ranks_raise(cell):
  cls, kwargs = CELLS[cell]
  with pytest.raises(ValueError, match=r"`(x|u)` must be \[B, T, D\]"):
    _init(lambda: cls(**kwargs)(jnp.ones((B, D))))
  with pytest.raises(ValueError, match=r"`(x_t|u_t)` must be \[B, H\]"):
    _init(lambda: (lambda c: c.step(jnp.ones((B, T, D)), c.initial_state(B)))(
        cls(**kwargs, model_dim=D)))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_model_step_with_the_wrong_layer_count_raises(scan_layers):
  def f():
    m = pk.SSMModel(I, D, O, 2, scan_layers=scan_layers)
    state = jax.tree.map(lambda a: a[:1], m.initial_state(B)) if scan_layers else \
        m.initial_state(B)[:1]
    return m.step(jnp.ones((B, I)), state)
  with pytest.raises(ValueError, match="`state`.*num_layers=2"):
    _init(f)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_model_step_with_a_wrong_state_shape_raises(scan_layers):
  def f():
    m = pk.SSMModel(I, D, O, 2, scan_layers=scan_layers)
    state = jax.tree.map(lambda a: jnp.concatenate([a, a[..., :1]], -1), m.initial_state(B))
    return m.step(jnp.ones((B, I)), state)
  with pytest.raises(ValueError, match="`state`"):
    _init(f)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(num_experts=4.0), "num_experts"),
    (dict(top_k=2.0), "top_k"),
    (dict(d_hidden=True), "d_hidden"),
])
def test_moe_sizes_must_be_ints(kwargs, argument):
  """A float size failed deep inside (a TypeError from a reshape or top_k)."""
  sizes = dict(num_experts=4, top_k=2, d_hidden=8) | kwargs
  with pytest.raises(TypeError, match=argument):
    _init(lambda: pk.MoELayer(**sizes)(X))


def test_moe_takes_numpy_ints():
  _init(lambda: pk.MoELayer(np.int64(4), np.int32(2), np.int64(8))(X))


@pytest.mark.parametrize("fn, argument", [
    (lambda: pk.Transformer(16.0, 4, 1)(X), "model_dim"),  # ran silently
    (lambda: pk.Transformer(D, 4.0, 1)(X), "num_heads"),
    (lambda: pk.DiffusionTransformer(D, 4, 2.0)(X, jnp.ones((B,))), "num_layers"),
    (lambda: pk.Transformer(D, 4, 1, num_kv_heads=True)(X), "num_kv_heads"),
    (lambda: pk.MultiHeadAttention(4.0)(X), "num_heads"),
    (lambda: pk.MultiHeadAttention(4, head_dim=8.0)(X), "head_dim"),
    (lambda: pk.MLP(8.0)(X), "hidden_dim"),
    (lambda: pk.Linear(8.0)(X), "output_size"),
    (lambda: pk.SSMModel(D, 32, D, 1.0, cell=pk.MambaCell)(X), "num_layers"),
])
def test_float_sizes_raise_a_type_error(fn, argument):
  """Sizes are integers: a float gave a shape error from inside Haiku or jax
  (or, for the Transformer's width, ran)."""
  with pytest.raises(TypeError, match=f"`{argument}` must be a positive integer"):
    _init(fn)


def test_numpy_int_sizes_are_sizes():
  _init(lambda: pk.Transformer(np.int64(D), np.int32(4), np.int64(1))(X))
