"""`python -m runner stream`: a Voxtral Realtime bundle over audio as it arrives.

`--audio FILE` feeds the file in blocks (as fast as possible, or at wall-clock speed with `--realtime`);
`--audio -` reads raw 16 kHz mono PCM from stdin (s16le unless `--pcm f32le`). The streams are the library's
(runner/app/streams.py: Model.stream_many): several `--audio` files are concurrent streams, fed in lockstep, one
block each at a time, and stepped together in one batched call of each method (stream i in the bundle's state row
i; more files than its `max_streams` slots wait for a free one). The
end of a stream is flushed (right padding, as for a whole file), so its tokens equal a whole-file run's alone.
One stream's text is printed as each token is decided, several streams' each as its stream ends. The JSON record
(`--json`) gives each token's start and end (`token_times`) and the `segments` with their `words`, in seconds from
the start of the stream: the audio each token was decided on, less the model's delay. Stats (stderr, or
the JSON record's `stats`): per-step latency p50/p99, how long after its audio arrived each token was decided, the
model's own delay, and the real-time factor. On CUDA the step is replayed from CUDA graphs (`--no-cuda-graph`:
method by method).

The checks the e2e job relies on: `--expect-tokens GOLDEN` (every token equal to the golden file's, for this
model on this device and dtype; a file with none for them is an error, as the check cannot run), `--check-whole` (each stream's tokens equal its file run alone, in one piece) and
`--reference eager` (equal to the eager model's on the bundle's weights). Any failure: one `error:` line per
failure and exit 1, after every file's record. A source that cannot be read (a bad file; on stdin, samples that are
NaN, Inf or, with `--pcm f32le`, far past full scale) ends its own stream, whose record is its error: the other
streams go on.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from runner.app.options import add_runtime_flags
from runner.app.run_args import number, whole

BLOCK_MS = 80  # one text position of audio per read: what a live source would deliver
MAX_BLOCK_MS = 60_000  # a minute per read, far beyond what a live source delivers at once
MAX_BENCH_SECONDS = 600.0  # each timed run's audio (synthesised whole, in memory): ten minutes
# Float PCM is within ±1, clipped or boosted audio a little past it. s16 bytes read as f32le are NaN or far past
# 1e4 within the first negative sample, so anything beyond this is not float audio.
F32_PEAK = 64.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", type=Path, required=True, help="a voxtral-realtime bundle directory")
    p.add_argument(
        "--audio", action="append", default=None, help="audio file (repeatable), or - for raw 16 kHz mono PCM on stdin"
    )
    p.add_argument("--pcm", choices=("s16le", "f32le"), default="s16le", help="sample format of --audio -")
    p.add_argument("--realtime", action="store_true", help="feed a file at wall-clock speed (default: at once)")
    p.add_argument(
        "--block-ms", type=whole(1, MAX_BLOCK_MS), default=BLOCK_MS, help="milliseconds of audio per block fed"
    )
    p.add_argument(
        "--reference", choices=("eager",), default=None, help="also run the eager model on the bundle's weights"
    )
    p.add_argument("--expect-tokens", type=Path, default=None, help="golden tokens JSON: fail on any difference")
    p.add_argument(
        "--check-whole", action="store_true", help="fail unless each stream's tokens equal its file run alone, at once"
    )
    p.add_argument("--json", action="store_true", help="one JSON record per audio on stdout (text goes to stderr)")
    add_runtime_flags(p, encoder=False)
    g = p.add_argument_group("benchmark (runner/app/stream_bench.py; synthetic audio, no --audio)")
    g.add_argument("--bench", action="store_true", help="time the bundle's streaming instead of transcribing")
    seconds = number(0.0, MAX_BENCH_SECONDS)
    g.add_argument("--bench-seconds", type=seconds, default=20.0, help="audio of the batch-1 step timing")
    g.add_argument("--bench-batches", default=None, help="batch sizes, a comma list (default 1, 2, 4 .. max_streams)")
    g.add_argument(
        "--bench-steps", type=whole(1, 100_000), default=50, help="steps timed per batch size (and per half)"
    )
    g.add_argument("--latency-seconds", type=seconds, default=10.0, help="audio fed in real time per latency run")
    g.add_argument(
        "--long-minutes", type=number(0.0, 24 * 60.0), default=12.0, help="the long stream's audio (memory growth)"
    )
    g.add_argument(
        "--long-limit-s", type=number(0.0, 24 * 3600.0), default=300.0, help="wall-clock cap of the long stream"
    )
    g.add_argument("--bench-json", type=Path, default=None, help="write the benchmark's results here (JSON)")


def _blocks(args, source: str, block: int):
    """Float32 sample blocks of the source; a file is paced to wall-clock time with --realtime."""
    from runner.audio import SAMPLE_RATE, load_audio

    if source == "-":
        yield from _stdin_blocks(sys.stdin.buffer, args.pcm, block)
        return
    samples = load_audio(source)
    t0 = time.perf_counter()
    for i in range(0, len(samples), block):
        if args.realtime:
            time.sleep(max(0.0, t0 + i / SAMPLE_RATE - time.perf_counter()))
        yield samples[i : i + block]


def _stdin_blocks(stdin, pcm: str, block: int):
    """A WAV stream's samples when stdin starts with a RIFF/WAVE header (its rate and channels converted as a
    file's are); raw 16 kHz mono PCM in the --pcm format otherwise."""
    from runner.audio import is_wav_header, wav_stream_blocks

    head = stdin.read(12)
    if is_wav_header(head):
        yield from _checked(wav_stream_blocks(stdin.read, block), None)
    else:
        yield from _checked(_raw_blocks(stdin, head, pcm, block), pcm)


