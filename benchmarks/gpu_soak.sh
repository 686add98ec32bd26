#!/usr/bin/env bash
# GPU call for the soak on CUDA (TO RUN: written, not yet run; the session's device time ran out). Carry the four
# wheels in .whl/ (gpu_setup.sh). Exports the tiny model for CUDA bf16 with room for 4 chunks, then runs the soak
# tests on it: the short one and the 1000-run one (every result equal to its single-run process's; RSS, fds,
# mapped libraries, threads and GPU memory allocated/reserved flat after warm-up; the slopes are printed).
set -uo pipefail
R=$OUT; . benchmarks/gpu_setup.sh > $R/env.txt 2>&1; cat $R/env.txt
timeout 300 python3 -m runner export --preset tiny --device cuda --dtype bf16 --max-audio-chunks 4 --max-seq-len 1600 \
  --out artifacts/tiny-cuda-4chunks > $R/export.log 2>&1
grep -E "compiled|cached|error" $R/export.log
VOXTRAL_SOAK_BUNDLE=artifacts/tiny-cuda-4chunks timeout 280 python3 -m pytest tests/test_soak.py -p no:cacheprovider \
  -m "slow or not slow" -k "soak_short or soak_1000" -s -q > $R/soak.log 2>&1
echo "exit $?"; grep -E "runs|slope|passed|failed|Error" $R/soak.log
