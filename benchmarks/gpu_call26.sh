#!/usr/bin/env bash
# Session 15, first GPU call (no 3B export): PDL with the wait as pure inline asm (kernels.py `_after_predecessor`).
# 1. the kernel tests with the wait compiled in; the mutation analysis of torch 2.11 on the waiting kernels
#    (tests/test_pdl.py: they must write what the plain ones write); the CUDA runtime tests on a tiny bundle
#    exported with VOXTRAL_RUNNER_PDL=1 (programmatic edges found, tokens unchanged);
# 2. the 3B step (eager kernels, one CUDA graph) with plain and with programmatic edges, then every GEMV kind's
#    config and attention's splits tuned inside the step with programmatic edges.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1
export VOXTRAL_RUNNER_PDL=1
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_pdl.py > $R/kernel_tests_s15.log 2>&1 \
  || tail -30 $R/kernel_tests_s15.log
tail -1 $R/kernel_tests_s15.log; echo "t=$SECONDS"
timeout 220 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_runtime.py > $R/cuda_tests_s15.log 2>&1 \
  || tail -40 $R/cuda_tests_s15.log
tail -1 $R/cuda_tests_s15.log; echo "t=$SECONDS"
(cd benchmarks && timeout $((590 - SECONDS)) python3 decode_kernels.py --parts tune --fill 450 \
  --out $R/in_step_tuning_s15.json > $R/in_step_tuning_s15.log 2>&1); grep "in-step" $R/in_step_tuning_s15.log
tail -3 $R/in_step_tuning_s15.log; echo "t=$SECONDS"
