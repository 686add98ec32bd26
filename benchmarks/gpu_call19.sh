#!/usr/bin/env bash
# Session 13, GPU call 3: the 3B step failed its export self-check (0.554) once the link was fixed. Counters now
# reset themselves and are addressed by offset (no view). Kernel tests; the tiny CUDA export with its self-check;
# step_debug.py on a DEBUG=1 tiny export (per-step errors, cache slots, the generated C++); then, if the tiny
# self-check passed, the 3B export and a quick bench (gpu_call17.sh's second half).
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py > $R/kernel_tests_s13.log 2>&1 \
  || { tail -40 $R/kernel_tests_s13.log; exit 1; }
tail -1 $R/kernel_tests_s13.log; echo "t=$SECONDS"
timeout 200 python3 -m runner export --preset tiny --random-init --device cuda --dtype bf16 --out artifacts/tiny-cuda \
  > $R/tiny_export_s13.log 2>&1; ok=$?; grep -E "error|bundle" $R/tiny_export_s13.log | head; echo "t=$SECONDS"
DEBUG=1 timeout 200 python3 -m runner export --preset tiny --random-init --device cuda --dtype bf16 --no-check \
  --out artifacts/tiny-dbg > $L/x.log 2>&1 || tail $L/x.log
timeout 120 python3 benchmarks/step_debug.py artifacts/tiny-dbg tiny 2>&1 | grep -v Warning > $R/step_debug_s13.log
head -40 $R/step_debug_s13.log; echo "t=$SECONDS"
[ $ok -eq 0 ] || exit 1
/usr/bin/time -v timeout 330 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $L/3b_export.log 2>&1
grep -E "compiled|error vs|Elapsed|^error" $L/3b_export.log | head -20; cp $L/3b_export.log $R/3b_export_s13.log
echo "t=$SECONDS"; [ -f artifacts/3b/model.pte ] || exit 1
timeout $((590 - SECONDS)) python3 -m runner bench --bundle artifacts/3b --runs 5 --warmup 2 --language en \
  --min-new-tokens 128 --max-new-tokens 128 --compare none --json $R/bench_3b_s13a.json > $R/bench_3b_s13a.md \
  2> $L/bench_3b_s13a.log
tail -3 $L/bench_3b_s13a.log; cat $R/bench_3b_s13a.md; echo "t=$SECONDS"
