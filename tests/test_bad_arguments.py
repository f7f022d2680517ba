"""Every public constructor and function refuses a wrong value of each of its
arguments with a ValueError or TypeError whose message names the argument.

`TABLE` holds, per public callable, arguments that work and rows
`(argument, wrong value, error)`; each row calls it with the good arguments,
one replaced. Modules are only constructed (inside `hk.transform`, never
called) and functions get tiny arrays, so almost nothing compiles.
`test_every_argument_has_a_row` keeps the table complete: a new public
callable or argument fails it until it has a row here or a reason in
`NO_ROW` (records and exceptions need none).
"""

import dataclasses
import inspect
import re
import types
from typing import Any, Callable, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import probjax_hk as pk
from probjax_hk import diffusion
from probjax_hk import training

V, T = ValueError, TypeError
B, L, D = 2, 4, 16
X = jnp.ones((B, L, D))                     # [B, T, D]
Q = jnp.ones((B, L, 2, 8))                  # [B, T, N, H]
CACHE = jnp.ones((B, 6, 2, 8))              # [B, S, K, H]
KEY = jax.random.key(0)
PARAMS = {"w": np.zeros((3,), np.float32)}
DATA = {"x": np.ones((8, 3), np.float32)}


class Lazy(NamedTuple):
  """An argument built where the call runs (a module inside the transform)."""
  make: Callable[[], Any]


def _loss(params, rng, batch):
  return jnp.mean(batch["x"] @ params["w"])


_NET = hk.transform(lambda batch: jnp.mean(hk.Linear(1)(batch["x"])))


def _token_model():
  return pk.TokenModel(pk.Transformer(D, 4, 1, is_causal=True), vocab_size=7)


def _name_rows():
  # A string that is no identifier is Haiku's to refuse (its message quotes it).
  return [("name", 5, T)]


