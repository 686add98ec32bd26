#!/usr/bin/env bash
# Session 11, GPU call 1: the hand-written decode kernels (runner/export/kernels.py) swept and checked against
# cuBLAS and the eager decoder on the 3B shapes, without an export (benchmarks/decode_kernels.py).
set -uo pipefail
R=$OUT
. benchmarks/gpu_setup.sh
cd benchmarks && timeout 570 python3 decode_kernels.py --out $R/decode_kernels.json > $R/decode_kernels.log 2>&1
echo "rc=$?"; tail -45 $R/decode_kernels.log
