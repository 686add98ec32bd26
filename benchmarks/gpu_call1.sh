#!/usr/bin/env bash
# GPU call 1: tiny bf16 CUDA bundle end to end (graph and no-graph, eager reference), then the full-size
# voxtral-mini-3b (random init, bf16) export with compile times and sizes, and three runs on 30 s of audio.
set -uo pipefail
. benchmarks/gpu_setup.sh 2>&1 | tee $OUT/env.txt
A=fixtures/audio
FILES="--audio $A/speech.wav --audio $A/speech_48k_stereo.wav --audio $A/long_35s.flac --audio $A/short.wav --audio $A/silence.wav"
python3 -m runner export --preset tiny --device cuda --dtype bf16 --out artifacts/tiny-cuda-bf16 2>&1 | tee $OUT/tiny_export.log
python3 -m runner run --bundle artifacts/tiny-cuda-bf16 $FILES --max-new-tokens 32 --reference eager --json > $OUT/tiny_cuda_graph.jsonl 2> $OUT/tiny_cuda_graph.log
python3 -m runner run --bundle artifacts/tiny-cuda-bf16 $FILES --max-new-tokens 32 --no-cuda-graph --json > $OUT/tiny_cuda_nograph.jsonl 2> $OUT/tiny_cuda_nograph.log
tail -3 $OUT/tiny_cuda_graph.log
/usr/bin/time -v timeout 400 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b 2>&1 | tee $OUT/3b_export.log | grep -v Warning | tail -25
ls -l artifacts/3b | tee $OUT/3b_sizes.txt
S=$A/speech.wav
timeout 150 python3 -m runner run --bundle artifacts/3b --audio $S --audio $S --audio $S --language en \
  --min-new-tokens 128 --max-new-tokens 128 --json > $OUT/3b_graph.jsonl 2> $OUT/3b_graph.log; tail -12 $OUT/3b_graph.log
timeout 100 python3 -m runner run --bundle artifacts/3b --audio $S --audio $S --language en \
  --min-new-tokens 128 --max-new-tokens 128 --no-cuda-graph --json > $OUT/3b_nograph.jsonl 2> $OUT/3b_nograph.log; tail -9 $OUT/3b_nograph.log
tar czf $OUT/cache.tgz .cache/vr/compiled && ls -l $OUT
