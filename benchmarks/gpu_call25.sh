#!/usr/bin/env bash
# Session 14: the kernel tests (GEMV and attention now with griddepcontrol: PDL-ready, a no-op when launched
# plainly), the CUDA runtime tests on the tiny bf16 bundle (greedy chains against the one-step graph and no graph;
# the decode kernels' edges made programmatic, tokens unchanged), the 3B export, the same-run comparison (ours:
# greedy chains of GREEDY_CHAIN steps per replay, PDL edges; eager; transformers; transformers + compile), then
# the kernel table with the chain timed with and without PDL. If the kernel or runtime tests fail, PDL is switched
# off (VOXTRAL_RUNNER_PDL=0: plain kernels and graph edges) for the rest.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1
export VOXTRAL_RUNNER_PDL=1 VOXTRAL_RUNNER_GREEDY_CHAIN=8  # both off by default until this run has checked them
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py > $R/kernel_tests_s14.log 2>&1 || {
  tail -30 $R/kernel_tests_s14.log; export VOXTRAL_RUNNER_PDL=0; echo "PDL off for the rest"
  timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py > $R/kernel_tests_s14_nopdl.log 2>&1 \
    || { tail -30 $R/kernel_tests_s14_nopdl.log; exit 1; }; }
tail -1 $R/kernel_tests_s14.log; echo "t=$SECONDS"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_runtime.py > $R/cuda_tests_s14.log 2>&1 \
  || { tail -40 $R/cuda_tests_s14.log; export VOXTRAL_RUNNER_PDL=0; echo "PDL off for the rest"; }
tail -1 $R/cuda_tests_s14.log; echo "t=$SECONDS"
timeout 300 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $R/3b_export_s14.log 2>&1
grep -E "compiled|error vs|^error" $R/3b_export_s14.log | head -20; echo "t=$SECONDS"
[ -f artifacts/3b/model.pte ] || { tail -30 $R/3b_export_s14.log; exit 1; }
timeout $((565 - SECONDS)) python3 -m runner bench --bundle artifacts/3b --runs 5 --warmup 2 --language en --min-new-tokens 128 \
  --max-new-tokens 128 --compare eager,hf,hf-compile --json $R/bench_3b_s14.json --chart $R/bench_3b_s14.png \
  > $R/bench_3b_s14.md 2> $R/bench_3b_s14.log
tail -3 $R/bench_3b_s14.log; cat $R/bench_3b_s14.md; echo "t=$SECONDS"
timeout $((595 - SECONDS)) python3 benchmarks/profile_decode.py --no-ceilings artifacts/3b > $R/3b_profile_s14.md 2> $L/profile.err
grep -E "replays back to back" $R/3b_profile_s14.md; echo "t=$SECONDS"
