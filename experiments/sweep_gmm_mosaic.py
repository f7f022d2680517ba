"""Tiles of the Mosaic GPU grouped matmuls against the Triton kernels, JAX's Mosaic
dense matmul and cuBLAS, by device time from traces (GPU only).

    python -m experiments.sweep_gmm_mosaic --output docs/benchmarks/gmm_mosaic_sweep.json
    python -m experiments.sweep_gmm_mosaic --kernel tgmm --output ...

For each shape (M, K, N) with 8 groups of about M / 8 rows: one dense
`jnp.matmul` of the same work (cuBLAS), JAX's warp-specialized Mosaic GPU dense
matmul (`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`), the Triton `gmm`
(`ops/grouped_matmul/pallas.py`) and, for every config in `CONFIGS`, the Mosaic
`gmm` (`ops/grouped_matmul/mosaic.py`), each forward and with the transposed rhs
(the input gradient). `err` is the max error against `jax.lax.ragged_dot` in
float32, relative to the largest output. One row per (shape, kernel).

With `--kernel tgmm` the same for the weight gradient: per group
`lhs[rows]^T @ dout[rows]` into float32 (the MoE layer's master weights), the
Triton `tgmm` and, for every config in `TGMM_CONFIGS`, the Mosaic kernel
(`ops/grouped_matmul/mosaic_tgmm.py`), beside one dense `lhs^T @ dout` of the
same work.
"""

import dataclasses
import functools

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments import harness
from experiments import tracing
from ops.grouped_matmul import mosaic
from ops.grouped_matmul import mosaic_tgmm
from ops.grouped_matmul import pallas as gmm_pallas

_OUTPUT = flags.DEFINE_string("output", "docs/benchmarks/gmm_mosaic_sweep.json", "JSON output.")
_SHAPES = flags.DEFINE_list("shapes", ["16384x512x1024", "16384x1024x512", "131072x512x1024"],
                            "MxKxN of each case.")
_CONFIGS = flags.DEFINE_list("configs", None, "Indices into CONFIGS (default: all). "
                             "A kernel that faults poisons the process's CUDA "
                             "context, so a new config is best run in a new process.")
_KERNEL = flags.DEFINE_enum("kernel", "gmm", ["gmm", "tgmm"], "Which grouped matmul: "
                            "the forward / input gradient, or the weight gradient.")
_PEERS = flags.DEFINE_bool("peers", True, "Also time cuBLAS, JAX's Mosaic dense "
                           "matmul and the Triton kernels.")

C = mosaic.MosaicConfig
CONFIGS = (
    # The seventh session's default: 3 stages do not divide 8 or 16 K steps,
    # so its tiles' pipelines do not chain.
    C(block_m=128, block_n=256, split="n", max_concurrent_steps=3, store_slots=1),
    # Chained pipelines (the next tile's loads during this tile's epilogue).
    C(block_m=128, block_n=256, split="n", max_concurrent_steps=2, store_slots=2),
    C(block_m=128, block_n=256, split="n", max_concurrent_steps=2, store_slots=2,
      chain_tiles=False),
    C(block_m=128, block_n=128, split="m", max_concurrent_steps=4, store_slots=2),
    C(block_m=128, block_n=256, block_k=32, split="n", max_concurrent_steps=4,
      store_slots=2),
    C(block_m=256, block_n=128, block_k=32, split="m", max_concurrent_steps=4,
      store_slots=2),
    # The fastest at 16,384 rows in the seventh session (unchained: a wgmma in flight).
    C(block_m=128, block_n=128, split="m", max_concurrent_steps=4, store_slots=2,
      wgmma_in_flight=1),
    # 64-row tiles: at M 16384 and N 512 the 128 x 128 tiles make 544 tiles on
    # 132 SMs (4.12 waves, the last mostly empty); these make 528 and 1056.
    C(block_m=64, block_n=256, split="n", max_concurrent_steps=4, store_slots=2),
    C(block_m=64, block_n=128, split="n", max_concurrent_steps=4, store_slots=2),
)
T = mosaic_tgmm.TgmmConfig
TGMM_CONFIGS = (
    T(),  # the default: 64 x 128 x 256, 4 stages
    T(block_m=128, max_concurrent_steps=2),
    T(block_m=64, block_k=128, block_n=128, max_concurrent_steps=4),
    T(block_m=64, block_k=256, block_n=128, max_concurrent_steps=4),
    T(block_m=128, block_k=128, block_n=128, max_concurrent_steps=3),
    T(block_m=64, max_concurrent_steps=3),
)
NUM_GROUPS = 8


def _name(config: mosaic.MosaicConfig) -> str:
  return ("{block_m}x{block_n}x{block_k}{split}_stages{max_concurrent_steps}_epi{epilogue_n}"
          "_slots{store_slots}_inflight{wgmma_in_flight}".format(**dataclasses.asdict(config))
          + ("" if config.columns_fastest else "_rows_fastest")
          + ("" if config.chain_tiles else "_unchained"))


def _tgmm_name(config: mosaic_tgmm.TgmmConfig) -> str:
  return "{block_m}x{block_k}x{block_n}_stages{max_concurrent_steps}".format(
      **dataclasses.asdict(config))


