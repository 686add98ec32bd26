"""`run`'s flags and the options value made from them once, apart from the verb (runner/app/run.py, which imports
torch): `--help` builds them without it."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from runner.app.options import add_runtime_flags
from runner.app.writers import FORMATS, OutputOptions
from runner.runtime.options import RuntimeOptions

MAX_WER = 100.0  # insertions take a WER past 1; a limit beyond this checks nothing


@dataclass(frozen=True)
class RunOptions:
    """Everything `run` does with its files, from the flags and the environment; made once, at the CLI's edge."""

    runtime: RuntimeOptions
    batch: int = 1
    prompt: str | None = None
    language: str | None = None
    json: bool = False  # stdout carries only the JSON lines; text goes to stderr
    # generation
    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    min_new_tokens: int = 0
    # long-form decoding (Whisper), openai-whisper's `transcribe` defaults
    temperature_increment_on_fallback: float | None = 0.2
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    word_timestamps: bool = False
    # the checks
    reference: str | None = None  # "eager": compare with the eager model on the bundle's weights
    expect: str | None = None
    expect_tokens: Path | None = None
    wer: Path | None = None
    max_wer: float | None = None
    step_summary: Path | None = None  # the job summary the e2e table is appended to
    outputs: OutputOptions | None = None  # --output-format/--output-dir: transcript files, one per input

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        return cls(
            runtime=args.runtime,
            batch=args.batch,
            prompt=args.prompt,
            language=args.language,
            json=args.json,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            min_new_tokens=args.min_new_tokens,
            temperature_increment_on_fallback=args.temperature_increment_on_fallback,
            compression_ratio_threshold=args.compression_ratio_threshold,
            logprob_threshold=args.logprob_threshold,
            no_speech_threshold=args.no_speech_threshold,
            condition_on_previous_text=args.condition_on_previous_text,
            word_timestamps=args.word_timestamps,
            reference=args.reference,
            expect=args.expect,
            expect_tokens=args.expect_tokens,
            wer=args.wer,
            max_wer=args.max_wer,
            step_summary=args.env.step_summary,
            outputs=OutputOptions.parse(args.output_format, args.output_dir, args.force),
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", type=Path, required=True, help="bundle directory (python -m runner export)")
    p.add_argument(
        "--audio",
        type=Path,
        action="append",
        default=None,
        metavar="FILE",
        help="audio file (repeatable; these run first, in order)",
    )
    p.add_argument(
        "--audio-dir",
        type=Path,
        action="append",
        default=None,
        metavar="DIR",
        help="every audio file in DIR (the extensions soundfile reads: .wav, .flac, .ogg, ...; hidden names "
        "skipped), sorted by name; repeatable; with --recursive, its subfolders too",
    )
    p.add_argument(
        "--recursive", action="store_true", help="--audio-dir: also the files in its subfolders, at any depth"
    )
    p.add_argument(
        "--audio-list",
        type=Path,
        action="append",
        default=None,
        metavar="FILE",
        help="a text file of audio paths, one a line (blank lines and lines starting with # skipped; a relative "
        "path is relative to the list's folder); repeatable",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="FILE",
        help="append each file's record (the --json object) to this JSON-lines file as it finishes, one whole "
        "line at a time; a re-run with the same --out skips the files that have a successful record there (error "
        "records run again). Shows a progress bar instead of each file's text",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        metavar="N",
        help="files decoded at once (continuous batching: a finished file's slot takes the next one); above 1 "
        "needs a bundle exported with --max-batch",
    )
    add_ray_flags(p)
    p.add_argument("--prompt", default=None, help="chat prompt about the audio (default: transcription)")
    p.add_argument("--language", default=None, help="transcription language, e.g. en")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (temperature > 0)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens to generate at most, per prompt window (default: 128, or 4 a second of its audio if more, "
        "so a long transcript is not cut short)",
    )
    p.add_argument("--min-new-tokens", type=int, default=0, help="ignore </s> until this many tokens")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (temperature > 0)")
    p.add_argument("--json", action="store_true", help="one JSON object per audio file on stdout")
    add_long_form_flags(p)
    add_output_flags(p)
    add_runtime_flags(p)
    p.add_argument(
        "--reference",
        choices=["eager"],
        default=None,
        help="also run the eager PyTorch model with the same weights and compare",
    )
    p.add_argument("--expect", default=None, help="fail unless every transcript contains TEXT (case-insensitive)")
    p.add_argument(
        "--expect-tokens",
        type=Path,
        default=None,
        help="golden JSON {audio file name: [token ids]}; fail on any difference in the tokens both have (a "
        "prefix check: any --max-new-tokens works)",
    )
    p.add_argument(
        "--wer",
        type=Path,
        default=None,
        help="reference transcripts JSON {audio file name: text}: print each file's and the total word error rate",
    )
    p.add_argument(
        "--max-wer",
        type=number(0.0, MAX_WER, low_open=False),
        default=None,
        help="with --wer: fail if the total WER is above this (0.2 = 20%%)",
    )


# --ray ADDRESS: connecting, then the cluster's first answer, each within this (runner/app/folder_ray.py's probe)
RAY_PROBE_S = 10


def add_ray_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('many machines (Ray: pip install -e ".[ray]")')
    g.add_argument(
        "--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
        help="spread the files over Ray workers, each holding the bundle loaded (a GPU each for a CUDA bundle), "
        "their records written to the one --out file: no ADDRESS starts a Ray cluster on this machine, an ADDRESS "
        "(auto, HOST:PORT, ray://HOST:PORT) joins one whose machines see the files at the same paths (where no "
        f"cluster answers: an error, after {RAY_PROBE_S} s at most connecting and {RAY_PROBE_S} s for an answer)",
    )  # fmt: skip
    g.add_argument(
        "--workers", type=whole(1, 100_000), default=None, metavar="N",
        help="with --ray: this many workers (default: one per GPU of the cluster for a CUDA bundle, one per CPU "
        "for a CPU bundle)",
    )  # fmt: skip


def add_output_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output-format",
        choices=[*FORMATS, "all"],
        default=None,
        help="write each input's transcript to a file named after it, in openai-whisper's formats: txt, vtt or "
        "srt subtitles, tsv (start and end in ms, text), json ({text, segments, language}), or all of them "
        "(default with --output-dir: all)",
    )
    p.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the folder --output-format's files go to (default with --output-format: the current folder); a file "
        "there that this runner did not write is refused before anything runs",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="--output-dir: replace files there that this runner did not write (or that were changed since)",
    )


