r"""fit()'s training-loop overhead against a hand-written jitted optax loop.

    python -m experiments.benchmark_fit    # docs/benchmarks/fit.json

One process, one model: a Transformer (D 256, 8 heads of 32, 4 layers) on
batches of 8 x 1024 tokens, bf16 activations, float32 parameters, Adam. Rows:

  bare_step     one jitted step, synced after every call (harness.run_case).
  bare_loop     a Python loop over the same jitted step with donated state,
                batches already on the device, synced once at the end: the
                fastest a loop can drive this step. What it does not do, and
                fit() does: shuffle and gather the batch on the device, compute
                the gradient's and the update's norms, keep a non-finite
                update out of the state, pack metrics and read them on the
                host every call, keep a per-step history.
  bare_loop_calls   with `--steps_per_call=K` > 1: the bare step run K times
                per jitted call (`lax.scan` over K batches stacked on the
                device), the like-for-like baseline of the *_calls rows
                (`bare_calls_time_ratio`); they also report the ratio to
                bare_loop (K = 1), as the issue's target states it.
  fit_memory    fit() on in-memory arrays (device-side shuffle and gather),
                second call (its first compiled the step), default arguments:
                a small model (state <= 256 MiB) runs 64 steps per call.
  fit_stream    fit() on a generator of host numpy batches (prefetch thread on a
                GPU, prepared on the main thread on a CPU).
  fit_memory_one_step / fit_stream_one_step   the same with
                `steps_per_call=1` (what fit does with callbacks, checkpoints
                or a big state).
  fit_first / fit_second   the wall time of a first and a second fit() call
                of `--calls_steps` steps: the second one compiles nothing.
  fit_rebuilt_first / fit_rebuilt_second   the same as a notebook cell run
                twice does it: each call builds a new `hk.transform` and
                writes its optimizer inline (`optax.adam(...)`), so no Python
                object is shared; the second call traces its steps and finds
                the program compiled (`backend_compiles` 0). `backend_compile_s`
                sums XLA's compile time inside a call, `trace_s` the steps'
                tracing (keys included); `second_over_first_compile` is the
                second call's wall time over the first call's compile time
                (what a rebuilt model costs against compiling it again).
  fit_memory_calls / fit_stream_calls   with `--steps_per_call=K` > 1: fit()
                running K steps per compiled call (one dispatch and one
                metrics read per K steps; a stream's K batches sent at once).

`steps_per_s` of a fit row is the call's whole wall time over its steps
(setup, data placement, the last metrics read included); `steady_steps_per_s`
is fit's own figure (first step excluded).

`--repeats=R` runs bare_loop, fit_memory and fit_stream R times, interleaved
(round r times all three), so a shared machine's load drifts across all rows
alike; each row then reports the median over rounds and `ratio_min`/`ratio_max`,
the spread of the per-round time ratio to that round's bare_loop.

`--pieces` adds rows that time the compiled step alone (a jitted loop with
donated state, synced once, no host reads), interleaved over `--repeats`
rounds, each round's time over that round's `step_bare`:

  step_bare          the bare loop's step (step counter and key in the state).
  step_grad_norm     + the gradient's norm as a metric, packed with the loss.
  step_reject_loss_grad   + rejecting the update (a `lax.cond`) when the loss
                or the gradient norm is not finite. Not fit's guarantee (a
                finite gradient can still make a non-finite update): the
                floor of a guard that checks no update.
  step_fit_select / step_fit_cond   fit's own compiled step (`array_step`:
                device-side gather, the full guard, packed metrics) with each
                way of keeping a rejected update out (`StepSpec.guard`).
  step_fit_calls_guarded / step_fit_calls_optimistic   with
                `--steps_per_call=K` > 1: fit's K-step call with the full
                guard in every step (as before the optimistic calls), and the
                optimistic call fit() now runs (loss and gradient checked per
                step, the final state once; not donated), each with its
                metrics read after every call.

`--model=mlp` swaps the Transformer for a 3-hidden-layer MLP of width
`--model_dim` on `--seq_len` features (the issue's benchmark): the step is then
dominated by the optimizer's elementwise passes, the worst case for fit's
non-finite guard.
"""

