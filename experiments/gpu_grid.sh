#!/usr/bin/env bash
# One device call for the model-level grids; each program is time-boxed so a
# slow one cannot starve the next, and each writes its JSON row by row.
#   bash experiments/gpu_grid.sh $OUT
out=${1:?usage: gpu_grid.sh OUTPUT_DIR}
export PYTHONUNBUFFERED=1
timeout 130 python3 -m experiments.benchmark_gpu_nn --dtype bfloat16 --tokens 4096 \
  --attention default,cudnn,xla --output "$out/gpu_nn.json" 2>&1 | grep -v '^I1'
timeout 180 python3 -m experiments.benchmark_kernel_nn --device gpu --iters 10 \
  --output "$out/kernel_nn_gpu.json" 2>&1 | grep -v '^{'
