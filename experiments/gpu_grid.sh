#!/usr/bin/env bash
# The measurements still missing from docs/benchmarks, in one device call of
# under ten minutes: each program is time-boxed so a slow one cannot starve
# the next, and each rewrites its JSON after every row.
#   bash experiments/gpu_grid.sh $OUT
out=${1:?usage: gpu_grid.sh OUTPUT_DIR}
export PYTHONUNBUFFERED=1
# fit() against the bare loop on the MLP (one and ten steps per call).
timeout 100 python3 -m experiments.benchmark_fit --model mlp --steps 1000 --repeats 3 \
  --steps_per_call 10 --pieces --output "$out/fit_mlp.json" 2>&1 | grep '^|'
# The selective scan with its S 128 tiling (time, and memory at T 16384).
timeout 100 python3 -m experiments.benchmark_kernel_ssm --ops selective_scan --iters 20 \
  --output "$out/kernel_ssm_selective.json" 2>&1 | grep '^|' | grep -v '| check'
# SSD and the gated delta rule against the chunked XLA tier, timed on the device.
timeout 100 python3 -m experiments.benchmark_kernel_ssd --nocheck --nomodels --shapes 0,1 \
  --iters 20 --output "$out/kernel_ssd.json" 2>&1 | grep '^|'
# The Mamba and Mamba-2 model steps, kernels against XLA.
timeout 110 python3 -m experiments.benchmark_gpu_nn --models ssm_mamba,ssm_mamba2 \
  --ssm_implementation pallas,xla --dtype bfloat16 --tokens 4096 --iters 10 \
  --output "$out/gpu_nn_mamba.json" 2>&1 | grep '^|'