import json
import statistics
import time

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import probjax_hk as pk
from experiments import harness
from experiments import tracing
from probjax_hk.training import loop as fit_loop
from probjax_hk.training import programs
from probjax_hk.training import sharding as sharding_lib
from probjax_hk.training import step as step_lib

_OUTPUT = flags.DEFINE_string("output", "docs/benchmarks/fit.json",
                              "Where to write the JSON rows (the curated suite file; another "
                              "for trial runs).")
_STEPS = flags.DEFINE_integer("steps", 300, "Steps per timed loop.")
_CALLS_STEPS = flags.DEFINE_integer("calls_steps", 20,
                                    "Steps of the first/second-call rows.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 1024, "Tokens per sequence.")
_MODEL_DIM = flags.DEFINE_integer("model_dim", 256, "Transformer width.")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 4, "Transformer blocks.")
_TRACE = flags.DEFINE_list(
    "trace", None, "Cases (e.g. bare_loop_calls,fit_memory_calls) to run once more under "
    "the profiler: device-busy time, launches and kernels per step.")
_STEPS_PER_CALL = flags.DEFINE_integer(
    "steps_per_call", 1, "K > 1 adds a fit_memory_calls row: fit(steps_per_call=K).")
_MODEL = flags.DEFINE_enum("model", "transformer", ["transformer", "mlp"],
                           "The model whose training step is timed.")
_REPEATS = flags.DEFINE_integer(
    "repeats", 1, "Interleaved rounds of bare_loop/fit_memory/fit_stream.")
_PIECES = flags.DEFINE_bool(
    "pieces", False, "Add the step_* rows: the compiled step alone, piece by piece.")
_CALLS_ONLY = flags.DEFINE_bool(
    "calls_only", False, "Only bare_step and the first/second-call rows (fit_first, "
    "fit_second, fit_rebuilt_*): what a second fit() call costs.")
_VOCAB = 256
_NUM_EXAMPLES = 64


def _loss(batch):
  if _MODEL.value == "mlp":  # [B, F] features -> [B] regression
    width = _MODEL_DIM.value
    pred = hk.nets.MLP([width, width, width, 1])(batch["x"])[:, 0]
    return jnp.mean((pred - batch["y"]) ** 2)
  x = jax.nn.one_hot(batch["tokens"], _VOCAB, dtype=jnp.bfloat16)  # [B, T, V]
  # jax.nn's attention (cuDNN on the GPU): this measures the loop, not kernels.
  h = pk.Transformer(_MODEL_DIM.value, 8, _NUM_LAYERS.value, is_causal=True,
                     attention_fn=jax.nn.dot_product_attention)(x)  # [B, T, D]
  logits = pk.Linear(_VOCAB, name="head")(h).astype(jnp.float32)  # [B, T, V]
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["targets"]).mean()


NET = hk.transform(_loss)
OPTIMIZER = optax.adam(1e-3)
# The rebuilt rows' optimizer: another learning rate than OPTIMIZER's, so
# that their first call compiles a program no other row has compiled.
_REBUILT_LEARNING_RATE = 2e-3
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_compile_seconds = []  # every XLA compile's duration, in order


def _on_duration(event, duration, **kwargs):
  del kwargs
  if event == _BACKEND_COMPILE:
    _compile_seconds.append(duration)


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _data(n):
  rs = np.random.RandomState(0)
  if _MODEL.value == "mlp":
    x = rs.randn(n, _SEQ_LEN.value).astype(np.float32)
    return {"x": x, "y": np.tanh(x.sum(1) / 8).astype(np.float32)}
  tokens = rs.randint(0, _VOCAB, (n, _SEQ_LEN.value)).astype(np.int32)
  return {"tokens": tokens, "targets": np.roll(tokens, 1, axis=1)}


