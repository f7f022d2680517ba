"""The shape grid: the shapes each op is timed (benchmarks) and tuned at.

The kernels were tuned at a few headline shapes; users bring others. The grid
per op, named here once and read by `benchmark_kernel_attention`,
`benchmark_kernel_moe`, `benchmark_kernel_ssd`, `benchmark_kernel_ssm` and
`tune_flex_attention` (each with `--grid`):

- attention: head sizes {16, 32, 64, 80, 96, 128, 192, 256} x lengths
  {77, 512, 1000, 3000, 4096, 8192} x {full, causal, sliding window, GQA 8:1,
  cross-attention T << S}, bfloat16 (240 points), and float32 at 8 points;
- ssd and the gated delta rule: K = V in {32, 64, 96, 128, 256} x T in
  {100, 1000, 5000} (15 points);
- the MoE layer and its grouped matmul: (experts, top-k) in {(8, 2), (64, 8),
  (128, 8)} x d_model x d_hidden in {256, 512, 1024, 2048} (48 points);
- the selective scan: state sizes {16, 24, 64, 128} (4 points).

Sizes: every point holds about `TOKENS` = 16,384 tokens (B x T, a batch of 8
sequences of 2,048), so a short length is a large batch and each point is
a training step's worth of work rather than a launch overhead:

- attention: B = round(16384 / L) at length L (213 at 77, 2 at 8192), 16 query
  heads (`ATTENTION_HEADS`); 'gqa' is causal with 2 key/value heads (as in
  the decoders that use it); 'sliding_window' is causal with `SLIDING_WINDOW`
  = 256 keys to the left (a band from L 512 on); 'cross' has S = L keys and
  T = max(16, L // 16) queries, not causal;
- ssd, gated delta rule: B = round(16384 / T), 8 heads (`CHUNKED_HEADS`);
- MoE: 16,384 tokens, so the grouped matmul has M = 16384 x top-k rows
  (32,768 at top-2, 131,072 at top-8: 1,024 rows an expert at 128 experts);
- selective scan: B 4, T 4096, D 512 (`SCAN_SHAPE`).

Subsets (`--grid_subset`): 'full', every point; 'quick', a named
representative subset that fits in about 5 minutes of one H200 per op with
the benchmarks' default implementations (every head size, length and
attention variant at least once; every (experts, top-k) at two widths); 'smoke',
a few of the grid's points at CPU sizes (tests). `--grid_stride=n
--grid_offset=i` keep every n-th point of the subset from the i-th: offsets
0..n-1 split a long grid into runs of a few minutes each.
"""

import dataclasses
from typing import NamedTuple

from absl import flags

TOKENS = 16384  # B x T (MoE: tokens) at every point

ATTENTION_HEAD_SIZES = (16, 32, 64, 80, 96, 128, 192, 256)
ATTENTION_LENGTHS = (77, 512, 1000, 3000, 4096, 8192)
ATTENTION_VARIANTS = ("full", "causal", "sliding_window", "gqa", "cross")
ATTENTION_DTYPES = ("bfloat16", "float32")
ATTENTION_HEADS = 16   # query heads N
GQA_GROUP = 8          # query heads per key/value head under 'gqa'
SLIDING_WINDOW = 256   # keys to the left of the query under 'sliding_window'
CROSS_RATIO = 16       # S / T under 'cross' (T at least 16)
# The float32 points: head sizes x lengths x variants.
ATTENTION_F32 = ((32, 128), (1000, 4096), ("full", "causal"))

CHUNKED_KEY_SIZES = (32, 64, 96, 128, 256)  # K = V
CHUNKED_LENGTHS = (100, 1000, 5000)
CHUNKED_HEADS = 8

MOE_EXPERTS_TOP_K = ((8, 2), (64, 8), (128, 8))
MOE_WIDTHS = (256, 512, 1024, 2048)  # d_model and d_hidden

SCAN_STATE_SIZES = (16, 24, 64, 128)
SCAN_SHAPE = (4, 4096, 512)  # B, T, D of the selective scan

SUBSETS = ("full", "quick", "smoke")


def _batch(tokens: int, length: int) -> int:
  return max(1, round(tokens / length))


def _check_choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {tuple(choices)}, got {value!r}")


def _check_positive(**values) -> None:
  for name, value in values.items():
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"`{name}` must be a positive int, got {name}={value!r}")


