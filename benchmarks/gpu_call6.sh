#!/usr/bin/env bash
# Session 10, GPU call 3: the final 3B numbers. Same bundle as call 2 (fused projections, one-call prefill); the
# runtime now stages every host->device copy before the prefill's compute and keeps one decode step queued
# ahead. Exported, benchmarked beside eager, HF and HF + torch.compile in one run, then checked against eager.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1; cat $L/env.txt
/usr/bin/time -v timeout 300 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $L/3b_export.log 2>&1
grep -E "compiled|error vs|Elapsed|^error" $L/3b_export.log
timeout $((560 - SECONDS)) python3 -m runner bench --bundle artifacts/3b --runs 5 --language en --min-new-tokens 128 \
  --max-new-tokens 128 --compare eager,hf,hf-compile --json $R/bench_3b_final.json --chart $R/bench_3b_final.png \
  > $R/bench_3b_final.md 2> $L/bench_3b_final.log
tail -2 $L/bench_3b_final.log; cat $R/bench_3b_final.md
S=fixtures/audio/speech.wav
timeout $((585 - SECONDS)) python3 -m runner run --bundle artifacts/3b --audio $S --audio $S --language en \
  --min-new-tokens 128 --max-new-tokens 128 --reference eager --json > $R/3b_final_e2e.jsonl 2> $R/3b_final_e2e.log
grep -E "eager ref|^error|tokens/s|first generated" $R/3b_final_e2e.log; tar czf $R/logs6.tgz -C $L .
