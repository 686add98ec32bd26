"""Transcript files: `run --output-format txt|vtt|srt|tsv|json|all --output-dir DIR` writes each input's
transcript as openai-whisper's writers do (whisper/utils.py, 20250625: the same bytes for the same segments), one
file per input and format, named after the input (speech.wav -> DIR/speech.srt).

A file is replaced only if this runner wrote it and nobody changed it since: the output folder's ledger
(LEDGER, the name and sha256 of each file written) says which are ours. Anything else there is refused before the
program loads, unless --force. Each file is written to a temporary name beside it and renamed over the target, so
a reader never sees half a subtitle file and an interrupted run leaves the previous one.

No torch here: the targets are checked with the other paths, before the program loads."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from runner.errors import RunnerError

FORMATS = ("txt", "vtt", "srt", "tsv", "json")  # openai-whisper's, in the order its "all" writes them
LEDGER = ".runner-outputs.json"  # in the output folder: {file name: [sha256 of what we wrote]}
MAX_NAMED = 3  # refused files named one by one; the rest counted


# ---------------------------------------------------------------- the formats (openai-whisper's, exactly)


def format_timestamp(seconds: float, always_include_hours: bool = False, decimal_marker: str = ".") -> str:
    """[HH:]MM:SS.mmm, rounded to the millisecond; hours always for SRT, else only past the first hour."""
    if seconds < 0:
        raise ValueError(f"a negative timestamp: {seconds}")
    ms = round(seconds * 1000.0)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1_000)
    hours_marker = f"{hours:02d}:" if always_include_hours or hours > 0 else ""
    return f"{hours_marker}{minutes:02d}:{secs:02d}{decimal_marker}{ms:03d}"


def cues(segments: list[dict]) -> list[tuple[float, float, str]]:
    """Each subtitle's start, end and text, as openai-whisper's SubtitlesWriter makes them without line limits: one
    a segment; with word times (--word-timestamps), from its first word's start to its last word's end."""
    if segments and "words" in segments[0]:
        return [word_cue(s["words"][i : i + MAX_WORDS]) for s in segments for i in range(0, len(s["words"]), MAX_WORDS)]
    return [(s["start"], s["end"], s["text"].strip().replace("-->", "->")) for s in segments]  # --> ends a timing line


MAX_WORDS = MAX_LINE_WIDTH = 1000  # openai-whisper's: the words of one cue, the characters of one of its lines


def word_cue(words: list[dict]) -> tuple[float, float, str]:
    text, line = "", 0
    for w in words:
        word = w["word"]
        if line > 0 and line + len(word) <= MAX_LINE_WIDTH:
            line += len(word)
        else:  # a new line: its first word without its leading space
            word = word.strip()
            word, line = ("\n" + word if line > 0 else word), len(word)
        text += word
    return words[0]["start"], words[-1]["end"], text


def txt(transcript: dict) -> str:
    return "".join(s["text"].strip() + "\n" for s in transcript["segments"])


def vtt(transcript: dict) -> str:
    body = [
        f"{format_timestamp(a)} --> {format_timestamp(b)}\n{text}\n\n" for a, b, text in cues(transcript["segments"])
    ]
    return "WEBVTT\n\n" + "".join(body)


def srt(transcript: dict) -> str:
    def stamp(t: float) -> str:
        return format_timestamp(t, always_include_hours=True, decimal_marker=",")

    return "".join(
        f"{i}\n{stamp(a)} --> {stamp(b)}\n{text}\n\n" for i, (a, b, text) in enumerate(cues(transcript["segments"]), 1)
    )


def tsv(transcript: dict) -> str:
    """Times in integer milliseconds; a tab in the text would start a fourth column."""
    rows = [
        f"{round(1000 * s['start'])}\t{round(1000 * s['end'])}\t{s['text'].strip().replace(chr(9), ' ')}\n"
        for s in transcript["segments"]
    ]
    return "start\tend\ttext\n" + "".join(rows)


def json_text(transcript: dict) -> str:
    return json.dumps(transcript)


RENDER: dict[str, Callable[[dict], str]] = {"txt": txt, "vtt": vtt, "srt": srt, "tsv": tsv, "json": json_text}


def transcript(text: str, segments: list[dict], language: str | None) -> dict:
    """What openai-whisper's `transcribe` returns and its writers take: {text, segments, language}."""
    return {"text": text, "segments": segments, "language": language}


# ---------------------------------------------------------------- where they go


