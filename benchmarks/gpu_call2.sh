#!/usr/bin/env bash
# GPU call 2: the compiled .so files of call 1 are carried in (.gpucache/cache.tgz), so both exports hit the
# compile cache. Checks the decode-graph fix on the tiny bf16 bundle, then benchmarks the 3B bundle against
# our eager model and transformers (eager, and static cache + torch.compile), and the tiny CUDA bundle.
set -uo pipefail
R=/tmp/res; mkdir -p $R
. benchmarks/gpu_setup.sh > $R/env.txt 2>&1; cat $R/env.txt
tar xzf .gpucache/cache.tgz
A=fixtures/audio; S=$A/speech.wav
FILES="--audio $S --audio $A/speech_48k_stereo.wav --audio $A/long_35s.flac --audio $A/short.wav --audio $A/silence.wav"
timeout 70 bash -c "python3 -m runner export --preset tiny --device cuda --dtype bf16 --out artifacts/tiny-cuda-bf16 > $R/tiny_export.log 2>&1 &&
  python3 -m runner run --bundle artifacts/tiny-cuda-bf16 $FILES --max-new-tokens 32 --reference eager --json > $R/tiny_cuda_graph.jsonl 2> $R/tiny_cuda_graph.log"
grep -E "cached|eager ref|^error" $R/tiny_export.log $R/tiny_cuda_graph.log
timeout 150 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $R/3b_export.log 2>&1; grep -E "cached|compiled|error" $R/3b_export.log
B="--bundle artifacts/3b --runs 3 --warmup 1 --min-new-tokens 128 --max-new-tokens 128"
timeout 150 python3 -m runner bench $B --compare eager,hf --json $OUT/bench_3b.json --chart $OUT/bench_3b.png > $R/bench_3b.md 2> $R/bench_3b.log
cat $R/bench_3b.md; tail -3 $R/bench_3b.log
timeout 40 python3 -m runner bench --bundle artifacts/tiny-cuda-bf16 --runs 5 --json $OUT/bench_tiny_cuda.json --chart $OUT/bench_tiny_cuda.png > $R/bench_tiny.md 2> $R/bench_tiny.log; cat $R/bench_tiny.md
timeout 110 python3 -m runner bench $B --compare hf-compile --json $OUT/bench_3b_hfcompile.json > $R/bench_3b_hfc.md 2> $R/bench_3b_hfc.log
cat $R/bench_3b_hfc.md; tail -3 $R/bench_3b_hfc.log
tar czf $OUT/results2.tgz -C $R .