def _raw_blocks(stdin, head: bytes, pcm: str, block: int):
    import numpy as np

    width, dtype = (2, "<i2") if pcm == "s16le" else (4, "<f4")
    data = head  # the peeked bytes are the stream's first samples
    while True:
        more = stdin.read(block * width - len(data))
        data += more
        cut = len(data) - len(data) % width  # a sample split across reads waits for its other bytes
        if cut:
            x = np.frombuffer(data[:cut], dtype=dtype).astype(np.float32)
            yield x * np.float32(1 / 32768.0) if width == 2 else x  # f32 as it came: _checked refuses non-audio
        data = data[cut:]
        if not more:
            return


def _checked(blocks, pcm: str | None):
    """The blocks, refused at the first sample no audio has: NaN or Inf (the model would take it as silence and
    stream zero tokens), and with raw --pcm f32le a magnitude far past full scale (16-bit samples read as float)."""
    import numpy as np

    from runner.errors import AudioError

    seen = 0
    for x in blocks:
        bad = ~np.isfinite(x)
        if pcm == "f32le":
            with np.errstate(invalid="ignore"):
                bad |= np.abs(x) > F32_PEAK
        if bad.any():
            i = int(np.argmax(bad))
            raise AudioError(_not_audio(pcm, seen + i, float(x[i])))
        seen += len(x)
        yield x


def _not_audio(pcm: str | None, index: int, value: float) -> str:
    if pcm is None:
        return f"stdin: the WAV stream has a NaN or Inf sample (sample {index})"
    what = f"a NaN or Inf sample (sample {index})" if not math.isfinite(value) else f"sample {index} is {value:g}"
    return (
        f"stdin: {what}: the data does not look like f32le PCM (float samples within about ±1); for 16-bit "
        "samples pass --pcm s16le"
    )


def first_difference(want: list[int], got: list[int]) -> int | None:
    """The first index where the token lists differ (a shorter list differs where it ends), or None."""
    i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    return None if i == len(want) == len(got) else i


def main(args: argparse.Namespace) -> int:
    from runner.app.api import Model
    from runner.app.golden import read_golden
    from runner.app.transcriber import load_program
    from runner.errors import RunnerError

    if args.bench:
        if args.audio:
            raise RunnerError("--bench streams synthetic audio: give no --audio")
        return _bench(args)
    _check_sources(args)
    program, load = load_program(args.bundle, args.runtime)  # as the library's Model loads it
    try:
        family = streaming_family(args.bundle, program.manifest.model)
        golden = read_golden(args.expect_tokens, program.manifest) if args.expect_tokens is not None else None
    except BaseException:
        program.close()
        raise
    with Model.of_program(program, load, args.runtime, family) as model:
        records = _stream_sources(args, model)
        failures = [r["error"] for r in records if "error" in r]  # each bad source's, beside the others' records
        failures += check_streams(args, model, program, family.spec, records, golden)
    _print_records(records, args.json)
    if failures:
        for f in failures[:-1]:
            print(f"error: {f}", file=sys.stderr)
        raise RunnerError(failures[-1])
    return 0


def _check_sources(args: argparse.Namespace) -> None:
    from runner.errors import RunnerError

    if not args.audio:
        raise RunnerError("--audio FILE (or -) is required, unless --bench")
    if "-" in args.audio and len(args.audio) > 1:
        raise RunnerError("--audio -: stdin is one stream; give it alone")
    if "-" in args.audio and (args.check_whole or args.reference):
        raise RunnerError("--check-whole and --reference need audio files, not stdin")


