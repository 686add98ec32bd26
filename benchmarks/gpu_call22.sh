#!/usr/bin/env bash
# Planned for the next session (not run yet): each GEMV kind's config tuned inside the whole 3B step (eager, one
# CUDA graph; no export needed, about 5 minutes). qkv and lm_head were never tuned in the step. Winners go into
# runner/export/kernels.py GEMV_CONFIGS by hand, then a re-export and the same-run comparison (gpu_call20.sh).
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1
(cd benchmarks && timeout 540 python3 decode_kernels.py --parts tune --fill 450 --out $R/in_step_tuning_s14.json \
  > $R/in_step_tuning_s14.log 2>&1); grep "in-step" $R/in_step_tuning_s14.log
