#!/usr/bin/env bash
# Ran on branch s12-fused-attention (decode_step_sweep.py lived there), which never reached main: a record only.
# Session 12, GPU call 4: the final 3B numbers (text_decoder_step with one attention kernel per layer, the prefill
# graph) benchmarked beside our eager model, transformers and transformers + torch.compile in one run (2 warm-ups: a
# prompt shape is captured as a CUDA graph the second time it is seen), then checked against eager if time is left.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1; cat $L/env.txt
# the kernels against torch first (15 s): a kernel that is wrong on this GPU must not cost the export's 5 minutes
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py > $R/kernel_tests_s12c.log 2>&1 \
  || { tail -30 $R/kernel_tests_s12c.log; exit 1; }
tail -1 $R/kernel_tests_s12c.log
/usr/bin/time -v timeout 340 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $L/3b_export.log 2>&1
grep -E "compiled|error vs|Elapsed|^error" $L/3b_export.log; cp $L/3b_export.log $R/3b_export_s12.log
timeout $((585 - SECONDS)) python3 -m runner bench --bundle artifacts/3b --runs 5 --warmup 2 --language en --min-new-tokens 128 \
  --max-new-tokens 128 --compare eager,hf,hf-compile --json $R/bench_3b_s12.json --chart $R/bench_3b_s12.png \
  > $R/bench_3b_s12.md 2> $L/bench_3b_s12.log
tail -3 $L/bench_3b_s12.log; cat $R/bench_3b_s12.md; cp $L/bench_3b_s12.log $R/
S=fixtures/audio/speech.wav
if [ $SECONDS -lt 500 ]; then
  timeout $((590 - SECONDS)) python3 -m runner run --bundle artifacts/3b --audio $S --audio $S --language en \
    --min-new-tokens 128 --max-new-tokens 128 --reference eager --json > $R/3b_s12_e2e.jsonl 2> $R/3b_s12_e2e.log
  grep -E "eager ref|^error|tokens/s|first generated" $R/3b_s12_e2e.log
fi
