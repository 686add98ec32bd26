#!/usr/bin/env bash
# Ran on branch s12-fused-attention (decode_step_sweep.py lived there), which never reached main: a record only.
# Session 12, GPU call 1: the decode step with rope and the cache write folded into attention, by L2-prefetch
# plan and attention split, eager-in-a-graph and compiled, with per-slot layer timelines
# (benchmarks/decode_step_sweep.py); then the kernel tests compiled on the GPU.
set -uo pipefail
R=$OUT
. benchmarks/gpu_setup.sh
(cd benchmarks && timeout 420 python3 decode_step_sweep.py --out $R/step_sweep_s12.json > $R/step_sweep_s12.log 2>&1)
echo "rc=$?"; grep -v "^  File\|^    " $R/step_sweep_s12.log | tail -120
timeout $((540 - SECONDS)) python3 -m pytest -q -p no:cacheprovider -rs tests/test_kernels.py > $R/kernel_tests_s12.log 2>&1
echo "rc=$?"; tail -15 $R/kernel_tests_s12.log
