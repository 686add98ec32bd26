#!/usr/bin/env bash
# Session 10, GPU call 1: voxtral-mini-3b (random init, bf16) exported, profiled (where a decode step's time goes,
# GEMV ceilings fused vs separate) and benchmarked beside our eager model (issue 5). Carries the first half of
# the Whisper package wheel for the next call (benchmarks/README-whisper.md).
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1; cat $L/env.txt
/usr/bin/time -v timeout 330 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $L/3b_export.log 2>&1
grep -E "compiled|error vs|Elapsed|Maximum resident|^error" $L/3b_export.log
tar czf $R/cache.tgz "$VOXTRAL_RUNNER_CACHE/compiled"
timeout 120 python3 benchmarks/profile_decode.py artifacts/3b > $R/3b_profile.md 2> $L/3b_profile.log; tail -3 $L/3b_profile.log
timeout 170 python3 -m runner bench --bundle artifacts/3b --runs 5 --language en --min-new-tokens 128 --max-new-tokens 128 \
  --compare eager --json $R/bench_3b.json --chart $R/bench_3b.png > $R/bench_3b.md 2> $L/bench_3b.log
tail -3 $L/bench_3b.log; tar czf $R/logs.tgz -C $L .
cat $R/bench_3b.md; grep -E "^## |^\| (separate|fused)" $R/3b_profile.md
