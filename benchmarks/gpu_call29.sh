#!/usr/bin/env bash
# Session 15, fourth GPU call: the CUDA runtime tests after the token streams were merged into one
# (`MultimodalRunner._token_stream`), with PDL on by default (no VOXTRAL_RUNNER_PDL set).
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1
unset VOXTRAL_RUNNER_PDL
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_runtime.py tests/test_pdl.py > $R/cuda_tests_s15d.log 2>&1 \
  || tail -40 $R/cuda_tests_s15d.log
tail -1 $R/cuda_tests_s15d.log; echo "t=$SECONDS"
