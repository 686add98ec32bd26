#!/usr/bin/env bash
# Ran on branch s12-fused-attention (decode_step_sweep.py lived there), which never reached main: a record only.
# Session 12, GPU call 2: the decode step with one attention kernel per layer (rope, the cache write and the
# merge of the splits folded in) by split, eager-in-a-graph and compiled, with layer timelines
# (benchmarks/decode_step_sweep.py); then the kernel tests (the CUDA runtime tests
# through AOTInductor is left to the export self-check of the next call) on the GPU.
set -uo pipefail
R=$OUT
. benchmarks/gpu_setup.sh
(cd benchmarks && timeout 300 python3 decode_step_sweep.py --out $R/step_sweep_s12b.json > $R/step_sweep_s12b.log 2>&1)
echo "rc=$?"; grep -v "^  File\|^    \|Warn\|warn" $R/step_sweep_s12b.log | tail -70
timeout $((560 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -rs tests/test_kernels.py \
  > $R/cuda_tests_s12.log 2>&1
echo "rc=$?"; tail -25 $R/cuda_tests_s12.log