# name -> (good arguments, rows). Names are those of `probjax_hk`, `.diffusion`
# and `.training`.
TABLE: dict[str, tuple[dict[str, Any], list[tuple[str, Any, type]]]] = {
    "Transformer": (dict(model_dim=D, num_heads=4, num_layers=1), [
        ("model_dim", 16.0, T), ("model_dim", 0, V), ("num_heads", 3, V),
        ("num_heads", "4", T), ("num_layers", 0, V), ("num_kv_heads", 3, V),
        ("widening_factor", 0, V), ("attention_fn", "xla", T), ("is_causal", "yes", T),
        ("dropout_rate", 1.0, V), ("dropout_rate", "0.1", T),
        ("remat_policy", "sometimes", V), ("scan_layers", 1, T), ("scan_unroll", 0, V),
        ("use_rope", None, T), ("mlp_activation", "relu6", V),
        ("local_window_size", -1, V), *_name_rows()]),
    "DiffusionTransformer": (dict(model_dim=D, num_heads=4, num_layers=1), [
        ("model_dim", -1, V), ("num_heads", 5, V), ("num_layers", 1.0, T),
        ("num_kv_heads", 0, V), ("widening_factor", 2.5, T), ("attention_fn", 1, T),
        ("dropout_rate", -0.1, V), ("remat_policy", "dots", V), ("scan_layers", "no", T),
        ("scan_unroll", -1, V), ("use_rope", 0, T), *_name_rows()]),
    "MultiHeadAttention": (dict(num_heads=4), [
        ("num_heads", 0, V), ("num_heads", 4.0, T), ("num_kv_heads", 3, V),
        ("head_dim", 0, V), ("use_rope", "no", T), ("rope_base", 0.0, V),
        ("rope_base", "1e4", T), ("qk_norm", 1, T), ("attention_fn", None, T),
        ("with_bias", "no", T), *_name_rows()]),
    "Linear": (dict(output_size=8), [
        ("output_size", 0, V), ("output_size", 8.0, T), ("with_bias", "no", T),
        ("w_init", "zeros", T), ("b_init", 0, T), *_name_rows()]),
    "RMSNorm": ({}, [
        ("eps", -1e-6, V), ("eps", "1e-6", T), ("create_scale", "no", T), *_name_rows()]),
    "LayerNorm": ({}, [
        ("eps", float("nan"), V), ("create_scale", None, T), ("create_offset", "no", T),
        *_name_rows()]),
    "MLP": (dict(hidden_dim=8), [
        ("hidden_dim", 0, V), ("output_dim", 0, V), ("output_dim", 2.0, T),
        ("activation", "relu", V), *_name_rows()]),
    "AdaLNModulation": (dict(model_dim=D, num_chunks=2), [
        ("model_dim", 0, V), ("num_chunks", 2.0, T), *_name_rows()]),
    "TimestepEmbedding": (dict(dim=D), [
        ("dim", 0, V), ("frequency_dim", 7, V), ("frequency_dim", 8.0, T),
        *_name_rows()]),
    "modulate": (dict(x=X, shift=jnp.zeros((B, 1, D)), scale=jnp.zeros((B, 1, D))), [
        ("x", jnp.ones((B, L, D), jnp.int32), V), ("shift", jnp.zeros((B + 1, 1, D)), V),
        ("scale", jnp.zeros((B, 1, D + 1)), V)]),
    "sinusoidal_embedding": (dict(t=jnp.ones(B), dim=8), [
        ("t", jnp.ones((B, 1)), V), ("dim", 7, V), ("dim", 8.0, T),
        ("max_period", 0.0, V), ("max_period", "1e4", T)]),
    "rotary_embedding": (dict(x=Q, positions=jnp.arange(L)), [
        ("x", X, V), ("x", Q[..., :7], V), ("positions", jnp.arange(L + 1), V),
        ("base", -1.0, V)]),
    "dot_product_attention": (dict(query=Q, key=Q, value=Q), [
        ("query", Q[0, 0], V), ("key", Q[..., :4], V), ("value", Q[:, :3], V),
        ("bias", jnp.ones((3, 3)), V), ("mask", jnp.ones((3, 3), bool), V),
        ("query_seq_lengths", jnp.ones((B + 1,), jnp.int32), V),
        ("key_value_seq_lengths", jnp.ones((B,)), V), ("local_window_size", -1, V),
        ("scale", "x", T), ("scale", float("nan"), V), ("is_causal", "no", T),
        ("return_residual", 1, T), ("implementation", "bogus", V)]),
    "cached_attention": (dict(query=Q, key_cache=CACHE, value_cache=CACHE,
                              lengths=jnp.array([5, 6])), [
        ("query", Q[0], V), ("key_cache", CACHE[..., :4], V), ("value_cache", CACHE[:, :5], V),
        ("lengths", jnp.array([5]), V), ("scale", "x", T),
        ("local_window_size", (1, 2, 3), V), ("implementation", "bogus", V)]),
    "choose_attention_implementation": (dict(query=Q, key=Q, value=Q), [
        ("query", Q[0, 0], V), ("scale", "x", T), ("is_causal", "no", T),
        ("return_residual", None, T), ("implementation", "bogus", V)]),
    "MoELayer": (dict(num_experts=4, top_k=2, d_hidden=8), [
        ("num_experts", 4.0, T), ("top_k", 5, V), ("d_hidden", 0, V),
        ("activation", "relu", V), ("dropless_impl", "fast", V),
        ("capacity_factor", 0.0, V), ("capacity_factor", "1.25", T),
        ("router_z_loss_weight", -1.0, V), ("load_balance_loss_weight", "x", T),
        ("expert_axis", 5, T), ("expert_axis", "", V),
        ("grouped_matmul_implementation", "cuda", V), *_name_rows()]),
    "expert_parameter_sharding": (dict(expert_axis="expert"), [
        ("expert_axis", 5, V), ("expert_axis", "", V)]),
    "tensor_parameter_sharding": ({}, [
        ("tensor_axis", 5, V), ("tensor_axis", "", V)]),
    "LRUCell": ({}, [
        ("state_dim", 0, V), ("state_dim", 4.0, T), ("model_dim", -1, V),
        ("r_min", -0.1, V), ("r_min", "0", T),
        ("r_max", 2.0, V), ("max_phase", 0.0, V), ("implementation", "bogus", V),
        *_name_rows()]),
    "MambaCell": ({}, [
        ("state_dim", 0, V), ("model_dim", 8.0, T), ("expand", 0, V), ("expand", 2.0, T),
        ("conv_width", 0, V), ("dt_rank", 0, V), ("dt_rank", "full", T),
        ("dt_min", 0.0, V), ("dt_max", 1e-4, V), ("implementation", "bogus", V),
        *_name_rows()]),
    "SSDCell": (dict(num_heads=2), [
        ("num_heads", 0, V), ("head_dim", 0, V), ("state_dim", 0, V),
        ("model_dim", 15, V), ("chunk_size", 0, V), ("chunk_size", 64.0, T),
        ("implementation", "bogus", V), *_name_rows()]),
    "Mamba2Cell": ({}, [
        ("expand", 0, V), ("head_dim", 0, V), ("state_dim", 0, V), ("conv_width", 0, V),
        ("ngroups", 0, V), ("model_dim", 0, V), ("chunk_size", -1, V),
        ("implementation", "bogus", V), *_name_rows()]),
    "GatedDeltaNetCell": (dict(num_heads=2), [
        ("num_heads", 0, V), ("head_dim", 0, V), ("conv_width", 0, V),
        ("use_output_gate", "yes", T), ("model_dim", 15, V), ("chunk_size", 0, V),
        ("implementation", "bogus", V), *_name_rows()]),
    "SSMModel": (dict(input_dim=3, model_dim=D, output_dim=5, num_layers=1), [
        ("input_dim", 0, V), ("model_dim", 0, V), ("output_dim", 5.0, T),
        ("num_layers", 0, V), ("cell", "lru", T), ("cell_kwargs", {"bogus": 1}, V),
        ("cell_kwargs", "state_dim=4", T), ("bidirectional", "yes", T),
        ("dropout_rate", 1.0, V), ("remat_policy", "sometimes", V),
        ("scan_layers", "no", T), *_name_rows()]),
    "UNet": (dict(in_channels=3, channels=(8, 16), norm_groups=4, num_heads=2), [
        ("in_channels", 0, V), ("channels", (), V), ("channels", (8, 16.0), T),
        ("channels", 8, T), ("out_channels", 0, V), ("num_res_blocks", 0, V),
        ("attention_levels", (2,), V), ("num_heads", 3, V), ("time_embedding_dim", 0, V),
        ("context_dim", -3, V), ("dropout_rate", 1.0, V), ("norm_groups", 3, V),
        ("remat_policy", "sometimes", V), ("attention_fn", None, T), *_name_rows()]),
    "TokenModel": (dict(body=Lazy(lambda: pk.Transformer(D, 4, 1, is_causal=True)),
                        vocab_size=7), [
        ("body", "transformer", T), ("vocab_size", 0, V), ("embed_dim", 0, V),
        ("dtype", "int32", T), *_name_rows()]),
    # Its rows raise before the parameters are read.
    "generate": (dict(model_fn=_token_model, params={},
                      prompt=jnp.zeros((B, 3), jnp.int32), num_tokens=2, rng=KEY), [
        ("model_fn", 5, V), ("prompt", jnp.zeros((B, 3)), V), ("num_tokens", 0, V),
        ("temperature", -1.0, V), ("temperature", jnp.ones(B + 1), V), ("top_k", 0, V),
        ("rng", "x", T), ("top_p", 0.0, V), ("top_p", "0.9", T), ("min_p", 1.5, V),
        ("repetition_penalty", 0.0, V), ("stop_tokens", 7, V), ("stop_tokens", 1.5, T),
        ("pad_token", -1, V), ("pad_token", 1.0, T),
        ("prompt_lengths", jnp.array([1, 0]), V), ("prompt_lengths", jnp.ones(B), V),
        ("return_log_probs", "yes", T), ("draft_model_fn", 5, V),
        ("draft_params", PARAMS, V),                     # without `draft_model_fn`
        ("num_draft_tokens", 0, V), ("num_draft_tokens", 2.0, T),
        ("return_acceptance_rate", "yes", T)]),
    "stack_layer_params": (dict(params={"m/block_0": {"w": jnp.zeros(2)}}), [
        ("params", "params", T), ("params", {"m/block_0": 1}, T)]),
    "unstack_layer_params": (dict(params={"m/blocks/block": {"w": jnp.zeros((2, 2))}}), [
        ("params", [1], T)]),
    "diffusion.cosine_schedule": (dict(t=jnp.zeros(2)), [
        ("offset", 0.0, V), ("offset", "s", T), ("min_alpha_bar", 1.0, V)]),
    "diffusion.linear_schedule": (dict(t=jnp.zeros(2)), [
        ("beta_min", -0.1, V), ("beta_max", "20", T), ("min_alpha_bar", 0.0, V)]),
    "diffusion.q_sample": (dict(x0=jnp.zeros((B, 3)), t=0.5, noise=jnp.zeros((B, 3))), [
        ("x0", jnp.float32(1.0), V), ("t", jnp.zeros(B + 1), V),
        ("noise", jnp.zeros((B, 4)), V), ("schedule", "cosine", T)]),
    "diffusion.ddpm_loss": (dict(predict_noise=lambda x, t: x, x0=jnp.zeros((B, 3)),
                                 rng=KEY), [
        ("predict_noise", "model", T), ("x0", jnp.zeros(()), V),
        ("x0", jnp.zeros((B, 3), jnp.int32), V), ("rng", 0, T), ("schedule", None, T),
        ("time_scale", 0.0, V)]),
    "diffusion.ddim_sample": (dict(apply_fn=lambda p, x, t: x, params=None, rng=KEY,
                                   shape=(B, 3), num_steps=1), [
        ("apply_fn", None, T), ("rng", "key", T), ("shape", (), V), ("shape", "ab", T),
        ("shape", (B, 0), V), ("num_steps", 0, V), ("num_steps", 2.5, T),
        ("schedule", 5, T), ("eta", -0.5, V), ("clip_x0", 0.0, V), ("time_scale", -1.0, V)]),
    "fit": (dict(loss_fn=_loss, params=PARAMS, data=DATA, num_steps=1,
                          progress=False), [
        ("loss_fn", 3, T), ("params", None, V), ("params", {"w": np.zeros(3, np.int32)}, T),
        ("data", None, V), ("optimizer", optax.adam, T), ("batch_size", 0, V),
        ("num_steps", 0, V), ("epochs", 0, V), ("rng", "seed", T), ("rng", 1.5, V),
        ("state", "x", T), ("validation_data", [], V), ("eval_every", 0, V),
        ("callbacks", lambda step, metrics: None, T), ("checkpoint_dir", 5, T),
        ("checkpoint_every", 0, V), ("keep_checkpoints", 0, V), ("resume", "no", T),
        ("mesh", "cpu", T), ("parameter_sharding", "tensor", V),
        ("sequence_axis", "time", V), ("donate", "yes", T),
        ("progress", "yes", T), ("log_every", 0, V), ("last_batch", "keep", V),
        ("on_nonfinite", "ignore", V), ("steps_per_call", 0, V)]),
    "fit_model": (dict(transformed=_NET, data=DATA, num_steps=1, progress=False), [
        ("transformed", _NET.apply, V), ("data", None, V), ("params", "x", T),
        ("state", {}, V), ("rng", "seed", T)]),
    "load_checkpoint": (dict(directory="."), [
        ("directory", 5, T), ("directory", "/nonexistent/checkpoints", V)]),
    "EarlyStopping": (dict(patience=2), [
        ("patience", 0, V), ("patience", 2.5, T), ("monitor", 5, T),
        ("min_delta", -1.0, V), ("mode", "up", V)]),
    "training.fsdp_spec": (dict(shape=(8, 4), mesh=Lazy(training.default_mesh)), [
        ("shape", "8x4", T), ("shape", (8, -1), V), ("mesh", "cpu", T),
        ("min_size", -1, V), ("min_size", 1.5, T)]),
}

