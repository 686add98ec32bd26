#!/usr/bin/env bash
# Session 13, GPU call 1: the fused attention step (RoPE + cache write + split merge in one kernel per layer) and
# the link fix (one cubin copy per kernel name, exporter.py `_one_object_per_kernel`). The kernel tests compiled
# in bf16 first (a wrong kernel must not cost the export's 5 minutes), then the 3B export with its self-check, then
# a quick bench without the transformers columns (the same-run comparison is the next call, gpu_call18.sh, on the
# bundle this call leaves in artifacts/3b).
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1; cat $L/env.txt
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py > $R/kernel_tests_s13.log 2>&1 \
  || { tail -40 $R/kernel_tests_s13.log; exit 1; }
tail -1 $R/kernel_tests_s13.log; echo "t=$SECONDS"
/usr/bin/time -v timeout 380 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $L/3b_export.log 2>&1
grep -E "compiled|error vs|Elapsed|^error|multiple definition" $L/3b_export.log | head -20; cp $L/3b_export.log $R/3b_export_s13.log
echo "t=$SECONDS"
[ -f artifacts/3b/model.pte ] || exit 1
timeout $((590 - SECONDS)) python3 -m runner bench --bundle artifacts/3b --runs 5 --warmup 2 --language en \
  --min-new-tokens 128 --max-new-tokens 128 --compare none --json $R/bench_3b_s13a.json > $R/bench_3b_s13a.md \
  2> $L/bench_3b_s13a.log
tail -3 $L/bench_3b_s13a.log; cat $R/bench_3b_s13a.md; echo "t=$SECONDS"
