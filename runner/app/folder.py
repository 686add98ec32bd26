"""Folder runs: which audio files `run --audio-dir` / `--audio-list` mean, the results file `--out` (JSON lines,
each appended whole, read back so a re-run skips what is done), and the progress display.

No torch here: every path and the results file are checked before the program loads, so a typo fails in a second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from runner.app.writers import OutputOptions, check_targets
from runner.errors import RunnerError, signals_held

# The suffixes of what load_audio reads: libsndfile's formats (wav, flac, ogg/opus, mp3, aiff, au, caf, w64, rf64)
# and the containers ffmpeg (PyAV) reads recordings from: AAC/ALAC in m4a, a video's audio track (mp4, mov, mkv,
# webm, 3gp), Matroska audio, raw AAC/AC-3, WMA, AMR. --audio takes any file ffmpeg reads; a folder lists these.
AUDIO_SUFFIXES = frozenset(
    ".wav .wave .flac .ogg .oga .opus .mp3 .aiff .aif .aifc .au .snd .caf .w64 .rf64 "
    ".m4a .m4b .mp4 .m4v .mov .3gp .webm .mkv .mka .aac .ac3 .wma .asf .amr".split()
)


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

RESOLVED = "audio_realpath"  # a record's file as it resolved when it was written: what a re-run matches on
RECORD_START = b'{"audio": '  # how every record we write begins (json.dumps of a dict whose first key is audio)


@dataclass
class ResultsFile:
    """`--out`: a JSON-lines file of our records, opened for appending and locked (a second run on it would write
    every file twice). Each record is one os.write of the whole line on an O_APPEND descriptor, then fsync, with
    SIGINT and SIGTERM held until both are done: an interrupted run leaves whole lines, and a crash at most a
    partial last line, which the next run's `read` repairs. Any other file is refused as it is: only a file that
    holds nothing but our records (or nothing) is ours to cut or append to."""

    path: Path
    fd: int
    done: frozenset[str] = frozenset()  # file_key of every file with a successful record
    notes: list[str] = field(default_factory=list)  # what reading it found and repaired, for the user
    made: list[Path] = field(default_factory=list)  # the file, if opening it created it, then its new folders
    written: bool = False  # a record appended: what was made stays

    @classmethod
    def open(cls, path: Path) -> ResultsFile:
        _check_kind(path)
        folders = _make_folders(path.parent)
        try:
            fd, created = _open(path)
        except BaseException:
            _remove_folders(folders)
            raise
        out = cls(path, fd, made=([path] if created else []) + folders)
        try:
            _check_regular(fd, path)
            _lock(fd, path)
            out._read()
        except BaseException:
            out.close()
            raise
        return out

    def _read(self) -> None:
        size = os.fstat(self.fd).st_size
        _check_start(self.path, os.pread(self.fd, min(size, 1 << 16), 0))  # a recording is not read whole first
        data = os.pread(self.fd, size, 0)
        end = data.rfind(b"\n") + 1  # the bytes after the last newline: a line a crash cut short, or none
        lines, tail = data[:end].split(b"\n")[:-1], data[end:]
        whole_tail = bool(tail) and _record(tail) is not None
        _check_ours(self.path, lines, b"" if whole_tail else tail)
        if whole_tail:  # whole, only its newline missing (written by hand, or by another tool)
            os.write(self.fd, b"\n")
            lines.append(tail)
        elif tail:  # only this partial line of ours goes: every line before it is left as it is
            os.ftruncate(self.fd, end)
            self.notes.append(
                f"{self.path}: removed an incomplete last line ({len(tail)} bytes) an interrupted run left; "
                "its file runs again"
            )
        records = [r for r in map(_record, lines) if r is not None]
        # error records are history: those files run again
        self.done = frozenset(_resume_key(r) for r in records if "error" not in r)

    def append(self, record: dict) -> None:
        audio = record["audio"]
        line = (json.dumps({"audio": audio, RESOLVED: file_key(audio), **record}) + "\n").encode("utf-8")
        self.written = True
        with signals_held():
            view = memoryview(line)
            while view:  # one write, unless the disk fills mid-line (then the next run repairs the tail)
                view = view[os.write(self.fd, view) :]
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            if not self.written:
                self._unmake()
            os.close(self.fd)  # the lock goes with it
            self.fd = -1

    def _unmake(self) -> None:
        """A run that ends before its first record leaves no trace: the file opening it created (while it is
        still that empty file) and the folders made for it go again."""
        folders = self.made
        if folders[:1] == [self.path]:
            folders = folders[1:]
            st = os.fstat(self.fd)
            with contextlib.suppress(OSError):  # gone or replaced meanwhile: not ours to remove any more
                here = os.stat(self.path, follow_symlinks=False)
                if st.st_size == 0 and (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino):
                    os.unlink(self.path)
        _remove_folders(folders)


def _record(line: bytes) -> dict | None:
    """One of our records: a file's result (its tokens) or its error, named by its audio path."""
    try:
        r = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser
        return None
    if not isinstance(r, dict) or not isinstance(r.get("audio"), str):
        return None
    return r if isinstance(r.get("error"), str) or isinstance(r.get("tokens"), list) else None


