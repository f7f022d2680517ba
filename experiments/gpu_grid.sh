#!/usr/bin/env bash
# The measurements still missing from docs/benchmarks, in one device call of
# under ten minutes: each program is time-boxed so a slow one cannot starve
# the next, and each rewrites its JSON after every row.
#   bash experiments/gpu_grid.sh $OUT
out=${1:?usage: gpu_grid.sh OUTPUT_DIR}
export PYTHONUNBUFFERED=1
# The scan kernels against XLA (and their numerics on this device).
timeout 150 python3 -m experiments.benchmark_kernel_ssm --iters 20 \
  --output "$out/kernel_ssm.json" 2>&1 | grep '^|' | grep -v '| check'
# The SSM model grid (bf16) at the three lengths, kernels against XLA.
timeout 240 python3 -m experiments.benchmark_gpu_nn \
  --models ssm_lru,ssm_mamba,ssm_ssd,ssm_mamba2,ssm_gated_delta_net \
  --ssm_implementation pallas,xla --dtype bfloat16 --tokens 1024,4096,16384 --iters 10 \
  --output "$out/gpu_nn_ssm.json" 2>&1 | grep '^|'
# The 1024-token and float32 rows of the Transformer / DiT grid.
timeout 150 python3 -m experiments.benchmark_gpu_nn --tokens 1024 \
  --dtype bfloat16,float32 --iters 10 --output "$out/gpu_nn_1024.json" 2>&1 | grep '^|'
