#!/usr/bin/env bash
# Session 11, GPU call 2: the decode kernels inside the bundle (text_decoder_step, sharing text_decoder's weights
# and KV cache) and the prefill as one CUDA graph. The tiny CUDA bundle first (the AOTI + Triton path, checked
# against eager over three files: eager prefill, capture, replay), then the 3B bundle exported and benchmarked.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1; cat $L/env.txt
S=fixtures/audio/speech.wav
timeout 200 python3 -m runner export --preset tiny --device cuda --dtype bf16 --out artifacts/tiny-cuda \
  > $L/tiny_export.log 2>&1 || { tail -60 $L/tiny_export.log; cp $L/*.log $R/; exit 1; }
grep -E "compiled|error vs" $L/tiny_export.log
timeout 120 python3 -m runner run --bundle artifacts/tiny-cuda --audio $S --audio $S --audio $S --language en \
  --reference eager --json > $R/tiny_e2e.jsonl 2> $R/tiny_e2e.log
grep -E "eager ref|^error|tokens/s|first gen|Traceback" $R/tiny_e2e.log
/usr/bin/time -v timeout 360 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $L/3b_export.log 2>&1
grep -E "compiled|error vs|Elapsed|^error|Maximum resident" $L/3b_export.log; cp $L/3b_export.log $R/
timeout $((570 - SECONDS)) python3 -m runner bench --bundle artifacts/3b --runs 5 --language en --min-new-tokens 128 \
  --max-new-tokens 128 --compare none --json $R/bench_3b_s11a.json --chart $R/bench_3b_s11a.png \
  > $R/bench_3b_s11a.md 2> $L/bench.log
tail -5 $L/bench.log; cat $R/bench_3b_s11a.md; cp $L/*.log $R/