# (name, argument) -> why the table has no row for it.
NO_ROW = {
    ("diffusion.cosine_schedule", "t"): "any array of times (a traced value: not checked)",
    ("diffusion.linear_schedule", "t"): "any array of times (a traced value: not checked)",
    ("diffusion.ddim_sample", "params"): "passed to `apply_fn` unchanged",
    ("generate", "params"): "any tree; one that does not fit the model fails in Haiku, "
                            "naming the missing parameter",
    ("load_checkpoint", "step"): "checked once `directory` holds a saved run "
                                          "(tests/training/test_load_checkpoint.py)",
    ("load_checkpoint", "optimizer"): "likewise",
    ("load_checkpoint", "mesh"): "likewise",
    ("load_checkpoint", "parameter_sharding"): "likewise",
    **{("choose_attention_implementation", arg): "`dot_product_attention` checks it "
       "before it asks this rule" for arg in (
           "key", "value", "bias", "mask", "local_window_size", "query_seq_lengths",
           "key_value_seq_lengths")},
}


# Entries whose good arguments are not called by `test_the_good_arguments_work`,
# and why (each row's message still names its argument, which a failure for
# another reason would not).
NO_CONTROL = {
    "generate": "compiles the decoding loop",
    "fit": "trains",
    "fit_model": "trains",
    "load_checkpoint": "needs a saved run",
}


