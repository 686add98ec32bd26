#!/usr/bin/env bash
# Session 15, third GPU call: the 3B export with PDL by default (no VOXTRAL_RUNNER_PDL set), then one bundle
# benchmarked with programmatic edges and with plain ones (VOXTRAL_RUNNER_PDL=0 at run time), alternating: what
# PDL alone gives, and whether gpu_call27.sh's 462.9 tok/s repeats on another machine start.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1
unset VOXTRAL_RUNNER_PDL
timeout 300 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $R/3b_export_s15c.log 2>&1
grep -E "compiled|error vs|^error" $R/3b_export_s15c.log | head -20; echo "t=$SECONDS"
[ -f artifacts/3b/model.pte ] || { tail -30 $R/3b_export_s15c.log; exit 1; }
echo "manifest: $(grep -ao '"pdl": *[a-z]*' artifacts/3b/model.pte | head -1)"
for i in 1 2; do
  for p in 1 0; do
    VOXTRAL_RUNNER_PDL=$p timeout 100 python3 -m runner bench --bundle artifacts/3b --runs 5 --warmup 2 --language en \
      --min-new-tokens 128 --max-new-tokens 128 --compare none --json $R/ab_pdl${p}_$i.json > $R/ab_pdl${p}_$i.md 2> $L/ab.err
    echo "PDL=$p run $i: $(grep -E 'e2e: decode' $R/ab_pdl${p}_$i.md)"; echo "t=$SECONDS"
  done
done
for p in 1 0; do
  VOXTRAL_RUNNER_PDL=$p timeout 60 python3 benchmarks/profile_decode.py --no-ceilings artifacts/3b > $R/3b_profile_s15_pdl$p.md 2> $L/profile.err
  echo "PDL=$p: $(grep -E 'replays back to back' $R/3b_profile_s15_pdl$p.md | tr '\n' ' ')"
done; echo "t=$SECONDS"
