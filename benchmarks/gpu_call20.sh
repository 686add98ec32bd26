#!/usr/bin/env bash
# Session 13, last GPU call: RoPE's cos/sin as one `rope_table` op per step (the profile of gpu_call19's bundle,
# h200/3b_profile_s13.md, showed Inductor recomputing them in 2 kernels per layer). Kernel tests, the 3B export
# with its self-check, then the same-run comparison (ours, eager, transformers, transformers + compile).
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py > $R/kernel_tests_s13b.log 2>&1 \
  || { tail -30 $R/kernel_tests_s13b.log; exit 1; }
tail -1 $R/kernel_tests_s13b.log; echo "t=$SECONDS"
timeout 300 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $R/3b_export_s13b.log 2>&1
grep -E "compiled|error vs|^error" $R/3b_export_s13b.log | head -20; echo "t=$SECONDS"
[ -f artifacts/3b/model.pte ] || exit 1
timeout $((585 - SECONDS)) python3 -m runner bench --bundle artifacts/3b --runs 5 --warmup 2 --language en --min-new-tokens 128 \
  --max-new-tokens 128 --compare eager,hf,hf-compile --json $R/bench_3b_s13b.json --chart $R/bench_3b_s13b.png \
  > $R/bench_3b_s13b.md 2> $R/bench_3b_s13b.log
tail -2 $R/bench_3b_s13b.log; cat $R/bench_3b_s13b.md; echo "t=$SECONDS"