def _public(name: str):
  obj = pk
  for part in name.split("."):
    obj = getattr(obj, part)
  return obj


def _public_names():
  names = [n for n in pk.__all__ if not isinstance(getattr(pk, n), types.ModuleType)]
  names += [f"diffusion.{n}" for n in dir(diffusion)
            if not n.startswith("_") and inspect.isfunction(getattr(diffusion, n))
            and getattr(diffusion, n).__module__ == diffusion.__name__]
  names += [f"training.{n}" for n in training.__all__ if n not in pk.__all__]
  return names


def _is_record_or_error(obj) -> bool:
  """Records (dataclasses, named tuples) and exceptions: what the library
  returns or raises, built from values it has checked."""
  return isinstance(obj, type) and (dataclasses.is_dataclass(obj)
                                    or issubclass(obj, BaseException)
                                    or (issubclass(obj, tuple) and hasattr(obj, "_fields")))


def _call(name: str, kwargs: dict[str, Any]):
  target = _public(name)
  resolve = lambda: {k: v.make() if isinstance(v, Lazy) else v for k, v in kwargs.items()}
  if isinstance(target, type) and issubclass(target, hk.Module):
    hk.transform(lambda: target(**resolve())).init(None)  # builds it, calls nothing
  else:
    target(**resolve())


