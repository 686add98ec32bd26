"""The results file of a folder run (`run --out`): our JSON-lines records, one per file, each appended whole and
read back so a re-run skips the files already done.

It answers for what the file system can do to those records: a second run writing at once (locked out), a crash
mid-line (the torn line repaired), a file that is not ours (refused as it is), a run that wrote nothing (no trace).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from runner.errors import RunnerError, signals_held


def file_key(audio: str) -> str:
    """What "the same file" means between a run and its re-run: the record's `audio` as the path resolves now
    (so ./a.wav and a.wav, or a folder given relative and absolute, match)."""
    return os.path.realpath(audio)


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
