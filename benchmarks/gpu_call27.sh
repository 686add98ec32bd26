#!/usr/bin/env bash
# Session 15, second GPU call: PDL with the wait as pure inline asm (gpu_call26.sh: the waiting kernels pass the
# kernel tests and torch 2.11's mutation analysis; the eager 3B step 2.480 -> 2.353 ms with programmatic edges) and
# the o_proj, down and lm_head configs tuned in the step with programmatic edges. The kernel tests (the asm string
# changed), the CUDA runtime tests on a tiny bundle exported with VOXTRAL_RUNNER_PDL=1, the 3B export, the
# same-run comparison, then the kernel table if time is left. If the tests fail, PDL is off for the rest.
set -uo pipefail
R=$OUT; L=/tmp/logs; mkdir -p $L
. benchmarks/gpu_setup.sh > $L/env.txt 2>&1
export VOXTRAL_RUNNER_PDL=1  # off by default at export until this run has checked it
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_pdl.py > $R/kernel_tests_s15b.log 2>&1 || {
  tail -30 $R/kernel_tests_s15b.log; export VOXTRAL_RUNNER_PDL=0; echo "PDL off for the rest"
  timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py > $R/kernel_tests_s15_nopdl.log 2>&1 \
    || { tail -30 $R/kernel_tests_s15_nopdl.log; exit 1; }; }
tail -1 $R/kernel_tests_s15b.log; echo "t=$SECONDS"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_runtime.py > $R/cuda_tests_s15b.log 2>&1 \
  || { tail -40 $R/cuda_tests_s15b.log; export VOXTRAL_RUNNER_PDL=0; echo "PDL off for the rest"; }
tail -1 $R/cuda_tests_s15b.log; echo "t=$SECONDS"
timeout 300 python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
  --max-seq-len 1024 --max-audio-chunks 1 --out artifacts/3b > $R/3b_export_s15.log 2>&1
grep -E "compiled|error vs|^error" $R/3b_export_s15.log | head -20; echo "t=$SECONDS"
[ -f artifacts/3b/model.pte ] || { tail -30 $R/3b_export_s15.log; exit 1; }
timeout $((565 - SECONDS)) python3 -m runner bench --bundle artifacts/3b --runs 5 --warmup 2 --language en --min-new-tokens 128 \
  --max-new-tokens 128 --compare eager,hf,hf-compile --json $R/bench_3b_s15.json --chart $R/bench_3b_s15.png \
  > $R/bench_3b_s15.md 2> $R/bench_3b_s15.log
tail -3 $R/bench_3b_s15.log; cat $R/bench_3b_s15.md; echo "t=$SECONDS"
timeout $((595 - SECONDS)) python3 benchmarks/profile_decode.py --no-ceilings artifacts/3b > $R/3b_profile_s15.md 2> $L/profile.err
grep -E "replays back to back" $R/3b_profile_s15.md; echo "t=$SECONDS"
