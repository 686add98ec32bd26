#!/usr/bin/env bash
# GPU call 3: the tiny bf16 CUDA bundle with kernel binaries embedded in the .so, run after deleting every
# compile directory (proves the bundle is self-contained), end to end against eager, then benchmarked against
# our eager model and transformers (eager, static cache + torch.compile).
set -uo pipefail
R=$OUT; . benchmarks/gpu_setup.sh > $R/env.txt 2>&1; cat $R/env.txt
A=fixtures/audio
FILES="--audio $A/speech.wav --audio $A/speech_48k_stereo.wav --audio $A/long_35s.flac --audio $A/short.wav --audio $A/silence.wav"
timeout 200 python3 -m runner export --preset tiny --device cuda --dtype bf16 --out artifacts/tiny-cuda-bf16 > $R/tiny_export.log 2>&1
grep -E "compiled|error" $R/tiny_export.log
rm -rf /tmp/torchinductor_* ~/.cache/torch "$VOXTRAL_RUNNER_CACHE/compiled"
timeout 60 python3 -m runner run --bundle artifacts/tiny-cuda-bf16 $FILES --max-new-tokens 32 --reference eager --json > $R/tiny_cuda_e2e.jsonl 2> $R/tiny_cuda_e2e.log
grep -E "eager ref|^error" $R/tiny_cuda_e2e.log
timeout 90 python3 -m runner bench --bundle artifacts/tiny-cuda-bf16 --runs 5 --compare eager,hf,hf-compile \
  --json $R/bench_tiny_cuda.json --chart $R/bench_tiny_cuda.png > $R/bench_tiny_cuda.md 2> $R/bench_tiny_cuda.log
cat $R/bench_tiny_cuda.md; tail -2 $R/bench_tiny_cuda.log