def _stream_sources(args: argparse.Namespace, model) -> list[dict]:
    """Every --audio source through the library's streams (Model.stream_many: the bundle's slots, fed in
    lockstep); each one's record (text, tokens, times, stats) as it ends. One stream's text is printed as it
    comes; several streams' each when its stream ends."""
    from runner.audio import SAMPLE_RATE

    out = sys.stderr if args.json else sys.stdout
    block = max(1, args.block_ms * SAMPLE_RATE // 1000)
    live_text = len(args.audio) == 1

    def write(_: int, delta) -> None:
        out.write(delta.text)
        out.flush()

    records: list[dict] = [{} for _ in args.audio]
    sources = [_blocks(args, source, block) for source in args.audio]
    for t, error in model.stream_many(sources, on_delta=write if live_text else None):
        audio = args.audio[t.index]
        if error is not None:
            if live_text and t.tokens:  # end the line of text it streamed before failing
                out.write("\n")
            records[t.index] = {"audio": audio, "error": _failure(audio, error)}
            continue
        out.write(("" if live_text else f"{audio}: {t.text}") + "\n")  # live: its last delta came before
        out.flush()
        records[t.index] = {"audio": audio, "text": t.text, "tokens": list(t.tokens)}
        records[t.index]["token_times"] = [list(x) for x in t.token_times]
        records[t.index]["segments"] = [s.to_dict() for s in t.segments]
        records[t.index]["stats"] = dict(t.stats)
    return records


def _failure(audio: str, error: Exception) -> str:
    """A source's error as its record says it: one line naming the source."""
    from runner.app.os_errors import reason

    name = "stdin" if audio == "-" else audio
    text = reason(error) if isinstance(error, OSError) else str(error)
    return text if name in text else f"{name}: {text}"


def _print_records(records: list[dict], as_json: bool) -> None:
    for rec in records:
        if as_json:
            print(json.dumps(rec), flush=True)
            continue
        if "error" in rec:  # its error line comes with the other failures'
            continue
        st = rec["stats"]
        print(
            f"{rec['audio']}: steps {st['steps']}  step p50 {st['step_ms_p50']:.2f} ms  p99 "
            f"{st['step_ms_p99']:.2f} ms  token lag p50 {st['token_lag_ms_p50']:.2f} ms  p99 "
            f"{st['token_lag_ms_p99']:.2f} ms  model delay {st['model_delay_ms']:.0f} ms  RTF {st['rtf']:.3f}",
            file=sys.stderr,
        )


def _bench(args: argparse.Namespace) -> int:
    from runner.app import stream_bench
    from runner.runtime.program import Program

    with Program.load(args.bundle, options=args.runtime) as program:
        family = streaming_family(args.bundle, program.manifest.model)
        return stream_bench.main(args, program, family)


def streaming_family(bundle: Path, model: dict):
    """The bundle's family, which must declare streaming (its methods are the streaming steps)."""
    from runner.errors import RunnerError
    from runner.families import FAMILIES, family_for

    family = family_for(bundle, model)
    if not family.capabilities.streaming:
        streaming = " or ".join(name for name, f in FAMILIES.items() if f.capabilities.streaming)
        raise RunnerError(f"{bundle}: a {family.name} bundle; `stream` takes {streaming} bundles")
    return family


def check_streams(args, model, program, spec, records: list[dict], golden: dict | None) -> list[str]:
    """--expect-tokens, --check-whole, --reference eager on every record (its `checks`); the failures."""
    from runner.audio import load_audio
    from runner.families.voxtral_realtime import run_whole

    others = {}  # each check's tokens of a whole file
    if args.check_whole:
        others["whole"] = lambda samples: _alone(model, samples)
    if args.reference == "eager":
        from runner.reference.voxtral_realtime import eager_steps

        eager = eager_steps(args.bundle, program.manifest)
        others["eager"] = lambda samples: run_whole(eager, spec, samples)
    failures: list[str] = []
    for rec in (r for r in records if "error" not in r):
        source, tokens, checks = rec["audio"], rec["tokens"], {}
        if golden is not None:
            failures += _check_golden(args.expect_tokens, golden, source, tokens, checks)
        samples = load_audio(source) if others else None
        for name, tokens_of in others.items():
            i = first_difference(tokens_of(samples), tokens)
            checks[name] = "match" if i is None else f"differs at token {i}"
            if i is not None:
                what = "the whole file run alone" if name == "whole" else "the eager model"
                failures.append(f"{source}: streamed tokens differ from {what} at index {i}")
        if checks:
            rec["checks"] = checks
            print(f"{source}: " + ", ".join(f"{k} {v}" for k, v in checks.items()), file=sys.stderr)
    return failures


def _check_golden(path: Path, golden: dict, source: str, tokens: list[int], checks: dict) -> list[str]:
    """--expect-tokens on one record: its `checks["golden"]`, and the failure, if any."""
    want = golden.get(Path(source).name)
    if want is None:
        checks["golden"] = "none for this file"
        return [f"{path}: no golden tokens for {Path(source).name}"]
    if (i := first_difference(want, tokens)) is not None:
        checks["golden"] = f"differs at token {i}"
        return [f"{source}: tokens differ from {path.name} at index {i}"]
    checks["golden"] = "match"
    return []


def _alone(model, samples) -> list[int]:
    """The file streamed alone, in one piece (the library's Model.stream): what --check-whole compares."""
    with model.stream() as stream:
        stream.push(samples)
        return list(stream.finish().tokens)
