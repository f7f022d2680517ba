"""Mosaic GPU (Hopper) state walks of the gated delta rule, forward and reverse.

The walks are the serial part of the op: per (batch, head) the forward carries
the [K, V] state M through the chunks, `U = U~ - W M0`, `M1 = e^{b_L} M0 +
K^T (D U)` with `D = diag(e^{b_L - b})`, and stores the state entering each
chunk and U; the reverse (`walk_reverse`) carries the adjoint back. There are
only B x N walks (128 at B 8, N 16), about one per SM, so a walk's time is its
chain's latency per chunk times the number of chunks. The Triton walks
(`pallas._states_kernel`, `pallas._states_bwd_kernel`) take about 2.7 and
3.4 us a chunk at K = V = 128 on an H200. Here a block has three warpgroups:

- a memory warpgroup streams each chunk's operands into a ring of `slots`
  shared-memory slots with TMA, ahead of the chain;
- two compute warpgroups hold the f32 state in registers, 64 of its K rows
  each. Per chunk each writes its rows (in the input dtype) to shared memory
  and hands them to TMA for the states output; then each forms 64 of the V
  columns of `U = U~ - W M0` with `wgmma` (W's tile is padded to the 64 rows a
  warpgroup's `wgmma` takes; the rows past the chunk are never read), stores
  them (TMA) and their rows scaled by D to shared memory; then each adds
  `K^T (D U)` for its K rows with one more `wgmma`.

So the chain per chunk is two `wgmma`s and two warpgroup barriers, and the
loads and stores run beside it. The reverse walk has the same structure on
the adjoint G: `dU = scale S^T dY + D K G`, `G <- e^{b_L} G + Q^T (scale E dY)
- W^T dU` with `E = diag(e^b)`. Every `wgmma` reads both operands from shared
memory, so the kernels run unchanged in Mosaic GPU interpret mode.

Rounding differs from the Triton walks where a decay scales an operand: the
forward multiplies K by D U rounded to the input dtype (the Triton walk rounds
`e^{b_L - b} K` and U), and the reverse multiplies Q by `scale E dY` rounded
(the Triton walk rounds `e^b Q`) and scales K G's rows by D in float32 after
the product.

Glossary: B batch, T time (a multiple of the chunk), N heads, G key groups,
K key size, V value size, L tokens per chunk, WG warpgroup.
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from ops import _pallas
from ops._mosaic_gpu import DTYPES
from ops._mosaic_gpu import swizzled
from ops._mosaic_gpu import takes as _mosaic_takes

_F32 = jnp.float32
KEY_SIZE = VALUE_SIZE = 128   # the padded sizes the walk is written for
_ROWS = 64                    # a warpgroup's wgmma rows
_COMPUTE_WGS = 2
_COMPUTE_REGISTERS = 232
_MEMORY_REGISTERS = 40


def limit(dtype, key: int, value: int, chunk: int) -> str | None:
  """None when the Mosaic walk takes these (padded) sizes, else why not."""
  if jnp.dtype(dtype) not in DTYPES:
    return f"the Mosaic walk takes 16-bit inputs, got {jnp.dtype(dtype).name}"
  if (key, value) != (KEY_SIZE, VALUE_SIZE):
    return (f"the Mosaic walk takes padded K = V = {KEY_SIZE}, got K = {key}, "
            f"V = {value}")
  if not 16 <= chunk <= _ROWS // 2:  # the chunks tested (interpret mode) and timed
    return f"the Mosaic walk takes chunks of 16 to {_ROWS // 2} tokens, got {chunk}"
  return None


def takes(dtype, key: int, value: int, chunk: int) -> bool:
  """Whether the compiled Mosaic walk runs these inputs here (a Hopper GPU)."""
  return _mosaic_takes(dtype) and limit(dtype, key, value, chunk) is None


def _kernel(k_gmem, w_gmem, ut_gmem, b_gmem, h0_gmem, states_gmem, u_gmem, final_gmem, *,
            chunk, groups_per_key, slots):
  L = chunk
  num_chunks = k_gmem.shape[1] // L
  dtype = w_gmem.dtype
  bi, n = lax.axis_index("batch"), lax.axis_index("heads")
  g = lax.div(n, jnp.int32(groups_per_key))
  half = _ROWS  # K rows of the state and V columns of U per compute warpgroup

  def scoped(k_smem, w_smem, ut_smem, b_smem, state_smem, u_smem, du_smem,
             loaded, free, state_ready, u_ready):
    wg = lax.axis_index("wg")

    @pl.when(wg < _COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
      mine = pl.ds(wg * half, half)  # this WG's K rows of M and V columns of U
      rows_layout = plgpu.Layout.WGMMA.reduce(1)
      m0 = plgpu.load(h0_gmem.at[bi, n, mine], layout=plgpu.Layout.WGMMA,
                      optimized=False)

      def step(c, m):
        parity, slot = lax.rem(c, 2), lax.rem(c, slots)
        # The state entering chunk c: to shared memory (the U product reads all
        # K rows of it) and, by TMA, to the states output. The store two chunks
        # back read this buffer; at most three newer groups may be in flight.
        plgpu.wait_smem_to_gmem(3, wait_read_only=True)
        state_smem.at[parity, mine][...] = m.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(state_smem.at[parity, mine],
                                states_gmem.at[bi, n, c, mine])
        plgpu.barrier_arrive(state_ready)
        plgpu.barrier_wait(state_ready)
        plgpu.barrier_wait(loaded.at[slot])

        # U[:, mine] = U~ - W M0 (rows past the chunk: padding, never read).
        def w_m0(acc_ref):
          plgpu.wgmma(acc_ref, w_smem.at[slot], state_smem.at[parity, :, mine])
          return acc_ref[...]
        wm = pl.run_scoped(w_m0, plgpu.ACC((_ROWS, half), _F32))
        u_tilde = plgpu.load(ut_smem.at[slot, :, mine], layout=plgpu.Layout.WGMMA)
        u = (u_tilde.astype(_F32) - wm).astype(dtype)
        b = plgpu.load(b_smem.at[slot], layout=rows_layout)       # [64]: chunk rows
        b_last = b_smem[slot, L - 1]
        decay = jnp.exp(b_last - b)                               # D, per row
        plgpu.wait_smem_to_gmem(3, wait_read_only=True)  # u_smem[parity] is free
        u_smem.at[parity, wg][...] = u
        du_smem.at[:, mine][...] = (
            u.astype(_F32) * lax.broadcast_in_dim(decay, u.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(u_smem.at[parity, wg, pl.ds(0, L)],
                                u_gmem.at[bi, pl.ds(c * L, L), n, mine])
        plgpu.barrier_arrive(u_ready)
        plgpu.barrier_wait(u_ready)

        # M1[mine] = e^{b_L} M0[mine] + K[:, mine]^T (D U).
        def k_du(acc_ref):
          plgpu.wgmma(acc_ref, k_smem.at[slot, :, mine].transpose((1, 0)),
                      du_smem.at[pl.ds(0, L)])
          return acc_ref[...]
        update = pl.run_scoped(k_du, plgpu.ACC((half, VALUE_SIZE), _F32))
        plgpu.barrier_arrive(free.at[slot])
        return jnp.exp(b_last) * m + update

      m = lax.fori_loop(0, num_chunks, step, m0)
      final_gmem.at[bi, n, mine][...] = m
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

      def load(c, slot):
        rows, head_rows = pl.ds(c * L, L), pl.ds(0, L)
        done = loaded.at[slot]
        plgpu.copy_gmem_to_smem(k_gmem.at[bi, rows, g], k_smem.at[slot], done)
        plgpu.copy_gmem_to_smem(w_gmem.at[bi, rows, n], w_smem.at[slot, head_rows], done)
        plgpu.copy_gmem_to_smem(ut_gmem.at[bi, rows, n], ut_smem.at[slot, head_rows], done)
        plgpu.copy_gmem_to_smem(b_gmem.at[bi, n, rows], b_smem.at[slot, head_rows], done)

      _stream(num_chunks, slots, load, free)

  tiles = swizzled(dtype, KEY_SIZE)
  narrow = swizzled(dtype, L)
  pl.run_scoped(
      scoped,
      # K and D U: the update's operands, whose contraction (over L tokens) must
      # span whole swizzle groups: 64-byte swizzles take L = 32.
      plgpu.SMEM((slots, L, KEY_SIZE), dtype, transforms=narrow),          # K
      plgpu.SMEM((slots, _ROWS, KEY_SIZE), dtype, transforms=tiles),       # W, padded
      plgpu.SMEM((slots, _ROWS, VALUE_SIZE), dtype, transforms=tiles),     # U~, padded
      plgpu.SMEM((slots, _ROWS), _F32),                                    # b
      plgpu.SMEM((2, KEY_SIZE, VALUE_SIZE), dtype, transforms=tiles),      # M0
      # U, a [64, 64] tile per warpgroup (TMA stores contiguous tiles only)
      plgpu.SMEM((2, _COMPUTE_WGS, _ROWS, half), dtype, transforms=swizzled(dtype, half)),
      plgpu.SMEM((_ROWS, VALUE_SIZE), dtype, transforms=narrow),           # D U
      plgpu.Barrier(num_arrivals=4, num_barriers=slots),   # a chunk's four loads
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=slots),  # slot released
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS),            # both state halves written
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS),            # both D U halves written
      collective_axes="wg",
  )


def _reverse_kernel(q_gmem, k_gmem, w_gmem, dy_gmem, b_gmem, scores_gmem, dfinal_gmem,
                    dstates_gmem, du_gmem, dh0_gmem, *, chunk, groups_per_key, slots, scale):
  """The reversed walk: the adjoint G of the state leaving each chunk, from the
  last chunk back. Per chunk `dU = scale S^T dY + D K G` and
  `G <- e^{b_L} G + Q^T (scale E dY) - W^T dU` with `E = diag(e^b)`; warpgroup
  j forms dU's V columns j and G's K rows j."""
  L = chunk
  num_chunks = k_gmem.shape[1] // L
  dtype = w_gmem.dtype
  bi, n = lax.axis_index("batch"), lax.axis_index("heads")
  g = lax.div(n, jnp.int32(groups_per_key))
  half = _ROWS

  def scoped(k_smem, q_smem, w_smem, dy_smem, st_smem, b_smem, g_smem, du_out_smem,
             du_smem, edy_smem, loaded, free, g_ready, du_ready):
    wg = lax.axis_index("wg")

    @pl.when(wg < _COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
      mine = pl.ds(wg * half, half)
      rows_layout = plgpu.Layout.WGMMA.reduce(1)
      g0 = plgpu.load(dfinal_gmem.at[bi, n, mine], layout=plgpu.Layout.WGMMA,
                      optimized=False)

      def step(t, adj):
        c = num_chunks - 1 - t
        parity, slot = lax.rem(t, 2), lax.rem(t, slots)
        # G to shared memory (the D K G product reads all K rows) and, by TMA,
        # to the adjoint-states output; its store one chunk back read g_smem.
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        g_smem.at[mine][...] = adj.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(g_smem.at[mine], dstates_gmem.at[bi, n, c, mine])
        plgpu.barrier_arrive(g_ready)
        plgpu.barrier_wait(g_ready)
        plgpu.barrier_wait(loaded.at[slot])

        # dU[:, mine] = scale S^T dY + D K G (padded rows: never read).
        def k_g(acc_ref):
          plgpu.wgmma(acc_ref, k_smem.at[slot], g_smem.at[:, mine])
          return acc_ref[...]
        def st_dy(acc_ref):
          plgpu.wgmma(acc_ref, st_smem.at[slot], dy_smem.at[slot, pl.ds(0, L), mine])
          return acc_ref[...]
        kg = pl.run_scoped(k_g, plgpu.ACC((_ROWS, half), _F32))
        sdy = pl.run_scoped(st_dy, plgpu.ACC((_ROWS, half), _F32))
        b = plgpu.load(b_smem.at[slot], layout=rows_layout)
        b_last = b_smem[slot, L - 1]
        rows = lambda x: lax.broadcast_in_dim(x, (_ROWS, half), [0])
        du = (scale * sdy + rows(jnp.exp(b_last - b)) * kg).astype(dtype)
        dy = plgpu.load(dy_smem.at[slot, :, mine], layout=plgpu.Layout.WGMMA)
        plgpu.wait_smem_to_gmem(2, wait_read_only=True)  # du_out_smem[parity] is free
        du_out_smem.at[parity, wg][...] = du
        du_smem.at[:, mine][...] = -du
        edy_smem.at[:, mine][...] = (rows(scale * jnp.exp(b)) * dy.astype(_F32)).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(du_out_smem.at[parity, wg, pl.ds(0, L)],
                                du_gmem.at[bi, pl.ds(c * L, L), n, mine])
        plgpu.barrier_arrive(du_ready)
        plgpu.barrier_wait(du_ready)

        # G[mine] <- e^{b_L} G[mine] + Q[:, mine]^T (scale E dY) - W[:, mine]^T dU.
        def update(acc_ref):
          plgpu.wgmma(acc_ref, q_smem.at[slot, :, mine].transpose((1, 0)),
                      edy_smem.at[pl.ds(0, L)])
          plgpu.wgmma(acc_ref, w_smem.at[slot, :, mine].transpose((1, 0)),
                      du_smem.at[pl.ds(0, L)])
          return acc_ref[...]
        terms = pl.run_scoped(update, plgpu.ACC((half, VALUE_SIZE), _F32))
        plgpu.barrier_arrive(free.at[slot])
        return jnp.exp(b_last) * adj + terms

      adj = lax.fori_loop(0, num_chunks, step, g0)
      dh0_gmem.at[bi, n, mine][...] = adj
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

      def load(t, slot):
        c = num_chunks - 1 - t
        rows, head_rows = pl.ds(c * L, L), pl.ds(0, L)
        done = loaded.at[slot]
        plgpu.copy_gmem_to_smem(k_gmem.at[bi, rows, g], k_smem.at[slot, head_rows], done)
        plgpu.copy_gmem_to_smem(q_gmem.at[bi, rows, g], q_smem.at[slot], done)
        plgpu.copy_gmem_to_smem(w_gmem.at[bi, rows, n], w_smem.at[slot], done)
        plgpu.copy_gmem_to_smem(dy_gmem.at[bi, rows, n], dy_smem.at[slot, head_rows], done)
        plgpu.copy_gmem_to_smem(scores_gmem.at[bi, n, rows], st_smem.at[slot, head_rows],
                                done)
        plgpu.copy_gmem_to_smem(b_gmem.at[bi, n, rows], b_smem.at[slot, head_rows], done)

      _stream(num_chunks, slots, load, free)

  wide, narrow = swizzled(dtype, KEY_SIZE), swizzled(dtype, L)
  pl.run_scoped(
      scoped,
      plgpu.SMEM((slots, _ROWS, KEY_SIZE), dtype, transforms=wide),      # K, padded
      # Operands contracted over the chunk's L tokens: 64-byte swizzles at L = 32.
      plgpu.SMEM((slots, L, KEY_SIZE), dtype, transforms=narrow),        # Q
      plgpu.SMEM((slots, L, KEY_SIZE), dtype, transforms=narrow),        # W
      plgpu.SMEM((slots, _ROWS, VALUE_SIZE), dtype, transforms=narrow),  # dY, padded
      plgpu.SMEM((slots, _ROWS, L), dtype, transforms=narrow),           # S^T, padded
      plgpu.SMEM((slots, _ROWS), _F32),                                  # b
      plgpu.SMEM((KEY_SIZE, VALUE_SIZE), dtype, transforms=wide),        # G
      plgpu.SMEM((2, _COMPUTE_WGS, _ROWS, half), dtype, transforms=swizzled(dtype, half)),
      plgpu.SMEM((_ROWS, VALUE_SIZE), dtype, transforms=narrow),         # -dU
      plgpu.SMEM((_ROWS, VALUE_SIZE), dtype, transforms=narrow),         # scale E dY
      plgpu.Barrier(num_arrivals=6, num_barriers=slots),   # a chunk's six loads
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=slots),
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS),            # both halves of G written
      plgpu.Barrier(num_arrivals=_COMPUTE_WGS),            # both halves of dU, E dY
      collective_axes="wg",
  )


def _stream(num_chunks, slots, load, free):
  """The memory warpgroup: `load(t, slot)` for t = 0, 1, ..., each into the
  ring slot the compute warpgroups released `slots` chunks before."""
  @pl.loop(0, num_chunks)
  def _load(t):
    slot = lax.rem(t, slots)
    pl.when(t >= slots)(lambda: plgpu.barrier_wait(free.at[slot]))
    load(t, slot)

  # See every phase of the barriers it waits on (interpret mode checks).
  @pl.loop(max(num_chunks - slots, 0), num_chunks)
  def _drain(t):
    plgpu.barrier_wait(free.at[lax.rem(t, slots)])


def _check(caller, dtype, key, value, time, chunk, slots):
  if (why := limit(dtype, key, value, chunk)) is not None:
    raise ValueError(f"{caller}: {why}")
  if time % chunk:
    raise ValueError(f"{caller}: T = {time} must be a multiple of `chunk` {chunk}")
  if slots < 2:
    raise ValueError(f"{caller}: `slots` must be >= 2, got {slots}")


def _launch(kernel, *, name, dtype, key, value, num_chunks, rows, args, interpret):
  """One block per (head, batch): outputs [B, N, C, K, V] and `rows`' shape in
  `dtype`, and a [B, N, K, V] float32 state."""
  batch, heads = rows.shape[0], rows.shape[2]
  out_type = (jax.ShapeDtypeStruct((batch, heads, num_chunks, key, value), dtype),
              jax.ShapeDtypeStruct(rows.shape, dtype),
              jax.ShapeDtypeStruct((batch, heads, key, value), _F32))
  return _pallas.mosaic_kernel(
      kernel, out_type=out_type, grid=(heads, batch), grid_names=("heads", "batch"),
      num_threads=_COMPUTE_WGS + 1, thread_name="wg", kernel_name=name,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(*args)


def walk_forward(k, w, u_tilde, b, h0, *, chunk: int, slots: int = 2,
                 interpret: bool = False):
  """The forward state walk on the Mosaic GPU kernel.

  Args:
    k: [B, T, G, K] keys (T a multiple of `chunk`, K = 128).
    w, u_tilde: [B, T, N, K] and [B, T, N, V] (V = 128), the prepare kernel's
      W and U~, in k's 16-bit dtype.
    b: [B, N, T] float32, the chunk-local cumulative log-decay.
    h0: [B, N, K, V] float32 initial state.
    chunk: tokens per chunk (16 to 32).
    slots: shared-memory slots of the input ring (2 or more).
    interpret: run in Mosaic GPU interpret mode (the CPU).

  Returns:
    (states [B, N, C, K, V] entering each chunk, U [B, T, N, V], both in k's
    dtype; the final state [B, N, K, V] float32).
  """
  time, groups, key = k.shape[1:]
  heads, value = u_tilde.shape[2:]
  _check("walk_forward", k.dtype, key, value, time, chunk, slots)
  kernel = functools.partial(_kernel, chunk=chunk, groups_per_key=heads // groups,
                             slots=slots)
  return _launch(kernel, name="gated_delta_states_mosaic", dtype=k.dtype, key=key,
                 value=value, num_chunks=time // chunk, rows=u_tilde,
                 args=(k, w, u_tilde, b, h0), interpret=interpret)


def walk_reverse(q, k, w, dy, b, scores_t, dfinal, *, chunk: int, scale: float,
                 slots: int = 2, interpret: bool = False):
  """The backward's reversed state walk on the Mosaic GPU kernel.

  Args:
    q, k: [B, T, G, K] (T a multiple of `chunk`, K = 128), 16-bit.
    w: [B, T, N, K], the prepare kernel's W; dy: [B, T, N, V] (V = 128), the
      output's cotangent; both in q's dtype.
    b: [B, N, T] float32, the chunk-local cumulative log-decay.
    scores_t: [B, N, T, L], each chunk's transposed decayed scores S^T.
    dfinal: [B, N, K, V] float32, the final state's cotangent.
    chunk, scale: the chunk (16 to 32 tokens) and the output scale.
    slots, interpret: as in `walk_forward`.

  Returns:
    (the adjoint of the state leaving each chunk [B, N, C, K, V] and dU
    [B, T, N, V], in q's dtype; d initial_state [B, N, K, V] float32).
  """
  time, groups, key = k.shape[1:]
  heads, value = dy.shape[2:]
  _check("walk_reverse", k.dtype, key, value, time, chunk, slots)
  kernel = functools.partial(_reverse_kernel, chunk=chunk, groups_per_key=heads // groups,
                             slots=slots, scale=scale)
  return _launch(kernel, name="gated_delta_states_reverse_mosaic", dtype=k.dtype, key=key,
                 value=value, num_chunks=time // chunk, rows=dy,
                 args=(q, k, w, dy, b, scores_t, dfinal), interpret=interpret)
