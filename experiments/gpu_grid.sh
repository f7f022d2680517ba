#!/usr/bin/env bash
# The measurements still missing from docs/benchmarks, in one device call of
# under ten minutes: each program is time-boxed so a slow one cannot starve
# the next, and each rewrites its JSON after every row.
#   bash experiments/gpu_grid.sh $OUT
out=${1:?usage: gpu_grid.sh OUTPUT_DIR}
export PYTHONUNBUFFERED=1
# fit() with several steps per call, on the MLP whose step is host-bound.
timeout 60 python3 -m experiments.benchmark_fit --model mlp --repeats 3 \
  --steps_per_call 10 --output "$out/fit_mlp.json" 2>&1 | grep '^|'
# The 1024-token and float32 rows of the Transformer / DiT grid.
timeout 200 python3 -m experiments.benchmark_gpu_nn --tokens 1024 \
  --dtype bfloat16,float32 --iters 10 --output "$out/gpu_nn_1024.json" 2>&1 | grep '^|'
# The SSM model grid at the other lengths (bf16), kernels against XLA.
timeout 200 python3 -m experiments.benchmark_gpu_nn \
  --models ssm_lru,ssm_mamba,ssm_ssd,ssm_mamba2,ssm_gated_delta_net \
  --ssm_implementation pallas,xla --dtype bfloat16 --tokens 1024,16384 --iters 10 \
  --output "$out/gpu_nn_ssm_lengths.json" 2>&1 | grep '^|'
# Block-size variants of the scan kernels.
timeout 100 python3 -m experiments.benchmark_kernel_ssm --sweep --nomemory --iters 10 \
  --output "$out/kernel_ssm_sweep.json" 2>&1 | grep '^|' | tail -30
