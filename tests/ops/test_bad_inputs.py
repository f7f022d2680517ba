"""Bad input to the public ops raises a clear error before any work: the
message names the argument (and the limit), for both implementations.

The checks are static (shapes, dtypes, Python options), so these run no
kernel: each call raises in the op's api.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops

IMPLEMENTATIONS = ("xla", "pallas")


def _z(*shape, dtype=jnp.float32):
  return jnp.zeros(shape, dtype)


def _ssd_args(**change):
  args = dict(q=_z(1, 8, 2, 16), k=_z(1, 8, 2, 16), v=_z(1, 8, 2, 16),
              g=_z(1, 8, 2))
  args.update(change)
  return args


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", ["ssd", "gated_delta_rule"])
@pytest.mark.parametrize("change, kwargs, error, match", [
    # T = 0 divided by zero inside the chunking.
    (dict(q=_z(1, 0, 2, 16), k=_z(1, 0, 2, 16), v=_z(1, 0, 2, 16), g=_z(1, 0, 2)),
     {}, ValueError, r"`v` needs T >= 1"),
    # G = 0 query groups: `heads % groups` divided by zero.
    (dict(q=_z(1, 8, 0, 16), k=_z(1, 8, 0, 16)), {}, ValueError, r"groups of `q` \(0\)"),
    # An integer state was silently cast.
    ({}, dict(initial_state=_z(1, 2, 16, 16, dtype=jnp.int32)), ValueError,
     "`initial_state` must be floating point"),
    # A bool chunk size passed as the int 1 (or, on the kernel, a power-of-two error).
    ({}, dict(chunk_size=True), ValueError, "`chunk_size` must be a positive int"),
    # A list: AttributeError ('list' object has no attribute 'ndim').
    (dict(v=[[1.0]]), {}, TypeError, "`v` must be an array"),
])
def test_chunked_ops(op, implementation, change, kwargs, error, match):
  a = _ssd_args(**change)
  with pytest.raises(error, match=match):
    if op == "ssd":
      ops.ssd(a["q"], a["k"], a["v"], a["g"], implementation=implementation, **kwargs)
    else:
      ops.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["g"],
                           implementation=implementation, **kwargs)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gated_delta_rule_scale_must_be_a_number(implementation):
  a = _ssd_args()
  with pytest.raises(TypeError, match="`scale` must be a number"):
    ops.gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["g"], scale="x",
                         implementation=implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("args, kwargs, error, match", [
    ((_z(2, 0, 4), _z(2, 0, 4)), {}, ValueError, r"`b` needs T >= 1"),
    ((_z(2, 8, 4), _z(2, 8, 4)), dict(initial_state=_z(2, 4, dtype=jnp.int32)),
     ValueError, "`initial_state` must be a float"),
    # A string counted as True.
    ((_z(2, 8, 4), _z(2, 8, 4)), dict(reverse="no"), TypeError, "`reverse` must be a bool"),
    (([1.0], _z(2, 8, 4)), {}, TypeError, "`a` must be an array"),
])
def test_linear_scan(implementation, args, kwargs, error, match):
  with pytest.raises(error, match=match):
    ops.linear_scan(*args, implementation=implementation, **kwargs)


def _scan_args(**change):
  args = dict(u=_z(2, 8, 4), delta=_z(2, 8, 4), A=_z(4, 3), B=_z(2, 8, 3),
              C=_z(2, 8, 3))
  args.update(change)
  return args


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("change, kwargs, error, match", [
    (dict(u=_z(2, 0, 4), delta=_z(2, 0, 4), B=_z(2, 0, 3), C=_z(2, 0, 3)), {},
     ValueError, r"`u` needs T >= 1"),
    # G = 0 groups: ZeroDivisionError.
    (dict(B=_z(2, 8, 0, 3), C=_z(2, 8, 0, 3)), {}, ValueError, "`B`: the group count G = 0"),
    # Integer inputs ran silently on XLA (an int32 `y` for an int `u`).
    (dict(u=_z(2, 8, 4, dtype=jnp.int32)), {}, ValueError, "`u` must be a float"),
    (dict(A=_z(4, 3, dtype=jnp.int32)), {}, ValueError, "`A` must be a float"),
    ({}, dict(D=_z(4, dtype=jnp.int32)), ValueError, "`D` must be a float"),
    ({}, dict(z=_z(2, 8, 4, dtype=jnp.int32)), ValueError, "`z` must be a float"),
    ({}, dict(initial_state=_z(2, 4, 3, dtype=jnp.int32)), ValueError,
     "`initial_state` must be a float"),
    # 'no' counted as True: softplus applied.
    ({}, dict(delta_softplus="no"), TypeError, "`delta_softplus` must be a bool"),
    ({}, dict(reverse=None), TypeError, "`reverse` must be a bool"),
    ({}, dict(D=[1.0, 2.0, 3.0, 4.0]), TypeError, "`D` must be an array"),
])
def test_selective_scan(implementation, change, kwargs, error, match):
  a = _scan_args(**change)
  with pytest.raises(error, match=match):
    ops.selective_scan(a["u"], a["delta"], a["A"], a["B"], a["C"],
                       implementation=implementation, **kwargs)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_grouped_ops_take_arrays(implementation):
  with pytest.raises(TypeError, match="`group_sizes` must be an array"):
    ops.grouped_matmul(_z(8, 4), _z(2, 4, 3), [4, 4], implementation=implementation)
  with pytest.raises(TypeError, match="`lhs` must be an array"):
    ops.grouped_matmul([[1.0]], _z(2, 4, 3), jnp.array([0, 0]),
                       implementation=implementation)
  with pytest.raises(TypeError, match="`group_sizes` must be an array"):
    ops.grouped_mlp(_z(8, 4), _z(2, 4, 6), _z(2, 6, 4), [4, 4],
                    implementation=implementation)


def test_grouped_kernels_refuse_empty_inputs_that_xla_takes():
  # The kernels divided by zero; XLA (and so implementation=None) takes them.
  sizes = jnp.zeros((0,), jnp.int32)
  with pytest.raises(ValueError, match="`rhs` needs G >= 1 groups"):
    ops.grouped_matmul(_z(8, 4), _z(0, 4, 3), sizes, implementation="pallas")
  with pytest.raises(ValueError, match="`lhs` needs M >= 1 rows"):
    ops.grouped_matmul(_z(0, 4), _z(2, 4, 3), jnp.array([0, 0]), implementation="pallas")
  with pytest.raises(ValueError, match="`w_in` needs G >= 1 groups"):
    ops.grouped_mlp(_z(8, 4), _z(0, 4, 6), _z(0, 6, 4), sizes, implementation="pallas")
  np.testing.assert_array_equal(
      ops.grouped_matmul(_z(8, 4), _z(0, 4, 3), sizes, implementation="xla"),
      np.zeros((8, 3)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_flex_attention_window_is_not_a_bool(implementation):
  q = _z(1, 4, 2, 8)
  with pytest.raises(ValueError, match="`local_window_size`"):
    ops.flex_attention(q, q, q, local_window_size=True, implementation=implementation)


def test_checks_are_static_under_jit_and_vmap():
  u = _z(2, 8, 4)
  f = jax.jit(lambda u: ops.selective_scan(u, u, _z(4, 3), _z(2, 8, 3), _z(2, 8, 3),
                                           delta_softplus="yes")[0])
  with pytest.raises(TypeError, match="`delta_softplus`"):
    f(u)
  g = jax.vmap(lambda b: ops.linear_scan(b, b, reverse=1)[0])
  with pytest.raises(TypeError, match="`reverse`"):
    g(_z(3, 2, 8, 4))
