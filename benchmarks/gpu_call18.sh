#!/usr/bin/env bash
# Session 13, GPU call 2 (right after gpu_call17.sh, on the warm machine and the bundle it left in artifacts/3b):
# the same-run comparison the issue asks for: our bundle beside our eager model, transformers eager and
# transformers static cache + torch.compile, in one `runner bench` process; then the 3B e2e against eager.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1; cat $L/env.txt
[ -f artifacts/3b/model.pte ] || { echo "no bundle: run gpu_call17.sh first"; exit 1; }
timeout 480 python3 -m runner bench --bundle artifacts/3b --runs 5 --warmup 2 --language en --min-new-tokens 128 \
  --max-new-tokens 128 --compare eager,hf,hf-compile --json $R/bench_3b_s13.json --chart $R/bench_3b_s13.png \
  > $R/bench_3b_s13.md 2> $L/bench_3b_s13.log
tail -3 $L/bench_3b_s13.log; cat $R/bench_3b_s13.md; cp $L/bench_3b_s13.log $R/; echo "t=$SECONDS"
S=fixtures/audio/speech.wav
if [ $SECONDS -lt 520 ]; then
  timeout $((590 - SECONDS)) python3 -m runner run --bundle artifacts/3b --audio $S --audio $S --language en \
    --min-new-tokens 128 --max-new-tokens 128 --reference eager --json > $R/3b_s13_e2e.jsonl 2> $R/3b_s13_e2e.log
  grep -E "eager ref|^error|tokens/s|first generated" $R/3b_s13_e2e.log
fi
