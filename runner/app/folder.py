"""Folder runs: which audio files `run --audio-dir` / `--audio-list` mean, and the plan a run makes of them
before the program loads (what --out already holds, whether --output-dir's files may be written).

No torch here: every path and the results file are checked before the program loads, so a typo fails in a second.
The results file itself is runner/app/results_file.py; the progress display, runner/app/progress.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from runner.app.results_file import ResultsFile, file_key
from runner.app.writers import OutputOptions, check_targets
from runner.errors import RunnerError

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
