#!/usr/bin/env bash
# Ran on branch s12-fused-attention (decode_step_sweep.py lived there), which never reached main: a record only.
# Session 12, GPU call 3: the step with rope's cos/sin computed inside the attention kernel (the compiled step of
# gpu_call13 recomputed them in two Inductor kernels per layer) and the tuned GEMV configs, eager and compiled.
set -uo pipefail
R=$OUT
. benchmarks/gpu_setup.sh
(cd benchmarks && timeout 240 python3 decode_step_sweep.py --out $R/step_sweep_s12c.json > $R/step_sweep_s12c.log 2>&1)
echo "rc=$?"; grep -v "^  File\|^    \|Warn\|warn\|^ \"\|^  [0-9]\|^ \]" $R/step_sweep_s12c.log | tail -50
