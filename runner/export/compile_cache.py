"""The compile cache: each compiled method's `.so` under its cache key, named after its own sha256
(`<root>/<key>/<method>.<sha256>.so`). An entry is used only once the copy taken from it hashes to its name, so a
cut-short, emptied or modified entry never reaches dlopen (a truncated `.so` mapped by dlopen dies with SIGBUS,
and one copied into a bundle passes the bundle's digests, which are computed from it). A bad entry is removed
and its method compiled again, with a one-line note: the cache heals itself. An entry is written under a
temporary name and renamed, so its name and its bytes appear together. Failing to write one costs only time.

A debug compile's generated sources are kept beside its entry (`<entry>.sources/`), so a DEBUG=1 export from a
warm cache still leaves them in the bundle's debug/ (they are read by people, never loaded: not digested).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from runner.digests import sha256_file

log = logging.getLogger(__name__)

_ENTRY = re.compile(r"^(?P<method>.+)\.(?P<sha256>[0-9a-f]{64})\.so$")


class CompileCache:
    def __init__(self, root: Path):
        self.root = Path(root)

    def entries(self, key: str, method: str) -> list[Path]:
        """The method's entries under `key`, newest first; a `<method>.so` without a digest (written before
        entries carried one) among them, to be refused."""
        d = self.root / key
        if not d.is_dir():
            return []
        found = [p for p in d.iterdir() if p.name == f"{method}.so" or _method(p.name) == method]
        return sorted(found, key=_mtime, reverse=True)

    def fetch(self, key: str, method: str, dest: Path, sources: Path | None = None) -> bool:
        """Copy the method's entry to `dest` and check the copy against the entry's digest (and with `sources`,
        copy its generated sources there); False, with nothing at `dest`, when there is no good entry. Bad
        entries are removed, with a note."""
        for entry in self.entries(key, method):
            m = _ENTRY.match(entry.name)
            try:
                shutil.copyfile(entry, dest)
            except FileNotFoundError:  # another export replaced it meanwhile
                continue
            # (any other OSError is the caller's: a full disk under `dest` is no reason to drop a good entry)
            ok = m is not None and sha256_file(dest) == m["sha256"]
            if ok and sources is None:
                return True
            if ok:  # a debug export: the entry counts only with its sources
                if _sources(entry).is_dir():
                    shutil.copytree(_sources(entry), sources, dirs_exist_ok=True)
                    return True
                dest.unlink(missing_ok=True)
                return False
            why = (
                "has no digest (an older runner's)"
                if m is None
                else "does not hash to its name (cut short or modified)"
            )
            log.warning("note: compile cache: %s %s; compiling %s again", entry, why, method)
            dest.unlink(missing_ok=True)
            _remove(entry)
        return False

    def store(self, key: str, method: str, so: Path, sources: Path | None = None) -> Path | None:
        """Add `so` (a freshly compiled library), and a debug compile's `sources`, as the method's entry; None if
        the cache cannot be written."""
        digest = sha256_file(so)
        final = self.root / key / f"{method}.{digest}.so"
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")  # concurrent exports: each its own
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            if sources is not None and sources.is_dir():  # before the entry: an entry found has its sources
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.copytree(sources, tmp)
                shutil.rmtree(_sources(final), ignore_errors=True)
                tmp.rename(_sources(final))
            shutil.copyfile(so, tmp)
            tmp.replace(final)
        except OSError as e:
            _remove(tmp)
            log.warning(
                "note: compile cache: cannot write %s (%s); the next export compiles %s again", final, e, method
            )
            return None
        for old in self.entries(key, method):  # this method's other entries under the key: superseded
            if old != final:
                _remove(old)
        return final


def _sources(entry: Path) -> Path:
    return entry.with_name(f"{entry.name}.sources")


def _remove(entry: Path) -> None:
    """An entry of ours and its sources, gone; one that cannot be removed stays (only a cache)."""
    try:
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    except OSError:
        pass
    shutil.rmtree(_sources(entry), ignore_errors=True)


def _method(name: str) -> str | None:
    m = _ENTRY.match(name)
    return m["method"] if m else None


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0
