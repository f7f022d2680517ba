"""Block sizes, warps and stages of the flex-attention kernels, per GPU.

One table, keyed by (padded head size, dtype, GPU generation), filled from
`experiments/tune_flex_attention.py` runs; a key the table lacks falls back to
the nearest smaller head size of the same generation, then to `_DEFAULT`.
In interpret mode (CPU) small blocks keep the Python loops short.
"""

import dataclasses

import jax
import jax.numpy as jnp

from ops.flex_attention import mosaic
from ops.flex_attention import mosaic_backward


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Tiling of one kernel launch."""
  block_q: int  # query rows per tile (power of two, >= 16)
  block_k: int  # key/value rows per tile (power of two, >= 16)
  num_warps: int  # Triton warps per program
  num_stages: int  # Triton software-pipelining depth of the inner loop

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(f"`{name}` must be a power of two >= 16, got {value}")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"`num_warps` must be 1, 2, 4, 8 or 16, got {self.num_warps}")
    if self.num_stages < 1:
      raise ValueError(f"`num_stages` must be >= 1, got {self.num_stages}")


FWD_SOFTMAX = ("online", "first_tile_max")
# Where rows past the first-tile maxima's limit are recomputed (`pallas.py`).
REFRESH = ("launch", "in_kernel", "auto")
# refresh='auto' takes 'in_kernel' for calls of at most this many scores
# (B x N x T x S), 'launch' for larger ones: the rerun inside the kernel saves
# a launch (fixed) but slows the walk (in proportion to the work). Thirtieth
# session, H32 full attention on an H200, forward microseconds launch /
# in_kernel, ten calls chained per executable (docs/benchmarks/
# kernel_attention_chain_short_h200.json, then kernel_attention_chain_final_h200.json):
# 4.2 M scores (B 8, T 256) 15.1 / 7.9 and 18.2 / 15.5; 16.8 M (B 8, T 512)
# 16.9 / 13.0 and 25.4 / 20.6; 33.6 M (B 4, T 1024) 20.0 / 20.5 and 19.9 /
# 24.0, (B 16, T 512) 23.5 / 23.0; 67 M (B 8, T 1024) 37.8 / 38.7, (B 2,
# T 2048) 35.4 / 37.9 (kernel_attention_chain_h200.json); 1.07 G (B 8, T 4096)
# 0.49 / 0.55 ms (kernel_attention_refresh_h200.json). Calls this short move by
# up to half between processes; the order within each process is what counts.
IN_KERNEL_REFRESH_MAX_SCORES = 2**24


@dataclasses.dataclass(frozen=True)
class FlexConfig:
  """The three launches of one attention call: forward, dK/dV and dQ.

  `mosaic_fwd`, where set, runs the forward on the Mosaic GPU kernel
  (`mosaic.py`) instead of `fwd`'s Triton one, for the calls it takes
  (`pallas.prepare` decides: 16-bit, no segments or mods, long enough);
  `mosaic_fwd_bounded`, where set, takes its place for the calls whose keys
  are bounded on the right (causal, or a window with a right side), whose
  items have unequal work and may want other tiles.
  `mosaic_bwd` likewise runs the backward on the one-launch Mosaic GPU kernel
  (`mosaic_backward.py`) instead of the `dkdv` and `dq` Triton launches.
  `fwd_softmax` is how the forward (either kernel) keeps its exponentials
  in range: 'online' (the running row maxima, rescaling as they grow) or
  'first_tile_max' (the maxima of the first fully open key tile, kept for
  the other open tiles: no maxima and no rescaling there; `pallas.py`;
  float16 calls and calls with a `score_mod` keep 'online').
  `refresh` is where 'first_tile_max' recomputes the query tiles whose rows
  passed the kept maxima by far: 'launch' (a second launch whose programs
  read the lse of eight query tiles each and rerun the flagged ones) or
  'in_kernel' (the Triton forward reruns the tile online at its end, no
  second launch; the Mosaic forward always launches) or 'auto' ('in_kernel'
  for calls of at most `IN_KERNEL_REFRESH_MAX_SCORES` scores, where the
  second launch is a large share of the call; `pallas.prepare` decides).
  `mosaic_fwd_min_scores` and `tensor_core_sums_min_scores` leave the calls
  of fewer scores (B x N x T x S) to the Triton forward (calls without a
  right bound only: short causal calls measured faster on the Mosaic
  forward), and to the Mosaic forward
  without its row sums on the tensor cores, where short calls measured faster
  that way. `mosaic_fwd_short_bounded`, where set, takes the place of
  `mosaic_fwd_bounded` for the right-bounded calls of fewer than
  `mosaic_fwd_bounded_min_scores` scores (short causal calls have few items
  per SM and measured faster on other tiles). 0: no limit; `forward_on`
  clears the limits and the other tile sets, so that a tile set given there
  is the one that runs.
  """
  fwd: KernelConfig
  dkdv: KernelConfig
  dq: KernelConfig
  mosaic_fwd: mosaic.MosaicForwardConfig | None = None
  mosaic_bwd: mosaic_backward.MosaicBackwardConfig | None = None
  fwd_softmax: str = "online"
  refresh: str = "launch"
  mosaic_fwd_bounded: mosaic.MosaicForwardConfig | None = None
  mosaic_fwd_min_scores: int = 0
  tensor_core_sums_min_scores: int = 0
  mosaic_fwd_short_bounded: mosaic.MosaicForwardConfig | None = None
  mosaic_fwd_bounded_min_scores: int = 0

  def __post_init__(self):
    for name in ("mosaic_fwd_min_scores", "tensor_core_sums_min_scores",
                 "mosaic_fwd_bounded_min_scores"):
      if getattr(self, name) < 0:
        raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}")
    if self.fwd_softmax not in FWD_SOFTMAX:
      raise ValueError(f"`fwd_softmax` must be one of {FWD_SOFTMAX}, got {self.fwd_softmax!r}")
    if self.refresh not in REFRESH:
      raise ValueError(f"`refresh` must be one of {REFRESH}, got {self.refresh!r}")

  def forward_on(self, mosaic_fwd) -> "FlexConfig":
    """This config with every call's forward on the Mosaic tiles `mosaic_fwd`
    (None: on the Triton kernel), right-bounded and short calls included."""
    return dataclasses.replace(self, mosaic_fwd=mosaic_fwd, mosaic_fwd_bounded=None,
                               mosaic_fwd_min_scores=0, tensor_core_sums_min_scores=0,
                               mosaic_fwd_short_bounded=None,
                               mosaic_fwd_bounded_min_scores=0)

  @property
  def keeps_first_tile_max(self) -> bool:
    """Whether the forward keeps its first open tile's row maxima."""
    return self.fwd_softmax == "first_tile_max"