def _resume_key(r: dict) -> str:
    """The record's file as it resolved when written (a re-run from another folder still matches); a record
    without it (an older runner's) resolves its path from here."""
    resolved = r.get(RESOLVED)
    return resolved if isinstance(resolved, str) else file_key(r["audio"])


def _check_ours(path: Path, lines: list[bytes], torn: bytes) -> None:
    """Refuse a file with anything but our records (blank lines aside) and, last, the start of one a crash cut."""
    bad = next((n for n, line in enumerate(lines, 1) if line.strip() and _record(line) is None), None)
    if bad is None and torn and not _starts_a_record(torn):
        bad = len(lines) + 1
    if bad is not None:
        _not_ours(path, bad)


def _check_start(path: Path, head: bytes) -> None:
    """The first line that is not blank must begin as our records do."""
    text = head.lstrip(b" \t\r\n")
    if text and not _starts_a_record(text):
        _not_ours(path, head[: len(head) - len(text)].count(b"\n") + 1)


def _starts_a_record(data: bytes) -> bool:
    return data.startswith(RECORD_START) or RECORD_START.startswith(data)


def _not_ours(path: Path, line: int) -> None:
    raise RunnerError(
        f"--out {path}: not a results file of this runner (line {line} is not one of its records); left as it is: "
        "give a new file, or one that an earlier run wrote"
    )


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket"}  # fmt: skip


def _check_kind(path: Path) -> None:
    """A directory, a link to nothing, or anything but a regular file (a FIFO, a device) is refused, named."""
    try:
        st = os.stat(path)  # a link is followed: its target is what would be written
    except FileNotFoundError:
        if os.path.islink(path):
            raise RunnerError(f"--out {path}: a symbolic link to {os.readlink(path)}, which does not exist") from None
        return
    except OSError as e:
        raise RunnerError(f"--out {path}: cannot use it ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise RunnerError(f"--out {path}: a directory; give a file, e.g. {path / 'results.jsonl'}")
    _check_mode(st.st_mode, path)


def _check_mode(mode: int, path: Path) -> None:
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a file")
        raise RunnerError(f"--out {path}: not a regular file ({kind}); give a file for the records, e.g. results.jsonl")


def _check_regular(fd: int, path: Path) -> None:
    _check_mode(os.fstat(fd).st_mode, path)  # what was opened, should the name have changed since it was checked


def _open(path: Path) -> tuple[int, bool]:
    """The file's descriptor, and whether this open created it. O_NONBLOCK: a FIFO put there since the check
    does not hang the open (it is refused next)."""
    flags = os.O_RDWR | os.O_APPEND | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        return os.open(path, flags), False


def _make_folders(folder: Path) -> list[Path]:
    """Make `folder` and the folders above it that are missing; returns those this call made, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    if missing:
        missing[0].mkdir(parents=True, exist_ok=True)
    return missing


def _remove_folders(folders: list[Path]) -> None:
    for d in folders:  # deepest first; rmdir takes only an empty folder: anything put there since stays
        try:
            d.rmdir()
        except OSError:
            return


def _lock(fd: int, path: Path) -> None:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, as before this file had one
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunnerError(f"--out {path}: another run is writing to it; wait for it, or give another --out") from None


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