@dataclass(frozen=True)
class OutputOptions:
    formats: tuple[str, ...]
    dir: Path
    force: bool = False  # replace files that are not ours

    @classmethod
    def parse(cls, output_format: str | None, output_dir: Path | None, force: bool) -> OutputOptions | None:
        """None when neither flag was given (no files written); else openai-whisper's defaults for the other
        one: every format, the current folder."""
        if output_format is None and output_dir is None:
            return None
        fmt = output_format or "all"
        return cls(FORMATS if fmt == "all" else (fmt,), output_dir or Path("."), force)

    def targets(self, audio: Path) -> list[Path]:
        return [self.dir / f"{Path(audio).stem}.{fmt}" for fmt in self.formats]


def check_targets(audio: Iterable[Path], options: OutputOptions) -> None:
    """Before the program loads: two inputs that would write the same file, a target that is a folder, or a file
    there that we did not write (without --force) end the run with one line naming them."""
    by_target: dict[Path, Path] = {}
    for a in audio:
        for target in options.targets(a):
            if target in by_target and file_key(by_target[target]) != file_key(a):
                raise RunnerError(
                    f"--output-dir {options.dir}: {by_target[target]} and {a} would both write {target.name}; "
                    "run them with different --output-dir"
                )
            by_target[target] = a
    if options.dir.exists() and not options.dir.is_dir():
        raise RunnerError(f"--output-dir {options.dir}: not a directory")
    folders = [t for t in by_target if t.is_dir()]
    if folders:
        raise RunnerError(f"--output-dir {options.dir}: {folders[0]} is a directory, not a file it can replace")
    if options.force:
        return
    ledger = read_ledger(options.dir)
    foreign = [t for t in by_target if not is_ours(t, ledger)]
    if foreign:
        named = ", ".join(str(t) for t in foreign[:MAX_NAMED])
        more = f" and {len(foreign) - MAX_NAMED} more" if len(foreign) > MAX_NAMED else ""
        raise RunnerError(
            f"--output-dir {options.dir}: {named}{more} already exist(s) and this runner did not write them (or "
            "they were changed since); move them, choose another --output-dir, or add --force to replace them"
        )


def file_key(audio: Path) -> str:
    return os.path.realpath(audio)  # the same input named twice writes its files once


def read_ledger(folder: Path) -> dict[str, list[str]]:
    try:
        data = json.loads((folder / LEDGER).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or unreadable: nothing there counts as ours
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: [d for d in v if isinstance(d, str)] for k, v in data.items() if isinstance(v, list)}


def write_ledger(folder: Path, ledger: dict[str, list[str]]) -> None:
    write_atomically(folder / LEDGER, (json.dumps(ledger, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def is_ours(target: Path, ledger: dict[str, list[str]]) -> bool:
    """A target is free when nothing is there, or when it holds exactly what we last wrote to it."""
    try:
        data = target.read_bytes()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() in ledger.get(target.name, ())


class TranscriptWriter:
    """Writes each finished input's files, and records them in the folder's ledger as ours."""

    def __init__(self, options: OutputOptions):
        self.options = options

    def write(self, audio: Path, result: dict) -> list[Path]:
        """`result`: `transcript(...)`. The files written; a target that became foreign since the check raises
        RunnerError (that input's failure) and nothing of it is written."""
        folder = self.options.dir
        folder.mkdir(parents=True, exist_ok=True)
        ledger = read_ledger(folder)
        targets = self.options.targets(audio)
        foreign = [t for t in targets if not self.options.force and not is_ours(t, ledger)]
        if foreign:
            raise RunnerError(
                f"{foreign[0]}: appeared (or changed) during the run and this runner did not write it; left as it "
                "is (--force replaces it)"
            )
        data = [RENDER[fmt](result).encode("utf-8") for fmt in self.options.formats]
        digests = [hashlib.sha256(d).hexdigest() for d in data]
        # the new digests go in before the files and the old ones out after: however the run stops, what each
        # target holds is in the ledger, so the next run may replace it
        write_ledger(folder, {**ledger, **{t.name: [*ledger.get(t.name, ()), d] for t, d in zip(targets, digests)}})
        for target, d in zip(targets, data):
            write_atomically(target, d)
        write_ledger(folder, {**ledger, **{t.name: [d] for t, d in zip(targets, digests)}})
        return targets


def write_atomically(target: Path, data: bytes) -> None:
    """A temporary file beside `target`, flushed to disk, then renamed over it: the name holds the old file or
    the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # as open() would make it: mkstemp's 0600 hides it from the folder's other users
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
