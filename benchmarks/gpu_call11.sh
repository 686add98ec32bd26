#!/usr/bin/env bash
# Session 11, GPU call 5 (the device time left after the refusals): the CUDA tests written after gpu_call8.sh,
# on the tiny bf16 CUDA bundle (prefill graph capture, replay with new inputs, LRU; the compiled step) and the
# Triton kernels compiled on the GPU against torch.
set -uo pipefail
R=$OUT
. benchmarks/gpu_setup.sh
timeout 280 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_runtime.py tests/test_kernels.py \
  > $R/cuda_tests.log 2>&1
echo "rc=$?"; tail -40 $R/cuda_tests.log
