"""Folder runs: which audio files `run --audio-dir` / `--audio-list` mean, the results file `--out` (JSON lines,
each appended whole, read back so a re-run skips what is done), and the progress display.

No torch here: every path and the results file are checked before the program loads, so a typo fails in a second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from runner.app.writers import OutputOptions, check_targets
from runner.errors import RunnerError

# The suffixes of what load_audio reads: libsndfile's formats (wav, flac, ogg/opus, mp3, aiff, au, caf, w64, rf64)
# and the containers ffmpeg (PyAV) reads recordings from: AAC/ALAC in m4a, a video's audio track (mp4, mov, mkv,
# webm, 3gp), Matroska audio, raw AAC/AC-3, WMA, AMR. --audio takes any file ffmpeg reads; a folder lists these.
AUDIO_SUFFIXES = frozenset(
    ".wav .wave .flac .ogg .oga .opus .mp3 .aiff .aif .aifc .au .snd .caf .w64 .rf64 "
    ".m4a .m4b .mp4 .m4v .mov .3gp .webm .mkv .mka .aac .ac3 .wma .asf .amr".split()
)
MAX_NOTES = 5  # unreadable lines of --out named one by one; the rest counted


def audio_suffixes() -> frozenset[str]:
    return AUDIO_SUFFIXES


# ---------------------------------------------------------------- which files


def list_dir(root: Path, recursive: bool, suffixes: frozenset[str]) -> list[Path]:
    """The audio files in `root` (and below it, with `recursive`), sorted by their path under it. Hidden names
    (".x", as macOS's "._x.wav" resource forks) are skipped: they are not recordings, though named like them."""
    if not root.exists():
        raise RunnerError(f"--audio-dir {root}: no such directory")
    if not root.is_dir():
        raise RunnerError(f"--audio-dir {root}: not a directory (give single files with --audio)")

    def refuse(e: OSError) -> None:  # a folder we cannot list would silently leave its files out
        raise RunnerError(f"--audio-dir {root}: cannot list {e.filename or root} ({e.strerror or e})")

    found, subdirs, skipped = [], 0, Counter()
    # followlinks=False: a link back up the tree would loop; linked files are followed (they are files)
    for here, dirs, files in os.walk(root, onerror=refuse):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        subdirs += len(dirs)
        for f in files:
            kind = "hidden" if f.startswith(".") else Path(f).suffix.lower() or "no extension"
            if kind in suffixes:
                found.append(Path(here) / f)
            else:
                skipped[kind] += 1
        if not recursive:
            break
    if not found:
        hint = f"; it has {subdirs} subfolder(s): add --recursive to look in them" if subdirs and not recursive else ""
        raise RunnerError(f"--audio-dir {root}: no audio files ({', '.join(sorted(suffixes))}){hint}")
    if skipped:
        print(f"note: --audio-dir {root}: {skipped_line(skipped)}", file=sys.stderr)
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def skipped_line(skipped: Counter) -> str:
    """What a folder listing left out and why, in one line: 'skipped 4 file(s): 3 .txt, 1 .jpg (not audio file
    names) and 2 hidden (names starting with ".")'."""
    hidden = skipped.pop("hidden", 0)
    others = ", ".join(f"{n} {kind}" for kind, n in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0])))
    parts = [f"{others} (not audio file names)"] if others else []
    parts += [f'{hidden} hidden (names starting with ".")'] if hidden else []
    return f"skipped {sum(skipped.values()) + hidden} file(s): {' and '.join(parts)}"


