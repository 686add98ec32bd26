#!/usr/bin/env bash
# Planned for the next session (not run yet): where the last 0.061 ms per token goes (NOTES, "Decode: 2.283 ms per
# token"). The 3B export with DEBUG=1 (the step's generated C++ kept: AOTInductor's launch parameters for the
# attention kernel), the bundle's kernel table, then the attention kernel alone at the bench's positions and the
# step eager in a graph, and the cold-digest load. DEBUG=1 also compiles the host wrapper without optimisation:
# graph replays are unaffected, but take the final figures from a plain export.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1
DEBUG=1 timeout 300 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $R/3b_export_s14.log 2>&1
grep -E "compiled|error vs|^error" $R/3b_export_s14.log | head -12; echo "t=$SECONDS"
[ -f artifacts/3b/model.pte ] || exit 1
grep -h -A3 "_attention_kernel.*triton_meta\|num_stages" artifacts/3b/debug/text_decoder_step/*.cpp | head -20 > $R/step_attention_meta_s14.txt
timeout 120 python3 benchmarks/profile_decode.py artifacts/3b > $R/3b_profile_s14.md 2> $L/profile.err
sed -n '/decode step, graph replay/,/^## decode step, direct/p' $R/3b_profile_s14.md; echo "t=$SECONDS"
(cd benchmarks && timeout 200 python3 decode_kernels.py --parts attention,step --attention-fills 385,450,512 \
  --fill 450 --out $R/attention_s14.json > $R/attention_s14.log 2>&1); tail -8 $R/attention_s14.log; echo "t=$SECONDS"
VOXTRAL_RUNNER_REHASH=1 timeout 120 python3 -m runner bench --bundle artifacts/3b --compare none --runs 1 --warmup 0 \
  --language en > $R/bench_3b_s14_rehash.md 2>&1; grep -E "load" $R/bench_3b_s14_rehash.md
