#!/usr/bin/env bash
# Session 14, second GPU call (no 3B export): the CUDA runtime tests on the tiny bf16 bundle, with the new greedy
# chain (GREEDY_CHAIN steps per decode-graph replay) against the one-step graph and no graph; then every GEMV
# kind's config and attention's splits x BLOCK_T tuned inside the 3B step (qkv and lm_head never were). The
# attention kernel's L2 prefetch of o_proj was measured in gpu_call23.sh and lost (h200/prefetch_s14.log).
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1
timeout 200 python3 -m pytest -q -x -p no:cacheprovider -rs tests/test_cuda_runtime.py > $R/cuda_tests_s14.log 2>&1 \
  || { tail -40 $R/cuda_tests_s14.log; }
tail -1 $R/cuda_tests_s14.log; echo "t=$SECONDS"
(cd benchmarks && timeout $((590 - SECONDS)) python3 decode_kernels.py --parts tune --fill 450 \
  --out $R/in_step_tuning_s14.json > $R/in_step_tuning_s14.log 2>&1); grep "in-step" $R/in_step_tuning_s14.log
tail -3 $R/in_step_tuning_s14.log; echo "t=$SECONDS"