def read_list(path: Path) -> list[Path]:
    """One path a line; blank lines and lines starting with # skipped; a relative path is relative to the list
    file's folder (so a list travels with its audio). Entries are not opened here: a missing or bad one becomes
    that file's error record, as a bad --audio file does."""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise RunnerError(f"--audio-list {path}: no such file") from None
    except IsADirectoryError:
        raise RunnerError(f"--audio-list {path}: a directory (use --audio-dir for a folder)") from None
    except OSError as e:
        raise RunnerError(f"--audio-list {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        line = text_line_of(path.read_bytes(), e.start)
        raise RunnerError(f"--audio-list {path}: line {line} is not UTF-8 text") from None
    entries = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            entries.append(path.parent / line)  # an absolute entry stays itself
    if not entries:
        raise RunnerError(f"--audio-list {path}: lists no files (blank lines and # comments only)")
    return entries


def text_line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def collect(args: argparse.Namespace, unique: bool) -> list[Path]:
    """--audio files, then each --audio-dir's, then each --audio-list's, in that order. `unique` (with --out: a
    results file holds one record per file): a file named twice runs once, the first time; without it every
    name runs, as `run --audio A --audio A` always has (one record each)."""
    paths = list(args.audio or [])
    if args.audio_dir:
        suffixes = audio_suffixes()
        for d in args.audio_dir:
            paths += list_dir(d, args.recursive, suffixes)
    for lst in args.audio_list or []:
        paths += read_list(lst)
    if not paths:
        raise RunnerError("no audio: give --audio FILE, --audio-dir DIR or --audio-list FILE")
    if not unique:
        return paths
    seen, out = set(), []
    for p in paths:
        if (k := file_key(str(p))) not in seen:
            seen.add(k)
            out.append(p)
    return out


def file_key(audio: str) -> str:
    """What "the same file" means between a run and its re-run: the record's `audio` as the path resolves now
    (so ./a.wav and a.wav, or a folder given relative and absolute, match)."""
    return os.path.realpath(audio)


# ---------------------------------------------------------------- the results file


@dataclass
class ResultsFile:
    """`--out`: a JSON-lines file opened for appending and locked (a second run on it would write every file
    twice). Each record is one os.write of the whole line on an O_APPEND descriptor, then fsync, with SIGINT and
    SIGTERM held until both are done: an interrupted run leaves whole lines, and a crash at most a partial last
    line, which the next run's `read` repairs."""

    path: Path
    fd: int
    done: frozenset[str] = frozenset()  # file_key of every file with a successful record
    notes: list[str] = field(default_factory=list)  # what reading it found and repaired, for the user

    @classmethod
    def open(cls, path: Path) -> ResultsFile:
        if path.is_dir():
            raise RunnerError(f"--out {path}: a directory; give a file, e.g. {path / 'results.jsonl'}")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            _lock(fd, path)
            out = cls(path, fd)
            out._read()
        except BaseException:
            os.close(fd)
            raise
        return out

    def _read(self) -> None:
        data = os.pread(self.fd, os.fstat(self.fd).st_size, 0)
        end = data.rfind(b"\n") + 1  # the bytes after the last newline: a line a crash cut short, or none
        lines, tail = data[:end].split(b"\n")[:-1], data[end:]
        if tail:
            if _record(tail) is not None:  # whole, only its newline missing (written by hand, or by another tool)
                os.write(self.fd, b"\n")
                lines.append(tail)
            else:  # only this partial line goes: every line before it is left as it is
                os.ftruncate(self.fd, end)
                self.notes.append(
                    f"{self.path}: removed an incomplete last line ({len(tail)} bytes) an interrupted run left; "
                    "its file runs again"
                )
        done, bad = set(), []
        for n, line in enumerate(lines, 1):
            r = _record(line)
            if r is None:
                if line.strip():
                    bad.append(n)
            elif "error" not in r:  # error records are history: those files run again
                done.add(file_key(r["audio"]))
        if bad:
            named = ", ".join(map(str, bad[:MAX_NOTES])) + (
                f" and {len(bad) - MAX_NOTES} more" if len(bad) > MAX_NOTES else ""
            )
            self.notes.append(f"{self.path}: line(s) {named} are not run records; left as they are, and ignored")
        self.done = frozenset(done)

    def append(self, record: dict) -> None:
        line = (json.dumps(record) + "\n").encode("utf-8")
        with signals_held():
            view = memoryview(line)
            while view:  # one write, unless the disk fills mid-line (then the next run repairs the tail)
                view = view[os.write(self.fd, view) :]
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the lock goes with it
            self.fd = -1


def _record(line: bytes) -> dict | None:
    try:
        r = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser
        return None
    return r if isinstance(r, dict) and isinstance(r.get("audio"), str) else None


def _lock(fd: int, path: Path) -> None:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, as before this file had one
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunnerError(f"--out {path}: another run is writing to it; wait for it, or give another --out") from None


@contextlib.contextmanager
def signals_held(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Ctrl-C (or SIGTERM) inside the block takes effect when it ends: the line being written is finished."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    pending: list[tuple[int, object]] = []
    previous = {s: signal.signal(s, lambda signum, frame: pending.append((signum, frame))) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if pending:
            signum, frame = pending[0]
            handler = previous[signum]
            if callable(handler):  # Python's KeyboardInterrupt, the CLI's Terminated
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


# ---------------------------------------------------------------- progress


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """Files done of the total, audio hours transcribed per hour of wall time, and the time left. On a terminal a
    rich bar on stderr; elsewhere (a log, a pipe, CI) a plain line every tenth of the files or PLAIN_EVERY_S
    seconds, whichever comes first, and one at the end: a redrawn bar would fill a log with its frames."""

    PLAIN_EVERY_S = 30.0

    def __init__(self, total: int, live: bool):
        self.total, self.live = total, live
        self.done = self.failed = 0
        self.audio_s = 0.0
        self.start = self._last = time.monotonic()
        self._step = max(1, total // 10)
        self._bar = self._task = None

    def __enter__(self) -> Progress:
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn("files"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                TextColumn("ETA"), TimeRemainingColumn(),
                console=Console(stderr=True), redirect_stdout=False, redirect_stderr=False,
            )  # fmt: skip
            self._bar.start()
            self._task = self._bar.add_task("files", total=self.total, rate=self.rate_text())
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def rate_text(self) -> str:
        wall = time.monotonic() - self.start
        rate = self.audio_s / wall if wall > 0 else 0.0
        errors = f", {self.failed} error(s)" if self.failed else ""
        return f"{rate:.1f} audio h/h{errors}"

    def advance(self, audio_seconds: float, failed: bool) -> None:
        self.done += 1
        self.failed += failed
        self.audio_s += audio_seconds
        if self._bar is not None:
            self._bar.update(self._task, advance=1, rate=self.rate_text())
            return
        now = time.monotonic()
        if self.done == self.total or self.done % self._step == 0 or now - self._last >= self.PLAIN_EVERY_S:
            self._last = now
            left = (now - self.start) / self.done * (self.total - self.done)
            print(
                f"progress: {self.done}/{self.total} files, {self.rate_text()}, ETA {_duration(left)}",
                file=sys.stderr,
                flush=True,
            )

    def note(self, text: str) -> None:
        """A line above the bar (or in the log)."""
        if self._bar is not None:
            self._bar.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def summary(self) -> str:
        wall = time.monotonic() - self.start
        return (
            f"{self.done} file(s) in {_duration(wall)}, {self.failed} error(s); {self.audio_s / 3600:.2f} h of audio "
            f"({self.audio_s / wall if wall > 0 else 0.0:.1f} audio h/h)"
        )


# ---------------------------------------------------------------- the plan, before the program loads


@dataclass
class FilePlan:
    """The files a `run` was asked for, those it still has to do, and where their records go."""

    paths: list[Path]  # every file asked for
    todo: list[Path]  # those without a successful record in --out
    out: ResultsFile | None

    def close(self) -> None:
        if self.out is not None:
            self.out.close()


def prepare(args: argparse.Namespace) -> FilePlan:
    """The files, the --batch and --out checks, what --out already holds and whether --output-dir's files may be
    written: all before the program loads."""
    plan = _plan(args)
    outputs = OutputOptions.parse(args.output_format, args.output_dir, args.force)
    if outputs is not None:
        try:
            check_targets(plan.todo, outputs)
        except BaseException:
            plan.close()
            raise
    return plan


def _plan(args: argparse.Namespace) -> FilePlan:
    if args.batch < 1:
        raise RunnerError(f"--batch {args.batch}: must be at least 1 (1: one file after another)")
    paths = collect(args, unique=args.out is not None)
    out = ResultsFile.open(args.out) if args.out is not None else None
    if out is None:
        return FilePlan(paths, paths, None)
    for note in out.notes:
        print(f"note: {note}", file=sys.stderr)
    todo = [p for p in paths if file_key(str(p)) not in out.done]
    if len(todo) < len(paths):
        print(
            f"note: skipping {len(paths) - len(todo)} of {len(paths)} file(s) already done in {args.out} "
            "(files with an error record run again)",
            file=sys.stderr,
        )
    return FilePlan(paths, todo, out)