@dataclasses.dataclass(frozen=True)
class AttentionPoint:
  """One attention grid point; q [B, T, N, H], k and v [B, S, K, H]."""
  head_dim: int          # H
  length: int            # L: the key length S (and the query length T but under 'cross')
  variant: str           # one of ATTENTION_VARIANTS
  dtype: str = "bfloat16"
  tokens: int = TOKENS   # B x L
  heads: int = ATTENTION_HEADS

  def __post_init__(self):
    _check_positive(head_dim=self.head_dim, length=self.length, tokens=self.tokens,
                    heads=self.heads)
    _check_choice("variant", self.variant, ATTENTION_VARIANTS)
    _check_choice("dtype", self.dtype, ATTENTION_DTYPES)
    if self.variant == "gqa" and self.heads % GQA_GROUP:
      raise ValueError(f"'gqa' needs `heads` a multiple of {GQA_GROUP}, got {self.heads=}")

  @property
  def batch(self) -> int:
    return _batch(self.tokens, self.length)

  @property
  def kv_heads(self) -> int:
    return self.heads // GQA_GROUP if self.variant == "gqa" else self.heads

  @property
  def q_len(self) -> int:
    if self.variant == "cross":
      return min(self.length, max(16, self.length // CROSS_RATIO))
    return self.length

  @property
  def kv_len(self) -> int:
    return self.length

  @property
  def is_causal(self) -> bool:
    return self.variant in ("causal", "sliding_window", "gqa")

  @property
  def window(self) -> tuple[int, int] | None:
    """`local_window_size` (left, right), or None."""
    return (SLIDING_WINDOW, 0) if self.variant == "sliding_window" else None

  @property
  def name(self) -> str:
    name = f"h{self.head_dim}_l{self.length}_{self.variant}"
    return name if self.dtype == "bfloat16" else f"{name}_{self.dtype}"

  @property
  def shape(self) -> dict:
    """The sizes as row fields."""
    return dict(B=self.batch, T=self.q_len, S=self.kv_len, N=self.heads, K=self.kv_heads,
                H=self.head_dim)

  def flops(self, mode: str) -> float:
    """Matmul FLOPs of the forward (mode 'fwd') or fwd+bwd (3.5 x: dQ, dK, dV
    and the recomputed logits), counting only the scores the mask keeps."""
    t, s = self.q_len, self.kv_len
    pairs = t * s
    if self.is_causal:  # query i sees keys i + s - t - left .. i + s - t
      left = s if self.window is None else self.window[0]
      pairs = sum(max(0, min(s, i + s - t + 1) - max(0, i + s - t - left)) for i in range(t))
    fwd = 4.0 * self.batch * self.heads * pairs * self.head_dim
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


@dataclasses.dataclass(frozen=True)
class ChunkedPoint:
  """One point of ssd / the gated delta rule: (B, T, N, K, V), K = V."""
  key_dim: int
  length: int
  tokens: int = TOKENS
  heads: int = CHUNKED_HEADS

  def __post_init__(self):
    _check_positive(key_dim=self.key_dim, length=self.length, tokens=self.tokens,
                    heads=self.heads)

  @property
  def shape(self) -> tuple[int, int, int, int, int]:
    return (_batch(self.tokens, self.length), self.length, self.heads, self.key_dim,
            self.key_dim)

  @property
  def name(self) -> str:
    return f"k{self.key_dim}_t{self.length}"


@dataclasses.dataclass(frozen=True)
class MoePoint:
  """One MoE point: `tokens` tokens routed to `top_k` of `experts` experts."""
  experts: int
  top_k: int
  d_model: int
  d_hidden: int
  tokens: int = TOKENS

  def __post_init__(self):
    _check_positive(experts=self.experts, top_k=self.top_k, d_model=self.d_model,
                    d_hidden=self.d_hidden, tokens=self.tokens)
    if self.top_k > self.experts:
      raise ValueError(f"`top_k` must be at most `experts`, got {self.top_k=} {self.experts=}")

  @property
  def rows(self) -> int:
    """M of the grouped matmul: one row per (token, chosen expert)."""
    return self.tokens * self.top_k

  @property
  def name(self) -> str:
    return f"e{self.experts}_k{self.top_k}_d{self.d_model}_f{self.d_hidden}"


@dataclasses.dataclass(frozen=True)
class ScanPoint:
  """One selective-scan point: (B, T, D, S)."""
  state: int
  batch: int = SCAN_SHAPE[0]
  length: int = SCAN_SHAPE[1]
  width: int = SCAN_SHAPE[2]

  def __post_init__(self):
    _check_positive(state=self.state, batch=self.batch, length=self.length,
                    width=self.width)

  @property
  def shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.length, self.width, self.state)

  @property
  def name(self) -> str:
    return f"s{self.state}"


# 'quick': every head size, length and variant at least once, and both sides of
# the dispatch's head-size limits (64 | 80, 128 | 192); one float32 point.
_ATTENTION_QUICK = (
    (16, 4096, "causal"), (32, 1000, "full"), (32, 8192, "sliding_window"),
    (64, 77, "full"), (64, 3000, "gqa"), (80, 4096, "causal"), (80, 8192, "cross"),
    (96, 1000, "cross"), (128, 512, "causal"), (128, 8192, "gqa"),
    (192, 3000, "sliding_window"), (256, 4096, "full"))
_ATTENTION_QUICK_F32 = ((128, 4096, "causal"),)
# 'quick' MoE widths (d_model, d_hidden): the headline layer's, and OLMoE's.
_MOE_QUICK_WIDTHS = ((512, 1024), (2048, 1024))


def attention_grid(subset: str = "full") -> tuple[AttentionPoint, ...]:
  """The attention points of `subset`: bf16 head size x length x variant, then f32."""
  _check_choice("subset", subset, SUBSETS)
  if subset == "smoke":
    small = dict(tokens=154, heads=8)  # B 2 at length 77
    return (AttentionPoint(80, 77, "gqa", **small), AttentionPoint(32, 77, "cross", **small),
            AttentionPoint(16, 77, "sliding_window", "float32", **small))
  if subset == "quick":
    return (tuple(AttentionPoint(*p) for p in _ATTENTION_QUICK)
            + tuple(AttentionPoint(*p, dtype="float32") for p in _ATTENTION_QUICK_F32))
  bf16 = [AttentionPoint(h, l, v) for h in ATTENTION_HEAD_SIZES for l in ATTENTION_LENGTHS
          for v in ATTENTION_VARIANTS]
  heads, lengths, variants = ATTENTION_F32
  f32 = [AttentionPoint(h, l, v, "float32") for h in heads for l in lengths for v in variants]
  return tuple(bf16 + f32)


def chunked_grid(subset: str = "full") -> tuple[ChunkedPoint, ...]:
  """The ssd / gated-delta-rule points of `subset` ('quick' is the whole grid:
  15 points of both ops fit in about 6 minutes)."""
  _check_choice("subset", subset, SUBSETS)
  if subset == "smoke":
    return (ChunkedPoint(32, 100, tokens=100, heads=2),)
  return tuple(ChunkedPoint(k, t) for k in CHUNKED_KEY_SIZES for t in CHUNKED_LENGTHS)


def moe_grid(subset: str = "full") -> tuple[MoePoint, ...]:
  """The MoE points of `subset`."""
  _check_choice("subset", subset, SUBSETS)
  if subset == "smoke":
    return (MoePoint(8, 2, 256, 256, tokens=128),)
  widths = (_MOE_QUICK_WIDTHS if subset == "quick" else
            [(d, f) for d in MOE_WIDTHS for f in MOE_WIDTHS])
  return tuple(MoePoint(e, k, d, f) for e, k in MOE_EXPERTS_TOP_K for d, f in widths)


def scan_grid(subset: str = "full") -> tuple[ScanPoint, ...]:
  """The selective-scan points of `subset` ('quick' is the whole grid)."""
  _check_choice("subset", subset, SUBSETS)
  if subset == "smoke":
    return (ScanPoint(24, batch=2, length=256, width=16),)
  return tuple(ScanPoint(s) for s in SCAN_STATE_SIZES)


GRIDS = {"attention": attention_grid, "chunked": chunked_grid, "moe": moe_grid,
         "scan": scan_grid}


def select(points, stride: int = 1, offset: int = 0) -> tuple:
  """Every `stride`-th point from the `offset`-th (offsets 0..stride-1 partition
  `points`)."""
  _check_positive(stride=stride)
  if not isinstance(offset, int) or not 0 <= offset < stride:
    raise ValueError(f"`offset` must be an int in [0, stride), got {offset=} {stride=}")
  return tuple(points[offset::stride])


class GridFlags(NamedTuple):
  """A program's grid flags (`define_flags`)."""
  grid: flags.FlagHolder
  subset: flags.FlagHolder
  stride: flags.FlagHolder
  offset: flags.FlagHolder
  check: flags.FlagHolder

  def points(self, op: str, subset: str | None = None) -> tuple:
    """The points of `op` ('attention', 'chunked', 'moe', 'scan') the flags
    name (`subset`, when given, in place of --grid_subset's)."""
    return select(GRIDS[op](subset or self.subset.value), self.stride.value,
                  self.offset.value)


def define_flags() -> GridFlags:
  """Defines --grid, --grid_subset, --grid_stride, --grid_offset and
  --grid_check for the calling program (once, at its import)."""
  holders = GridFlags(
      flags.DEFINE_bool("grid", False, "Time the shape grid (experiments/shape_grid.py) "
                        "instead of the headline shapes."),
      flags.DEFINE_enum("grid_subset", "quick", SUBSETS, "With --grid: 'full', 'quick' "
                        "(about 5 minutes of one H200 per op) or 'smoke' (CPU sizes)."),
      flags.DEFINE_integer("grid_stride", 1, "With --grid: every n-th point of the subset.",
                           lower_bound=1),
      flags.DEFINE_integer("grid_offset", 0, "With --grid: the first point taken "
                           "(0 <= offset < --grid_stride).", lower_bound=0),
      flags.DEFINE_bool("grid_check", False, "With --grid: check every implementation timed "
                        "at every point against the float32 reference (forward, final "
                        "state where there is one, gradients) before timing it there."))
  flags.register_multi_flags_validator(
      ["grid_stride", "grid_offset"], lambda v: v["grid_offset"] < v["grid_stride"],
      message="--grid_offset must be less than --grid_stride")
  return holders


def count(op: str, subset: str = "full") -> int:
  """How many points `op`'s grid has in `subset`."""
  return len(GRIDS[op](subset))
