#!/usr/bin/env bash
# Session 11, GPU call 4 (never got a machine either; meant for the last 485 s of device time): the 3B bundle of
# gpu_call8.sh (same code) beside transformers eager and transformers + static cache + torch.compile in one run.
# No export self-check (gpu_call8.sh ran it on this code) and 3 runs after 2 warm-ups, to fit the time left.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1; cat $L/env.txt
export TRITON_CACHE_DIR=$PWD/artifacts/triton-cache
/usr/bin/time -v timeout 330 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --no-check --out artifacts/3b > $L/3b_export.log 2>&1
grep -E "compiled|Elapsed|^error" $L/3b_export.log; cp $L/3b_export.log $R/3b_export_s11b.log
timeout $((440 - SECONDS)) python3 -m runner bench --bundle artifacts/3b --runs 3 --warmup 2 --language en \
  --min-new-tokens 128 --max-new-tokens 128 --compare hf,hf-compile --json $R/bench_3b_s11b.json \
  --chart $R/bench_3b_s11b.png > $R/bench_3b_s11b.md 2> $L/bench_3b_s11b.log
tail -3 $L/bench_3b_s11b.log; cat $R/bench_3b_s11b.md; cp $L/bench_3b_s11b.log $R/