def _label(value) -> str:
  if isinstance(value, (jax.Array, np.ndarray)):
    return f"{value.dtype}{list(value.shape)}"
  return f"{value!r:.20}"


ROWS = [pytest.param(name, arg, value, error, id=f"{name}-{arg}={_label(value)}")
        for name, (_, rows) in TABLE.items() for arg, value, error in rows]


@pytest.mark.parametrize("name, arg, value, error", ROWS)
def test_a_wrong_value_raises_naming_the_argument(name, arg, value, error):
  good, _ = TABLE[name]
  with pytest.raises(error, match=rf"`{re.escape(arg)}\b"):
    _call(name, {**good, arg: value})


@pytest.mark.parametrize("name", [n for n in TABLE if n not in NO_CONTROL])
def test_the_good_arguments_work(name):
  jax.eval_shape(lambda: _call(name, TABLE[name][0]))  # traced: nothing compiles


def test_every_argument_has_a_row():
  missing = []
  for name in _public_names():
    obj = _public(name)
    if not callable(obj) or _is_record_or_error(obj):
      continue
    arguments = [p.name for p in inspect.signature(obj).parameters.values()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    covered = {arg for arg, _, _ in TABLE.get(name, ({}, []))[1]}
    missing += [f"{name}({arg})" for arg in arguments
                if arg not in covered and (name, arg) not in NO_ROW]
  assert not missing, f"no row in TABLE (nor a reason in NO_ROW) for {missing}"