def _mosaic_tiles(cls, fields):
  """A Mosaic config from a tuple or a dict of its fields, or None."""
  if fields is None:
    return None
  return cls(**fields) if isinstance(fields, dict) else cls(*fields)


def _c(fwd, dkdv, dq, mosaic_fwd=None, mosaic_bwd=None, fwd_softmax="online",
       refresh="launch", mosaic_fwd_bounded=None, mosaic_fwd_short_bounded=None,
       **limits) -> FlexConfig:
  forward_tiles = lambda fields: _mosaic_tiles(mosaic.MosaicForwardConfig, fields)
  return FlexConfig(
      KernelConfig(*fwd), KernelConfig(*dkdv), KernelConfig(*dq),
      forward_tiles(mosaic_fwd),
      _mosaic_tiles(mosaic_backward.MosaicBackwardConfig, mosaic_bwd),
      fwd_softmax, refresh, forward_tiles(mosaic_fwd_bounded),
      mosaic_fwd_short_bounded=forward_tiles(mosaic_fwd_short_bounded), **limits)


# (block_q, block_k, num_warps, num_stages) for fwd, dkdv, dq.
# Keys: (padded head size, dtype name, generation). 'sm90' = Hopper (H100/H200).
# H32 and H64: winners of `experiments/tune_flex_attention.py --small` on an
# H200 (docs/benchmarks/kernel_attention_tune_h200.json), causal and not; the
# dK/dV block_k is the program's key tile and block_q its loop tile.
# H128: the backward's winners of `tune_flex_attention --head_sizes 128
# --kernels dkdv,dq --small` (docs/benchmarks/kernel_attention_tune_h128_h200.json,
# causal and not: dK/dV 4.87 -> 4.15 ms, dQ 3.55 -> 2.98 ms at B 2, N 16,
# T 8192); its Triton forward is not swept. H256's backward: the same sweep
# (`--head_sizes 256 --causal 0`, kernel_attention_tune_h256_h200.json, B 2,
# N 16, T 4096): dK/dV 11.63 -> 4.58 ms, dQ 2.17 -> 1.60 ms against the 32- and
# 64-row, 4-warp, 1-stage tiles it had; its Triton forward is not swept.
# The fourth entry, (block_q, block_k, max_concurrent_steps[, causal_only[, ping_pong]])
# or a dict of `MosaicForwardConfig`'s fields, puts the forward
# on the Mosaic GPU kernel (`mosaic.py`) for the 16-bit calls it takes: the
# fastest tiles of `benchmark_kernel_attention --impls flex_mosaic_*` on an H200
# (docs/benchmarks/kernel_attention_mosaic_h200.json; 64 x 128 x 3 and 64 x 64
# x 2 were slower at both sizes; at H256 only 64 x 64 x 2 fits, 0.59-0.60x the
# Triton forward's time in kernel_attention_h256_h200.json). At H32 its
# 64-row tiles measured 1.04-1.16x the Triton forward's time, its 128 x 128 x 2
# tiles 0.89-0.90x causal and 1.02x on full attention in two runs
# (kernel_attention_bq128_h200.json, kernel_attention_h32_mosaic_h200.json), so
# the H32 entry's right-bounded calls take 128 x 128 x 2 (`mosaic_fwd_bounded`)
# without the ping-pong turns between the two compute warpgroups: on the causal
# H32 forward that was 3-5 % faster than with them in three runs
# (kernel_attention_h32_bf16exp_h200.json, kernel_attention_fma_h200.json,
# kernel_attention_before_fma_h200.json: 0.285 / 0.289 / 0.298 ms against
# 0.298 / 0.304 / 0.308). Its full-attention calls take 64 x 256 x 2,
# free-running, persistent, with the row sums on the tensor cores: 0.448 / 0.442
# ms against the Triton forward's 0.492 / 0.490, cuDNN 0.618 / 0.601, in two
# runs (kernel_attention_h32_sums_h200.json, kernel_attention_h32_sums64_h200.json;
# causal calls were slower on those tiles, 0.348 against 0.264). Shorter
# full-attention calls measured otherwise (thirty-fifth session, B 8, N 8
# unless named, microseconds; docs/benchmarks/kernel_attention_h32_sums_reach*_h200.json,
# kernel_attention_h32_short_calls_h200.json): without the sums the walk read
# 35.8-36.2 against 39.2-40.1 at T 1024 (2^26 scores) in four runs, 35.6-35.9
# against 38.4-38.6 at B 2, T 2048, and was even at 2^28 (B 8, T 2048 and
# B 32, T 1024), so the sums start at 2^29 scores (`tensor_core_sums_min_scores`);
# below 2^26 the Triton forward (which at 2^24 scores and below reruns its
# frozen rows inside the kernel, `refresh='auto'`) was the faster one: 7.8 /
# 12.4 / 23.6 / 20.3 against the sum-less walk's 11.4 / 14.8 / 25.5 / 21.5 at
# T 256, T 512, B 16 T 512, B 4 T 1024 (`mosaic_fwd_min_scores`). Short causal
# calls keep `mosaic_fwd_bounded`: timed against the Triton forward in one run
# (thirty-sixth session, kernel_attention_h32_short_causal_h200.json), 10.6 /
# 12.2 / 21.6 / 19.8 against 10.3 / 13.8 / 23.8 / 21.1 at the same four shapes.
# H64 and H128 walk their items with one block per SM (`persistent`, given as
# a dict) where the call has no right bound (`pallas.prepare` drops it for
# causal ones): full attention 0.6338 against 0.6444 ms at H64 and 1.842
# against 1.969 at H128 in one run (kernel_attention_persist2_h200.json);
# causal calls were 1.3-1.4 x slower that way (items of unequal work, walked
# in a fixed order), so they keep one block per item (short H64 causal calls
# aside, below).
# The H64 entry's right-bounded calls take the same tiles with the partly
# masked tiles on the kept maxima (`frozen_masked_tiles`): causal, B 4, N 16,
# T 4096, 0.3327 / 0.3350 ms against 0.3419 / 0.3426 without, in two runs
# (docs/benchmarks/kernel_attention_frozen_masked_h200.json, _rep_h200.json;
# at H32 on 128 x 128 it was 1.7-2.5 % slower at T 4096 and slower on every
# short causal call, at H128 even), from 2^30 scores, the size measured
# (`mosaic_fwd_bounded_min_scores`). Shorter H64 causal calls walk persistently,
# heaviest items first, on 64 x 128 x 2 tiles with the next query tile
# prefetched and the masked tiles on the kept maxima (`mosaic_fwd_short_bounded`;
# thirty-seventh session, docs/benchmarks/kernel_attention_h64_short_causal*_h200.json,
# B 4, N 16, us): T 1024 30.45 / 30.85 / 30.52 against the 256-key walk's
# 44.7-45.6 and cuDNN's 36.3-36.6, T 512 12.9-18.5 against 19.8-20.9 and
# 17.0-17.1, in two runs; at T 4096 they read 348.6 against 340.5 (cuDNN 375.3).
# The fifth entry, (block_q, block_k, max_concurrent_steps[, dq_column_chunks[,
# compute_registers]]),
# puts the backward on the one-launch Mosaic GPU kernel (`mosaic_backward.py`)
# for the 16-bit calls it takes: the fastest of four tile sets in one H200 run
# (docs/benchmarks/kernel_attention_mosaic_bwd_h200.json, fwd+bwd): H64
# 128 x 64 x 2 (2.19 / 1.23 ms non-causal / causal against the Triton
# backward's 2.70 / 1.53), H128 64 x 64 x 2 (8.26 / 4.43 against 8.85 / 4.83;
# larger tiles do not fit in shared memory there), and at H128 the dQ product
# in two column slices, 7.41 / 4.04 against 8.39 / 4.38 in a later run
# (kernel_attention_h128_dq_chunks_h200.json). The H32 entry, 128 x 64 x 3, won a
# sweep of six tile sets (kernel_attention_h32_mosaic_bwd_h200.json: 1.69 / 0.93
# ms against the Triton backward's 1.80 / 1.09). 240 registers per compute
# warpgroup (24 for the memory one) took H128 from 7.46 / 4.08 to 7.24 / 3.86 ms
# and did not help H32 or H64 (-0.6 to +2.5 % on the table's tiles;
# kernel_attention_h128_regs240_h200.json, kernel_attention_regs240_h200.json),
# so only H128 takes it.
# The H32 entry's backward (given as a dict) takes two dS^T slots and the
# pipelined step (`MosaicBackwardConfig.ds_slots`, `.pipelined`): fwd+bwd 1.548
# / 0.889 ms (full / causal) against 1.649 / 0.908 on the same tiles without
# them, and 0.1232 against 0.1304 at T 1024, in two H200 runs
# (docs/benchmarks/kernel_attention_bwd_pipe_h200.json,
# kernel_attention_bwd_tiles_h200.json; 128 x 64 x 2 and 64 x 128 x 2-4 with
# them were no faster). At H64 the pipelined step was slower on the table's
# tiles (2.42 against 2.07 ms) and two slots do not fit them; H128 has no
# registers for it.
# fwd_softmax="first_tile_max" (H32, H64, H128; `pallas.py`, "The first-tile
# maxima"): forward ms in one H200 run against the same table with the online
# softmax (docs/benchmarks/kernel_attention_first_tile_max_h200.json; full /
# causal): H64 0.538 / 0.348 against 0.627 / 0.356, H128 1.779 / 0.930
# against 1.842 / 0.973, H32 0.488 / 0.269 against 0.523 / 0.289 (the online
# run on the same 128 x 64 Triton tiles). With it the H32 Triton forward takes
# 128 x 64 tiles: at 128 x 128 it measured 0.575 ms against 0.505 for those
# tiles online, the table's before (kernel_attention_first_tile_max_h32_h200.json).
# H256 (its Mosaic forward, 64 x 64 x 2 with the turns) took it in the
# twenty-eighth session: 0.900 / 0.501 ms against 0.959 / 0.526 online, cuDNN
# 0.880 / 0.528, in one run (docs/benchmarks/kernel_attention_h256_first_tile_max_h200.json,
# B 2, N 16, T 4096, full / causal).
_TABLE: dict[tuple[int, str, str], FlexConfig] = {
    (32, "bfloat16", "sm90"): _c((128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3),
                                 dict(block_q=64, block_k=256, max_concurrent_steps=2,
                                      ping_pong=False, persistent=True,
                                      tensor_core_sums=True),
                                 dict(block_q=128, block_k=64, max_concurrent_steps=3,
                                      ds_slots=2, pipelined=True),
                                 fwd_softmax="first_tile_max", refresh="auto",
                                 mosaic_fwd_bounded=dict(block_q=128, block_k=128,
                                                         max_concurrent_steps=2,
                                                         ping_pong=False),
                                 mosaic_fwd_min_scores=2**26,
                                 tensor_core_sums_min_scores=2**29),
    (64, "bfloat16", "sm90"): _c((64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3),
                                 dict(block_q=64, block_k=256, max_concurrent_steps=2,
                                      persistent=True), (128, 64, 2),
                                 fwd_softmax="first_tile_max",
                                 mosaic_fwd_bounded=dict(block_q=64, block_k=256,
                                                         max_concurrent_steps=2,
                                                         frozen_masked_tiles=True),
                                 mosaic_fwd_short_bounded=dict(
                                     block_q=64, block_k=128, max_concurrent_steps=2,
                                     persistent=True, persistent_right_bounded=True,
                                     frozen_masked_tiles=True, prefetch_query=True),
                                 mosaic_fwd_bounded_min_scores=2**30),
    (128, "bfloat16", "sm90"): _c((64, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3),
                                  dict(block_q=64, block_k=128, max_concurrent_steps=2,
                                       persistent=True), (64, 64, 2, 2, 240),
                                  fwd_softmax="first_tile_max"),
    (256, "bfloat16", "sm90"): _c((64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 3),
                                  (64, 64, 2), fwd_softmax="first_tile_max"),
    # Halving the key tiles of the 16-bit entry asks 311,296 bytes of shared
    # memory from the float32 dQ kernel on an H200; these (the 16-bit
    # entry's halves before that entry was swept) fit.
    (256, "float32", "sm90"): _c((64, 16, 4, 2), (32, 32, 4, 1), (64, 16, 4, 1)),
}

