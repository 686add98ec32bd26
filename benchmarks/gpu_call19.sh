#!/usr/bin/env bash
# Session 13, GPU call: the 3B step failed its export self-check (0.554) after the link fix. The tiny CUDA export
# with its self-check and DEBUG=1, then step_debug.py on it: per-step errors, the cache slots, the generated C++.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1
DEBUG=1 timeout 200 python3 -m runner export --preset tiny --random-init --device cuda --dtype bf16 --out artifacts/tiny-cuda \
  > $R/tiny_export_s13.log 2>&1; grep -E "compiled|error|bundle" $R/tiny_export_s13.log | head
DEBUG=1 timeout 200 python3 -m runner export --preset tiny --random-init --device cuda --dtype bf16 --no-check \
  --out artifacts/tiny-dbg > $L/x.log 2>&1 || tail $L/x.log
timeout 120 python3 benchmarks/step_debug.py artifacts/tiny-dbg tiny 2>&1 | grep -v Warning | tee $R/step_debug_s13.log
cp artifacts/tiny-dbg/debug/text_decoder_step/*.cpp $R/ 2>/dev/null; ls $R
