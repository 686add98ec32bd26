#!/usr/bin/env bash
# Session 10, GPU call 2b: the 3B bundle of call 2a (artifacts/3b, still on the warm machine) benchmarked beside our
# eager model, transformers eager and transformers static cache + torch.compile, in one run (issue 6's config).
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1; cat $L/env.txt
test -f artifacts/3b/model.pte || { echo "no bundle: run gpu_call5.sh first"; exit 1; }
timeout 560 python3 -m runner bench --bundle artifacts/3b --runs 5 --language en --min-new-tokens 128 --max-new-tokens 128 \
  --compare eager,hf,hf-compile --json $R/bench_3b_compare.json --chart $R/bench_3b_compare.png \
  > $R/bench_3b_compare.md 2> $R/bench_3b_compare.log
tail -3 $R/bench_3b_compare.log; cat $R/bench_3b_compare.md
