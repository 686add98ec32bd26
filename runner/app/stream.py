"""`python -m runner stream`: a Voxtral Realtime bundle over audio as it arrives.

`--audio FILE` feeds the file in blocks (as fast as possible, or at wall-clock speed with `--realtime`);
`--audio -` reads raw 16 kHz mono PCM from stdin (s16le unless `--pcm f32le`). Several `--audio` files are
concurrent streams: fed in lockstep, one block each at a time, and stepped together in one batched call of each
method (stream i in the bundle's state row i; more files than its `max_streams` slots wait for a free one). The
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
    from runner.app.golden import read_golden
    from runner.errors import RunnerError
    from runner.families.voxtral_realtime import program_steps
    from runner.runtime.program import Program

    if args.bench:
        if args.audio:
            raise RunnerError("--bench streams synthetic audio: give no --audio")
        return _bench(args)
    _check_sources(args)
    with Program.load(args.bundle, options=args.runtime) as program:
        family = streaming_family(args.bundle, program.manifest.model)
        golden = read_golden(args.expect_tokens, program.manifest) if args.expect_tokens is not None else None
        steps = program_steps(program, args.runtime, family.spec.window)
        records = _stream_sources(args, family, steps)
        failures = [r["error"] for r in records if "error" in r]  # each bad source's, beside the others' records
        failures += check_streams(args, program, steps, family.spec, records, golden)
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


def _stream_sources(args: argparse.Namespace, family, steps) -> list[dict]:
    """Every --audio source through the bundle's steps, concurrently; each one's record (text, tokens, stats) as
    it ends. One stream's text is printed as it comes; several streams' each when its stream ends."""
    from runner.app.stream_record import stream_stats, timed
    from runner.audio import SAMPLE_RATE
    from runner.families.voxtral_realtime import Stream, StreamBatch, run_fed

    out = sys.stderr if args.json else sys.stdout
    spec, tok = family.spec, family.tokenizer
    block = max(1, args.block_ms * SAMPLE_RATE // 1000)
    texts = [family.decoder() for _ in args.audio]
    live_text = len(args.audio) == 1

    def on_token(i: int):
        def write(token: int) -> None:
            if live_text and token < tok.vocab_size:
                out.write(texts[i].feed(token))
                out.flush()

        return write

    streams = [Stream(spec, on_token(i)) for i in range(len(args.audio))]
    records: list[dict] = [{} for _ in args.audio]
    failed: dict[int, str] = {}

    def done(i: int) -> None:
        s = streams[i]
        if i in failed:
            if live_text and s.tokens:  # end the line of text it streamed before failing
                out.write(texts[i].flush() + "\n")
            records[i] = {"audio": args.audio[i], "error": failed[i]}
            return
        text = tok.decode([t for t in s.tokens if t < tok.vocab_size])
        out.write((texts[i].flush() if live_text else f"{args.audio[i]}: {text}") + "\n")
        out.flush()
        records[i] = {"audio": args.audio[i], "text": text, "tokens": s.tokens, **timed(tok, spec, s)}
        records[i]["stats"] = stream_stats(s, spec, s.received / SAMPLE_RATE)

    steps.reset()
    sources = [(s, _until_failure(args, i, block, s, failed)) for i, s in enumerate(streams)]
    run_fed(StreamBatch(steps, spec), sources, on_done=done)
    return records


def _until_failure(args: argparse.Namespace, i: int, block: int, stream, failed: dict[int, str]):
    """The i-th source's blocks. One that cannot be read (a bad file, samples that are not audio) ends its own
    stream, whose record is then its error (`failed[i]`, a line naming the source): the other streams go on."""
    from runner.app.os_errors import reason
    from runner.errors import RunnerError

    name = "stdin" if args.audio[i] == "-" else args.audio[i]
    try:
        yield from _blocks(args, args.audio[i], block)
    except (RunnerError, OSError) as e:
        text = reason(e) if isinstance(e, OSError) else str(e)
        failed[i] = text if name in text else f"{name}: {text}"
        stream.done = True  # its row is free for the next stream; run_fed ends it as any finished stream


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


def check_streams(args, program, steps, spec, records: list[dict], golden: dict | None) -> list[str]:
    """--expect-tokens, --check-whole, --reference eager on every record (its `checks`); the failures."""
    from runner.audio import load_audio
    from runner.families.voxtral_realtime import run_whole

    eager = None
    if args.reference == "eager":
        from runner.reference.voxtral_realtime import eager_steps

        eager = eager_steps(args.bundle, program.manifest)
    failures: list[str] = []
    for rec in (r for r in records if "error" not in r):
        source, tokens, checks = rec["audio"], rec["tokens"], {}
        if golden is not None:
            want = golden.get(Path(source).name)
            if want is None:
                checks["golden"] = "none for this file"
                failures.append(f"{args.expect_tokens}: no golden tokens for {Path(source).name}")
            elif (i := first_difference(want, tokens)) is not None:
                checks["golden"] = f"differs at token {i}"
                failures.append(f"{source}: tokens differ from {args.expect_tokens.name} at index {i}")
            else:
                checks["golden"] = "match"
        samples = load_audio(source) if args.check_whole or eager is not None else None
        for name, other in (("whole", steps if args.check_whole else None), ("eager", eager)):
            if other is None:
                continue
            i = first_difference(run_whole(other, spec, samples), tokens)
            checks[name] = "match" if i is None else f"differs at token {i}"
            if i is not None:
                what = "the whole file run alone" if name == "whole" else "the eager model"
                failures.append(f"{source}: streamed tokens differ from {what} at index {i}")
        if checks:
            rec["checks"] = checks
            print(f"{source}: " + ", ".join(f"{k} {v}" for k, v in checks.items()), file=sys.stderr)
    return failures
