#!/usr/bin/env bash
# Session 10, GPU call 2a: the 3B bundle with fused qkv/gate_up projections and the one-call prefill, exported and
# profiled. Call 2b (gpu_call5b.sh, the next call on the same warm machine) benchmarks it beside eager, HF and
# HF + torch.compile.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1; cat $L/env.txt
/usr/bin/time -v timeout 330 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $L/3b_export.log 2>&1
grep -E "compiled|error vs|Elapsed|Maximum resident|^error" $L/3b_export.log; ls -l artifacts/3b > $L/3b_sizes.txt
timeout 100 python3 benchmarks/profile_decode.py artifacts/3b --no-ceilings > $R/3b_profile_fused.md 2> $L/3b_profile.log
tail -3 $L/3b_profile.log; tar czf $R/logs5.tgz -C $L .
grep -E "^## " $R/3b_profile_fused.md