def _bare_step(params, opt_state, rng, step, batch):
  loss, grads = jax.value_and_grad(NET.apply)(
      params, jax.random.fold_in(rng, step), batch)
  updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def _piece_cases(config, params, data, device_batches, steps):
  """The step_* cases: fit's step taken apart (see the module docstring)."""
  bsz = _BATCH.value

  def make(grad_norm, reject):
    def step(ts, batch):
      p, s, i = ts["params"], ts["opt_state"], ts["step"]
      rng = step_lib.step_key(ts["rng"], i)
      loss, grads = jax.value_and_grad(NET.apply)(p, rng, batch)
      def apply():
        updates, new_s = OPTIMIZER.update(grads, s, p)
        return optax.apply_updates(p, updates), new_s
      metrics = loss
      if grad_norm:
        norm = optax.tree.norm(grads)
        metrics = jnp.stack([loss, norm])
      if reject:
        ok = jnp.isfinite(loss) & jnp.isfinite(norm)
        p, s = jax.lax.cond(ok, apply, lambda: (p, s))
      else:
        p, s = apply()
      return dict(ts, params=p, opt_state=s, step=i + 1), metrics
    return jax.jit(step, donate_argnums=0)

  def loop_case(case, fn, args_fn):
    def run():
      ts = args_fn()
      out = fn(ts, *extra(0))
      jax.block_until_ready(out)
      ts = out[0]
      start = time.perf_counter()
      for i in range(steps):
        ts, metrics = fn(ts, *extra(i))
      jax.block_until_ready((ts, metrics))
      wall = time.perf_counter() - start
      return dict(config, case=case, status="ok", wall_s=wall,
                  steps_per_s=steps / wall)
    extra = args_fn.extra
    return run

  def bare_state():
    return {"params": jax.tree.map(jnp.copy, params),
            "opt_state": OPTIMIZER.init(params), "step": jnp.int32(0),
            "rng": jax.random.PRNGKey(1)}
  bare_state.extra = lambda i: (device_batches[i % len(device_batches)],)

  mesh = sharding_lib.default_mesh()
  arrays = sharding_lib.put_replicated(data, mesh)
  perm = jnp.concatenate([jax.random.permutation(
      jax.random.PRNGKey(e), _NUM_EXAMPLES) for e in range(8)]).astype(jnp.int32)
  perm = sharding_lib.put_replicated(perm, mesh)
  steps_per_epoch = _NUM_EXAMPLES // bsz

  def fit_state():
    return sharding_lib.put_replicated(dict(
        bare_state(), state={}, nonfinite=np.int32(0),
        first_nonfinite=np.int32(-1)), mesh)
  fit_state.extra = lambda i: (arrays, perm, bsz, steps_per_epoch,
                               _NUM_EXAMPLES)

  def fit_step(guard):
    return step_lib.array_step(spec(guard))

  def calls_case(case, fn, k):  # K steps per call, metrics read per call
    def run():
      ts = fit_state()
      out = fn(ts, *fit_state.extra(0))
      jax.block_until_ready(out)
      ts = out[0]
      calls = steps // k
      start = time.perf_counter()
      for _ in range(calls):
        ts, *rest = fn(ts, *fit_state.extra(0))
        np.asarray(rest[0])
        assert len(rest) == 1 or bool(rest[1])  # optimistic: state finite
      wall = time.perf_counter() - start
      return dict(config, case=case, status="ok", wall_s=wall,
                  steps_per_s=calls * k / wall, steps_per_call=k)
    return run

  k = _STEPS_PER_CALL.value
  spec = lambda guard: step_lib.StepSpec(
      loss_fn=NET.apply, optimizer=OPTIMIZER, has_state=False, has_aux=False,
      use_mask=False, on_nonfinite="raise", mesh=mesh, donate=True,
      metric_names=step_lib.BASE_METRICS, guard=guard)
  calls = []
  if k > 1:
    calls = [
        calls_case("step_fit_calls_guarded", step_lib.array_step(
            spec("auto"), k), k),
        calls_case("step_fit_calls_optimistic", step_lib.array_step(
            spec("auto"), k, optimistic=True), k)]
  return calls + [
      loop_case("step_bare", make(False, False), bare_state),
      loop_case("step_grad_norm", make(True, False), bare_state),
      loop_case("step_reject_loss_grad", make(True, True), bare_state),
      loop_case("step_fit_select", fit_step("select"), fit_state),
      loop_case("step_fit_cond", fit_step("cond"), fit_state),
  ]


