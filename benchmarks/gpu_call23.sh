#!/usr/bin/env bash
# Session 14, first GPU call (no export): the attention kernel's L2 prefetch of o_proj on the H200 (kernel tests,
# then the step eager in a CUDA graph with the prefetch off, a third, two thirds, all of it), the attention's
# splits x BLOCK_T with the prefetch on, and every GEMV kind's config tuned inside the step (qkv and lm_head never
# were). The winners go into kernels.py by hand before the export.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py -k "attention or prefetch" \
  > $R/kernel_tests_s14.log 2>&1 || { tail -30 $R/kernel_tests_s14.log; exit 1; }
tail -1 $R/kernel_tests_s14.log; echo "t=$SECONDS"
(cd benchmarks && timeout $((590 - SECONDS)) python3 decode_kernels.py --parts prefetch,tune --fill 450 \
  --out $R/prefetch_tune_s14.json > $R/prefetch_tune_s14.log 2>&1); grep -E "prefetch|in-step|attention" $R/prefetch_tune_s14.log
tail -3 $R/prefetch_tune_s14.log; echo "t=$SECONDS"
