#!/usr/bin/env bash
# GPU call 1: tiny bf16 CUDA bundle end to end (graph and no-graph, eager reference), then the full-size
# voxtral-mini-3b (random init, bf16) export with compile times and sizes, and runs on 30 s of audio.
# Results: $OUT/results1.tgz; the compiled .so files: $OUT/cache.tgz (carried into call 2 to skip compiling).
set -uo pipefail
R=/tmp/res; mkdir -p $R
. benchmarks/gpu_setup.sh > $R/env.txt 2>&1; cat $R/env.txt  # sourced, not piped: a pipe would run it in a subshell and lose CXX
A=fixtures/audio
FILES="--audio $A/speech.wav --audio $A/speech_48k_stereo.wav --audio $A/long_35s.flac --audio $A/short.wav --audio $A/silence.wav"
timeout 240 python3 -m runner export --preset tiny --device cuda --dtype bf16 --out artifacts/tiny-cuda-bf16 > $R/tiny_export.log 2>&1 \
  || { tail -30 $R/tiny_export.log; tar czf $OUT/results1.tgz -C $R .; exit 1; }
grep -E "compiled|error vs" $R/tiny_export.log
timeout 60 python3 -m runner run --bundle artifacts/tiny-cuda-bf16 $FILES --max-new-tokens 32 --reference eager --json > $R/tiny_cuda_graph.jsonl 2> $R/tiny_cuda_graph.log
timeout 60 python3 -m runner run --bundle artifacts/tiny-cuda-bf16 $FILES --max-new-tokens 32 --no-cuda-graph --json > $R/tiny_cuda_nograph.jsonl 2> $R/tiny_cuda_nograph.log
grep -E "eager ref|error" $R/tiny_cuda_graph.log | head -5; tail -4 $R/tiny_cuda_graph.log
/usr/bin/time -v timeout 330 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $R/3b_export.log 2>&1
grep -E "compiled|error vs|Elapsed|Maximum resident|^error" $R/3b_export.log
ls -l artifacts/3b | tee $R/3b_sizes.txt
tar czf $OUT/cache.tgz "$VOXTRAL_RUNNER_CACHE/compiled"
S=$A/speech.wav
timeout 120 python3 -m runner run --bundle artifacts/3b --audio $S --audio $S --audio $S --language en \
  --min-new-tokens 128 --max-new-tokens 128 --reference eager --json > $R/3b_graph.jsonl 2> $R/3b_graph.log; grep -E "eager ref|error" $R/3b_graph.log; tail -10 $R/3b_graph.log
timeout 60 python3 -m runner run --bundle artifacts/3b --audio $S --audio $S --language en \
  --min-new-tokens 128 --max-new-tokens 128 --no-cuda-graph --json > $R/3b_nograph.jsonl 2> $R/3b_nograph.log; tail -9 $R/3b_nograph.log
tar czf $OUT/results1.tgz -C $R .