def _trace_rows(named_cases) -> list[dict]:
  """One more run of each case under the profiler (after the timed rounds,
  so tracing costs no timed row anything): device-busy and wall time per
  step, kernel launches per step and the kernels that take the time."""
  rows = []
  for name, case in named_cases:
    row, events = tracing.traced(case)
    steps = row["steps_per_s"] * row["wall_s"]
    kernels = tracing.kernel_rows(events, per=steps)
    rows.append(dict(case=name, section="trace", status="ok",
                     wall_us_per_step=row["wall_s"] * 1e6 / steps,
                     busy_us_per_step=tracing.busy_ns(events) / 1e3 / steps,
                     launches_per_step=len(events) / steps, kernels=kernels[:25]))
    print(f"## trace {name}: wall {rows[-1]['wall_us_per_step']:.1f} us/step, device "
          f"busy {rows[-1]['busy_us_per_step']:.1f} us/step, "
          f"{rows[-1]['launches_per_step']:.1f} launches/step", flush=True)
    print(harness.format_table(
        [dict(k, name=tracing.short_name(k["name"])) for k in kernels[:12]],
        ["name", "us", "launches", "share"]), flush=True)
  return rows


def main(argv):
  del argv
  steps, bsz = _STEPS.value, _BATCH.value
  data = _data(_NUM_EXAMPLES)
  params = NET.init(jax.random.PRNGKey(0), {k: v[:bsz] for k, v in data.items()})
  config = dict(model=_MODEL.value, batch=bsz, seq_len=_SEQ_LEN.value,
                model_dim=_MODEL_DIM.value, num_layers=_NUM_LAYERS.value,
                dtype="bfloat16" if _MODEL.value == "transformer" else
                "float32", platform=jax.default_backend(), steps=steps,
                repeats=_REPEATS.value)
  rows = []

  # bare_step: one call, synced (the harness' per-call median).
  device_batches = [jax.device_put({k: v[i:i + bsz] for k, v in data.items()})
                    for i in range(0, _NUM_EXAMPLES, bsz)]
  rng = jax.random.PRNGKey(1)
  opt_state = OPTIMIZER.init(params)
  row = harness.run_case(dict(config, case="bare_step"), lambda: (
      jax.jit(_bare_step), (params, opt_state, rng, 0, device_batches[0])),
                         warmup=3, iters=50, sample_ms=0.0)  # one call per sample
  if row.get("status") == "ok":
    row["steps_per_s"] = 1e3 / row["median_ms"]
  rows.append(row)

  # bare_loop: the hand-written loop, donated state, synced once.
  step_fn = jax.jit(_bare_step, donate_argnums=(0, 1))

  def bare_loop():
    p = jax.tree.map(jnp.copy, params)
    s = OPTIMIZER.init(p)
    start = time.perf_counter()
    p, s, loss = step_fn(p, s, rng, 0, device_batches[0])
    jax.block_until_ready(loss)
    compile_s = time.perf_counter() - start
    for i in range(5):
      p, s, loss = step_fn(p, s, rng, i,
                           device_batches[i % len(device_batches)])
    jax.block_until_ready((p, loss))
    start = time.perf_counter()
    for i in range(steps):
      p, s, loss = step_fn(p, s, rng, i,
                           device_batches[i % len(device_batches)])
    jax.block_until_ready((p, loss))
    wall = time.perf_counter() - start
    return dict(config, case="bare_loop", status="ok", compile_s=compile_s,
                wall_s=wall, steps_per_s=steps / wall, final_loss=float(loss))

  def timed_fit(case, data_fn, num_steps, **kw):
    start = time.perf_counter()
    result = pk.fit(NET.apply, params, data_fn(), optimizer=OPTIMIZER,
                    batch_size=bsz, num_steps=num_steps, progress=False,
                    rng=1, **kw)
    jax.block_until_ready(result.params)
    wall = time.perf_counter() - start
    return dict(config, case=case, status="ok", wall_s=wall, steps=num_steps,
                steps_per_s=num_steps / wall,
                steady_steps_per_s=result.steps_per_sec,
                final_loss=float(result.history["loss"][-1]))

  def stream():
    rs = np.random.RandomState(2)
    while True:
      idx = rs.randint(0, _NUM_EXAMPLES, bsz)
      yield {k: v[idx] for k, v in data.items()}

  def rebuilt_fit(case):
    """fit() with nothing shared: a new transform, an optimizer inline."""
    compiles, traced = len(_compile_seconds), programs.stats().get("trace_s", 0.0)
    start = time.perf_counter()
    result = pk.fit(hk.transform(_loss).apply, params, data,
                    optimizer=optax.adam(_REBUILT_LEARNING_RATE),
                    batch_size=bsz, num_steps=_CALLS_STEPS.value,
                    progress=False, rng=1)
    jax.block_until_ready(result.params)
    wall = time.perf_counter() - start
    return dict(config, case=case, status="ok", wall_s=wall,
                steps=_CALLS_STEPS.value,
                steps_per_s=_CALLS_STEPS.value / wall,
                backend_compiles=len(_compile_seconds) - compiles,
                backend_compile_s=sum(_compile_seconds[compiles:]),
                trace_s=programs.stats().get("trace_s", 0.0) - traced,
                final_loss=float(result.history["loss"][-1]))

  # First and second call (in-memory), also rebuilt; then the steady-state
  # rows, in interleaved rounds.
  rebuilt = [rebuilt_fit("fit_rebuilt_first"), rebuilt_fit("fit_rebuilt_second")]
  rebuilt[1].update(
      second_over_first_compile=rebuilt[1]["wall_s"] / rebuilt[0]["backend_compile_s"],
      second_over_first_wall=rebuilt[1]["wall_s"] / rebuilt[0]["wall_s"])
  first = timed_fit("fit_first", lambda: data, _CALLS_STEPS.value)
  second = timed_fit("fit_second", lambda: data, _CALLS_STEPS.value)
  second["second_over_first_wall"] = second["wall_s"] / first["wall_s"]
  if _CALLS_ONLY.value:
    _write_and_print([rows[0], first, second, *rebuilt])
    return
  # Every variant compiles before the timed rounds: the default's multi-step
  # call and its single-step tail, and the one-step rows.
  warm = fit_loop.AUTO_STEPS_PER_CALL + 1  # one automatic call and a tail step
  timed_fit("fit_memory_warmup", lambda: data, warm)
  timed_fit("fit_stream_warmup", stream, warm)
  timed_fit("fit_memory_one_step_warmup", lambda: data, 3, steps_per_call=1)
  timed_fit("fit_stream_one_step_warmup", stream, 3, steps_per_call=1)
  cases = [bare_loop, lambda: timed_fit("fit_memory", lambda: data, steps),
           lambda: timed_fit("fit_stream", stream, steps),
           lambda: timed_fit("fit_memory_one_step", lambda: data, steps,
                             steps_per_call=1),
           lambda: timed_fit("fit_stream_one_step", stream, steps, steps_per_call=1)]
  if _STEPS_PER_CALL.value > 1:
    k = _STEPS_PER_CALL.value
    timed_fit("fit_memory_calls_warmup", lambda: data, 2 * k, steps_per_call=k)
    timed_fit("fit_stream_calls_warmup", stream, 2 * k, steps_per_call=k)
    cases.append(lambda: dict(timed_fit("fit_memory_calls", lambda: data, steps,
                                        steps_per_call=k), steps_per_call=k))
    cases.append(lambda: dict(timed_fit("fit_stream_calls", stream, steps,
                                        steps_per_call=k), steps_per_call=k))
  if _STEPS_PER_CALL.value > 1:
    k = _STEPS_PER_CALL.value
    scan_fn = jax.jit(lambda p, s, r, i, b: jax.lax.scan(
        lambda c, xs: (lambda out: ((out[0], out[1], c[2] + 1), out[2]))(
            _bare_step(c[0], c[1], r, c[2], xs)), (p, s, i), b)[0],
                      donate_argnums=(0, 1))
    stacked = [jax.device_put({key: np.stack(
        [data[key][(j * bsz + i * k * bsz) % _NUM_EXAMPLES:][:bsz]
         for j in range(k)]) for key in data}) for i in range(4)]

    def bare_loop_calls():
      p = jax.tree.map(jnp.copy, params)
      s = OPTIMIZER.init(p)
      calls = steps // k
      p, s, i = scan_fn(p, s, rng, 0, stacked[0])
      jax.block_until_ready(p)
      start = time.perf_counter()
      for c in range(calls):
        p, s, i = scan_fn(p, s, rng, i, stacked[c % len(stacked)])
      jax.block_until_ready((p, s))
      wall = time.perf_counter() - start
      return dict(config, case="bare_loop_calls", status="ok", wall_s=wall,
                  steps_per_s=calls * k / wall, steps_per_call=k)
    cases.append(bare_loop_calls)
  if _PIECES.value:
    cases.extend(_piece_cases(config, params, data, device_batches, steps))
  rounds = []
  for _ in range(_REPEATS.value):
    rounds.append([case() for case in cases])
  steady = []
  for i in range(len(cases)):
    runs = [r[i] for r in rounds]
    ratios = [r[0]["steps_per_s"] / r[i]["steps_per_s"] for r in rounds]
    row = dict(runs[0], steps_per_s=statistics.median(
        x["steps_per_s"] for x in runs), wall_s=statistics.median(
            x["wall_s"] for x in runs), bare_loop_time_ratio=statistics.median(
                ratios), ratio_min=min(ratios), ratio_max=max(ratios))
    if "steady_steps_per_s" in row:
      row["steady_steps_per_s"] = statistics.median(
          x["steady_steps_per_s"] for x in runs)
    steady.append(row)
  bare = steady[0]["steps_per_s"]
  for row in (rows[0], first, second, *rebuilt):
    if "steps_per_s" in row:
      row["bare_loop_time_ratio"] = bare / row["steps_per_s"]
  names = [x["case"] for x in rounds[0]]
  if "bare_loop_calls" in names:  # the *_calls rows over the K-step bare loop
    b = names.index("bare_loop_calls")
    for i, name in enumerate(names):
      if name.endswith("_calls"):
        ratios = [r[b]["steps_per_s"] / r[i]["steps_per_s"] for r in rounds]
        steady[i].update(bare_calls_time_ratio=statistics.median(ratios),
                         bare_calls_ratio_min=min(ratios),
                         bare_calls_ratio_max=max(ratios))
  if "step_bare" in names:  # the step_* rows over step_bare
    b = names.index("step_bare")
    for i, name in enumerate(names):
      if name.startswith("step_"):
        ratios = [r[b]["steps_per_s"] / r[i]["steps_per_s"] for r in rounds]
        steady[i].update(step_bare_time_ratio=statistics.median(ratios),
                         step_ratio_min=min(ratios), step_ratio_max=max(ratios))
  rows = [rows[0], steady[0], first, second, *rebuilt] + steady[1:]
  rows += _trace_rows([(n, c) for n, c in zip(names, cases) if n in (_TRACE.value or ())])
  _write_and_print(rows)


def _write_and_print(rows):
  meta = harness.environment()
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f:
      json.dump({"environment": meta, "rows": rows}, f, indent=1)
  print(harness.format_table(rows, [
      "case", "status", "steps_per_s", "steady_steps_per_s",
      "bare_loop_time_ratio", "ratio_min", "ratio_max",
      "bare_calls_time_ratio", "bare_calls_ratio_min", "bare_calls_ratio_max",
      "step_bare_time_ratio", "step_ratio_min", "step_ratio_max", "wall_s",
      "compile_s", "backend_compiles", "backend_compile_s", "trace_s",
      "second_over_first_compile", "second_over_first_wall"]))


if __name__ == "__main__":
  app.run(main)
