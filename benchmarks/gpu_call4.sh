#!/usr/bin/env bash
# GPU call 4 (short): after the build_bundle / DecodeGraph refactor, the tiny bf16 CUDA bundle still exports,
# runs with the CUDA-graph decode and matches the eager reference.
set -uo pipefail
. benchmarks/gpu_setup.sh > $OUT/env.txt 2>&1; cat $OUT/env.txt
A=fixtures/audio
timeout 150 python3 -m runner export --preset tiny --device cuda --dtype bf16 --out artifacts/tiny-cuda-bf16 > $OUT/tiny_export.log 2>&1
grep -E "compiled|error" $OUT/tiny_export.log
timeout 40 python3 -m runner run --bundle artifacts/tiny-cuda-bf16 --audio $A/speech.wav --audio $A/silence.wav \
  --max-new-tokens 32 --reference eager --json > $OUT/tiny_cuda_e2e.jsonl 2> $OUT/tiny_cuda_e2e.log
grep -E "eager ref|^error|tokens/s" $OUT/tiny_cuda_e2e.log
