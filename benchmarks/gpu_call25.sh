#!/usr/bin/env bash
# Session 14: the CUDA runtime tests on the tiny bf16 bundle (the greedy chain against the one-step graph and no
# graph), the 3B export (with the in-step tuning's winners where gpu_call24.sh ran first), then the same-run
# comparison (ours with greedy chains of GREEDY_CHAIN steps per graph replay, eager, transformers, transformers +
# compile), then the bundle's kernel table.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1
timeout 200 python3 -m pytest -q -x -p no:cacheprovider -rs tests/test_cuda_runtime.py > $R/cuda_tests_s14.log 2>&1 \
  || { tail -40 $R/cuda_tests_s14.log; exit 1; }
tail -1 $R/cuda_tests_s14.log; echo "t=$SECONDS"
timeout 300 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $R/3b_export_s14.log 2>&1
grep -E "compiled|error vs|^error" $R/3b_export_s14.log | head -20; echo "t=$SECONDS"
[ -f artifacts/3b/model.pte ] || { tail -30 $R/3b_export_s14.log; exit 1; }
timeout $((560 - SECONDS)) python3 -m runner bench --bundle artifacts/3b --runs 5 --warmup 2 --language en --min-new-tokens 128 \
  --max-new-tokens 128 --compare eager,hf,hf-compile --json $R/bench_3b_s14.json --chart $R/bench_3b_s14.png \
  > $R/bench_3b_s14.md 2> $R/bench_3b_s14.log
tail -2 $R/bench_3b_s14.log; cat $R/bench_3b_s14.md; echo "t=$SECONDS"
timeout $((590 - SECONDS)) python3 benchmarks/profile_decode.py --no-ceilings artifacts/3b > $R/3b_profile_s14.md 2> $L/profile.err
sed -n '/graph replays back to back/,/^## decode step, direct/p' $R/3b_profile_s14.md | head -12; echo "t=$SECONDS"