def whole(least: int, most: int):
    """argparse's type for a whole number from `least` to `most`: the error line names the flag ("argument
    --block-ms: ..."). The upper bound keeps what a flag sizes allocatable, so a typo is refused at once instead of
    failing deep inside (a MemoryError, an OverflowError, a TypeError)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:  # "1e20", "abc", and more digits than int() reads
            n = None
        if n is None or not least <= n <= most:
            raise argparse.ArgumentTypeError(f"{text!r}: a whole number from {least} to {most:,}")
        return n

    return parse


def number(low: float, high: float, low_open: bool = True):
    """argparse's type for a finite number above `low` (at least, with low_open=False) and at most `high`: NaN
    compares false to every limit, so it would pass any later check unseen."""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            x = math.nan
        if not (math.isfinite(x) and (low < x if low_open else low <= x) and x <= high):
            least = f"above {low:g}" if low_open else f"at least {low:g}"
            raise argparse.ArgumentTypeError(f"{text!r}: a finite number {least}, at most {high:g}")
        return x

    return parse


def _threshold(text: str) -> float | None:
    """A number, or "none": the check is off."""
    if text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # argparse names the flag: "argument --logprob-threshold: ..."
        raise argparse.ArgumentTypeError(f"{text!r}: a finite number, or none")
    return value


def add_long_form_flags(p: argparse.ArgumentParser) -> None:
    """openai-whisper's `transcribe` options, with its defaults (Whisper; other families ignore them)."""
    g = p.add_argument_group("long-form decoding (Whisper, as openai-whisper's transcribe)")
    g.add_argument(
        "--temperature-increment-on-fallback", type=_threshold, default=0.2, metavar="T",
        help="a window whose text is judged implausible (below) is decoded again this much hotter, up to 1.0 "
        '(default 0.2; 0 or "none": never)',
    )  # fmt: skip
    g.add_argument(
        "--compression-ratio-threshold", type=_threshold, default=2.4, metavar="R",
        help='fall back when a window\'s text compresses better than this (repetition; default 2.4; "none": off)',
    )  # fmt: skip
    g.add_argument(
        "--logprob-threshold", type=_threshold, default=-1.0, metavar="L",
        help='fall back when a window\'s average token log-probability is below this (default -1.0; "none": off)',
    )  # fmt: skip
    g.add_argument(
        "--no-speech-threshold", type=_threshold, default=0.6, metavar="P",
        help="a window whose no-speech probability is above this, with a log-probability below "
        '--logprob-threshold, is silence and skipped (default 0.6; "none": off)',
    )  # fmt: skip
    g.add_argument(
        "--no-condition-on-previous-text", dest="condition_on_previous_text", action="store_false",
        help="decode each window without the text before it as its prompt (fewer repetition loops, less "
        "consistent style)",
    )  # fmt: skip
    g.add_argument(
        "--word-timestamps", action="store_true",
        help="each segment's words with their start, end and probability (in --json records and the json "
        "output; srt/vtt cues follow the words), from the cross-attention as openai-whisper's word_timestamps",
    )  # fmt: skip