def _busy_us(fn, args) -> float:
  return tracing.profile(jax.jit(fn), args, calls=20)["busy_us"]


def _groups(m: int):
  """Sizes, starts and ends of NUM_GROUPS groups of about m / 8 rows."""
  key = jax.random.key(0)
  sizes = jax.random.randint(key, (NUM_GROUPS,), m // 8 - m // 32, m // 8 + m // 32)
  sizes = sizes.at[-1].set(m - sizes[:-1].sum()).astype(jnp.int32)
  ends = jnp.cumsum(sizes).astype(jnp.int32)
  return sizes, ends - sizes, ends


def _adder(rows: list, base: dict, want: jax.Array):
  """add(kernel, fn, args, check=None): times fn, appends and prints a row;
  `check()`'s result is compared with `want`."""
  scale = float(jnp.max(jnp.abs(want)))

  def add(kernel, fn, args, check=None):
    try:
      row = dict(base, kernel=kernel, status="ok", busy_us=_busy_us(fn, args))
      if check is not None:
        got = check()
        row["err"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))) / scale
    except Exception as e:  # a config that does not fit still gets its row
      row = dict(base, kernel=kernel, status="error", message=str(e)[:300])
    rows.append(row)
    print(row, flush=True)

  return add


def shape_rows(m: int, k: int, n: int) -> list[dict]:
  key = jax.random.key(0)
  lhs = jax.random.normal(key, (m, k), jnp.bfloat16)
  rhs = (jax.random.normal(key, (NUM_GROUPS, k, n), jnp.float32) / k ** 0.5).astype(
      jnp.bfloat16)
  rhs_t = jnp.swapaxes(rhs, 1, 2)
  sizes, starts, ends = _groups(m)
  want = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
  rows = []
  add = _adder(rows, dict(m=m, k=k, n=n), want)
  if _PEERS.value:
    add("cublas_dense_same_work", lambda a, b: a @ b, (lhs, rhs[0]))
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hopper
    config = hopper.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                                 epi_tile_n=64, epi_tile_m=64)
    add("jax_mosaic_dense_same_work", lambda a, b: hopper.matmul(a, b, None, config),
        (lhs, rhs[0]))
    add("triton_gmm", lambda a, b, s, e: gmm_pallas.gmm(a, b, s, e),
        (lhs, rhs, starts, ends))
    add("triton_gmm_transposed",
        lambda a, b, s, e: gmm_pallas.gmm(a, b, s, e, transpose_rhs=True),
        (lhs, rhs_t, starts, ends))
  chosen = ([CONFIGS[int(i)] for i in _CONFIGS.value] if _CONFIGS.value is not None
            else CONFIGS)
  for config in chosen:
    for transpose in (False, True):
      fn = functools.partial(lambda a, b, e, config, transpose: mosaic.gmm(
          a, b, e, transpose_rhs=transpose, config=config)[0],
                             config=config, transpose=transpose)
      operand = rhs_t if transpose else rhs
      add(f"mosaic_gmm{'_transposed' if transpose else ''}_{_name(config)}", fn,
          (lhs, operand, ends), check=lambda fn=fn, operand=operand: fn(lhs, operand, ends))
  return rows


def tgmm_shape_rows(m: int, k: int, n: int) -> list[dict]:
  """The weight gradient [G, K, N] (float32) of lhs [M, K] and dout [M, N]."""
  k1, k2 = jax.random.split(jax.random.key(0))
  lhs = jax.random.normal(k1, (m, k), jnp.bfloat16)
  dout = jax.random.normal(k2, (m, n), jnp.bfloat16)
  _, starts, ends = _groups(m)
  lf, df = lhs.astype(jnp.float32), dout.astype(jnp.float32)
  row = jnp.arange(m)[:, None]
  want = jnp.stack([lf.T @ (df * ((row >= s) & (row < e))) for s, e in zip(starts, ends)])
  rows = []
  add = _adder(rows, dict(m=m, k=k, n=n, kernel_kind="tgmm"), want)
  if _PEERS.value:
    add("cublas_dense_same_work",
        lambda a, b: jnp.dot(a.T, b, preferred_element_type=jnp.float32), (lhs, dout))
    triton = lambda a, b, s, e: gmm_pallas.tgmm(a, b, s, e, out_dtype=jnp.float32)
    add("triton_tgmm", triton, (lhs, dout, starts, ends),
        check=lambda: triton(lhs, dout, starts, ends))
  chosen = ([TGMM_CONFIGS[int(i)] for i in _CONFIGS.value] if _CONFIGS.value is not None
            else TGMM_CONFIGS)
  for config in chosen:
    fn = functools.partial(lambda a, b, s, e, config: mosaic_tgmm.tgmm(
        a, b, s, e, out_dtype=jnp.float32, config=config), config=config)
    add(f"mosaic_tgmm_{_tgmm_name(config)}", fn, (lhs, dout, starts, ends),
        check=lambda fn=fn: fn(lhs, dout, starts, ends))
  return rows


def main(argv):
  del argv
  rows = []
  build = tgmm_shape_rows if _KERNEL.value == "tgmm" else shape_rows
  for shape in _SHAPES.value:
    rows += build(*map(int, shape.split("x")))
    harness.write_rows(rows, _OUTPUT.value)


if __name__ == "__main__":
  app.run(main)