# For any GPU and head size the table does not cover.
_DEFAULT = _c((64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2))
_DEFAULT_LARGE_HEAD = _c((64, 32, 4, 2), (32, 32, 4, 1), (32, 32, 4, 1))  # H > 128
_INTERPRET = _c((32, 32, 4, 1), (32, 32, 4, 1), (32, 32, 4, 1))


def gpu_generation() -> str:
  """'sm90' style name of the default device, or 'cpu'."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return "cpu"
  capability = getattr(device, "compute_capability", None)
  if capability is None:
    return "gpu"
  return "sm" + str(capability).replace(".", "")


def get_config(head_dim_padded: int, dtype, *, interpret: bool,
               generation: str | None = None) -> FlexConfig:
  """The tiling for this head size (padded to a power of two) and dtype."""
  if interpret:
    return _INTERPRET
  generation = gpu_generation() if generation is None else generation
  name = jnp.dtype(dtype).name
  name = "bfloat16" if name == "float16" else name  # Same tiles for 16-bit floats.
  if (head_dim_padded, name, generation) in _TABLE:
    return _TABLE[(head_dim_padded, name, generation)]
  if name == "float32" and (head_dim_padded, "bfloat16", generation) in _TABLE:
    # Four-byte elements: halve the key tile to keep shared memory in budget.
    c = _TABLE[(head_dim_padded, "bfloat16", generation)]
    half = lambda k: dataclasses.replace(k, block_k=max(16, k.block_k // 2),
                                         num_stages=min(k.num_stages, 2))
    return FlexConfig(half(c.fwd), half(c.dkdv), half(c.dq))
  return _DEFAULT_LARGE_HEAD if head_dim_padded > 128 else _DEFAULT
