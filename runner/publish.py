"""Putting a finished directory (an exported or fetched bundle) at its destination without losing anything.

- At every instant the destination holds the old bundle or the new one: the two are exchanged in one atomic
  `renameat2(RENAME_EXCHANGE)` where the kernel has it; elsewhere two renames, with the old bundle kept in a
  sibling named after this process, which the next run puts back if it finds the destination missing.
- Only what we created is ever deleted: a destination is replaced only if it is one of our bundles (our manifest,
  the files it lists, the debug sources it records, a fetch's provenance record of it; nothing else, whatever its
  name); after the exchange only the old bundle's own files are removed, so a file someone wrote into it
  meanwhile stays (and is reported). Anything else is refused, or, when the caller allows it, the new bundle's
  files are moved in beside the other files, which are kept.
- A stop asked for (`Cancellation`) is checked right before the swap, and SIGINT / SIGTERM are held while it runs:
  a stopped run publishes nothing, and a publish is never left half done.
- Staging directories are named `.<dest>.tmp-<pid>-…` beside the destination; a run sweeps those of processes
  that are gone (killed mid-export) before it starts.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

from runner.bundle import MANIFEST_NAME, Manifest, bundle_digest
from runner.errors import BundleError, Cancellation, RunnerError, signals_held

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
PROVENANCE_NAME = "provenance.json"  # where `fetch` records the CI run and artifact a bundle came from
DEBUG_NAME = "debug"  # a debug export's generated sources (--debug-compile)
DEBUG_RECORD = "debug_sources"  # manifest.model: the files under debug/ that export wrote, as paths in the bundle


class PublishError(RunnerError):
    pass


def _manifest(d: Path) -> Manifest | None:
    """The manifest of ours in `d`, if it has a readable one."""
    try:
        return Manifest.from_json((d / MANIFEST_NAME).read_text(errors="replace"), str(d / MANIFEST_NAME))
    except (OSError, BundleError):
        return None


def _check_directory(dest: Path) -> None:
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise PublishError(f"{dest}: exists and is not a directory")


def bundle_files(d: Path) -> set[str] | None:
    """The entries of `d`, if `d` is one of our bundles and holds only its own (`foreign_entries`); else None."""
    return {p.name for p in d.iterdir()} if foreign_entries(d) == [] else None


def foreign_entries(d: Path) -> list[str] | None:
    """What `d` holds that is not its bundle's own (paths in it, sorted), or None where `d` has no manifest of
    ours. Its own: the manifest, the files it lists, the debug sources it records and a fetch's record of it."""
    manifest = _manifest(d)
    if manifest is None:
        return None
    own = {MANIFEST_NAME, *(f.split("/")[0] for f in manifest.files)}
    if _own_provenance(d):
        own.add(PROVENANCE_NAME)
    foreign = []
    for p in sorted(d.iterdir()):
        if p.name == DEBUG_NAME and p.name not in own and _real_dir(p):
            sources = _own_debug_sources(d, manifest)
            foreign += sorted(r for r in _files_under(d, p) if r not in sources)
        elif p.name not in own:
            foreign.append(p.name)
    return foreign


def _own_files(d: Path) -> set[str]:
    """The paths in `d` its bundle's records name as its own (none without a manifest of ours)."""
    manifest = _manifest(d)
    if manifest is None:
        return set()
    listed = {f for f in manifest.files if "/" not in f}
    return {MANIFEST_NAME, *listed, *_own_debug_sources(d, manifest)} | (
        {PROVENANCE_NAME} if _own_provenance(d) else set()
    )


def _own_debug_sources(d: Path, manifest: Manifest) -> set[str]:
    """The files under debug/ that the manifest records as written by its export."""
    recorded = manifest.model.get(DEBUG_RECORD)
    if not isinstance(recorded, list):
        return set()
    return {r for r in recorded if isinstance(r, str) and r.startswith(f"{DEBUG_NAME}/") and ".." not in r.split("/")}


def _own_provenance(d: Path) -> bool:
    """A fetch's record of where the bundle came from: its `bundle_digest` is this manifest's sha256."""
    path = d / PROVENANCE_NAME
    try:
        record = json.loads(path.read_text(errors="replace"))
        digest = bundle_digest(d / MANIFEST_NAME)
    except (OSError, ValueError, RecursionError):
        return False
    return not path.is_symlink() and isinstance(record, dict) and record.get("bundle_digest") == digest


def _real_dir(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink()


def _files_under(d: Path, folder: Path) -> list[str]:
    """Everything but folders below `folder`, as paths in `d` (a link is not followed)."""
    return [p.relative_to(d).as_posix() for p in folder.rglob("*") if not _real_dir(p)]


def absolute_destination(dest: Path) -> Path:
    """`dest` as an absolute path (`--out .` has no name to stage a bundle beside), refused where it is or holds
    the current directory: publishing swaps the directory, and the shell would be left in the removed one."""
    full = Path(os.path.abspath(dest))
    if full == full.parent:
        raise PublishError(f"{dest}: the root directory cannot hold a bundle; name a directory for it")
    try:
        cwd = Path.cwd()
    except OSError:  # the current directory was removed: nothing to protect
        return full
    if cwd == full or full in cwd.parents:
        raise PublishError(
            f"{dest}: is the current directory{' or holds it' if cwd != full else ''}; a bundle is published by "
            "replacing the whole directory: name another one, or run from elsewhere"
        )
    return full


def check_destination(dest: Path, *, merge: bool) -> None:
    """Refuse, before any work, a destination that holds anything but one of our bundles (unless `merge`)."""
    _check_directory(dest)
    if not dest.is_dir() or merge or not any(dest.iterdir()):
        return
    foreign = foreign_entries(dest)
    if foreign == []:
        return
    if foreign is None:
        what = f"exists and is not a bundle of ours (it holds {_shown(sorted(p.name for p in dest.iterdir()))})"
    else:
        what = f"holds {_shown(foreign)}, which the bundle there does not record as its own"
    raise PublishError(
        f"{dest}: {what}; refusing to replace it (move them, choose another directory, or --force to add the "
        "bundle's files beside the others, which are kept)"
    )


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_free_space(stage: Path, dest: Path, need: int, what: str) -> None:
    """Refuse, before the work, a disk that cannot hold `what`: one that fills up midway fails late, and an export
    would see a compile fail with a C++ error, which a method with a fallback quietly takes (a slower bundle)."""
    free = free_bytes(stage)
    if free < need:
        raise PublishError(
            f"{dest.parent}: {size_text(free)} free on its disk, and {what} needs about {size_text(need)}; "
            f"free some space or choose another destination than {dest}"
        )


def size_text(n: int) -> str:
    """Bytes as a reader takes them in: 48.5 GB, 312.0 MB, 524 kB."""
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def disk_full(e: BaseException | None) -> bool:
    """Whether `e`, or what caused it, is the disk filling up: a compiler's "No space left on device" reaches us
    as the text of inductor's CppCompileError, Python's as an OSError."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def make_stage(dest: Path) -> Path:
    """A private staging directory beside `dest` (same filesystem: the publish is a rename), after sweeping the
    stages of earlier runs that were killed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    sweep(dest)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent))


def sweep(dest: Path) -> list[Path]:
    """Remove the stages an interrupted run left beside `dest`, and put back an old bundle a kill between two
    renames left aside (the destination missing). Only our own names, of processes that are gone; an old bundle
    that cannot go back loses only its own files (`_remove_old`)."""
    removed = []
    for p in dest.parent.glob(f".{dest.name}.*-*"):
        kind, _, rest = p.name[len(dest.name) + 2 :].partition("-")
        pid = rest.split("-", 1)[0]
        if kind not in ("tmp", "old") or not pid.isdigit() or _alive(int(pid)) or not _real_dir(p):
            continue
        if kind == "old":
            if dest.exists():
                _remove_old(p, dest)
            else:
                p.rename(dest)  # the previous bundle, put back where it was
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def publish(stage: Path, dest: Path, *, cancel: Cancellation, merge: bool = False) -> Path | None:
    """Put `stage` at `dest`, unless `cancel` asks for a stop: it is checked right before, and SIGINT / SIGTERM
    wait until the swap is done. Returns None, or the folder beside `dest` that now holds files which appeared in
    the old bundle while we worked (they are not ours to delete). `merge`: `dest` holds other files, which stay;
    the bundle's are added beside them."""
    _check_directory(dest)
    with signals_held():
        cancel.check()  # the last moment a stop leaves the destination as it was
        return _publish(stage, dest, merge)


def _publish(stage: Path, dest: Path, merge: bool) -> Path | None:
    if not dest.exists():
        stage.rename(dest)
        return None
    if not any(dest.iterdir()):
        dest.rmdir()
        stage.rename(dest)
        return None
    if bundle_files(dest) is None:  # not (or no longer) only a bundle of ours
        if merge:
            _merge(stage, dest)
            return None
        if not bundle_files_listed(dest):  # no manifest of ours at all: never ours to replace
            check_destination(dest, merge=False)
        # ours, with files that appeared since the check: swapped out whole, those files kept (below)
    return _remove_old(_exchange(stage, dest), dest)


def _merge(stage: Path, dest: Path) -> None:
    """The new bundle's files into `dest`, each over the one of its name; then the old bundle's own files the new
    one does not have are removed. Everything else in `dest` stays."""
    _check_merge(stage, dest)
    old = _own_files(dest)  # before the manifest is replaced: a provenance record is checked against it
    moved: set[str] = set()
    for name in sorted(p.name for p in stage.iterdir() if p.name != MANIFEST_NAME):
        _move_in(stage, dest, name, moved)
    os.replace(stage / MANIFEST_NAME, dest / MANIFEST_NAME)  # last: it points at files already in place
    _remove_files(dest, old - moved - {MANIFEST_NAME})  # the previous bundle's that the new one does not have
    shutil.rmtree(stage, ignore_errors=True)


def _check_merge(stage: Path, dest: Path) -> None:
    """Before anything moves: a new file where `dest` has a folder of that name, or a new folder where it has a
    file, is refused (neither is ours to delete)."""
    for p in sorted(stage.rglob("*")):
        there = dest / p.relative_to(stage)
        if (_real_dir(p) and there.exists() and not _real_dir(there)) or (not _real_dir(p) and _real_dir(there)):
            raise PublishError(
                f"{there}: is {'a file' if _real_dir(p) else 'a directory'} where the bundle has "
                f"{'a directory' if _real_dir(p) else 'a file'}; move it, or choose another destination"
            )


def _move_in(stage: Path, dest: Path, rel: str, moved: set[str]) -> None:
    """One entry of the stage into `dest`: a file over the one of its name, a folder file by file."""
    src = stage / rel
    if not _real_dir(src):
        os.replace(src, dest / rel)
        moved.add(rel)
        return
    (dest / rel).mkdir(exist_ok=True)
    for child in sorted(src.iterdir()):
        _move_in(stage, dest, f"{rel}/{child.name}", moved)


def bundle_files_listed(d: Path) -> set[str]:
    """The files a manifest in `d` lists (none when there is no readable manifest of ours)."""
    manifest = _manifest(d)
    return {f for f in manifest.files if "/" not in f} if manifest is not None else set()


def _unlink_file(p: Path) -> None:
    if p.is_symlink() or p.is_file():  # a folder someone put under one of our names is not ours
        p.unlink()


def _remove_files(d: Path, rels: set[str]) -> None:
    """Remove these files of `d`, then the folders they were in that this leaves empty (debug/<method>/)."""
    for rel in sorted(rels):
        _unlink_file(d / rel)
    folders = {d / parent for rel in rels for parent in map(str, Path(rel).parents) if parent != "."}
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        if _real_dir(folder) and not any(folder.iterdir()):
            folder.rmdir()


def _exchange(stage: Path, dest: Path) -> Path:
    """Swap the two directories; returns where the old one is now. Atomic where the kernel can exchange."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        rc = renameat2(_AT_FDCWD, os.fsencode(stage), _AT_FDCWD, os.fsencode(dest), _RENAME_EXCHANGE)
        if rc == 0:
            return stage
    # no exchange here (another OS, an old kernel, a filesystem without it): two renames; a kill between them
    # leaves `dest` missing and the old bundle in `old`, which sweep() puts back on the next run
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{stage.name.rsplit('-', 1)[-1]}")
    dest.rename(old)
    stage.rename(dest)
    return old


def _remove_old(old: Path, dest: Path) -> Path | None:
    """Delete the previous bundle's own files (`_own_files`), then its folder if nothing else is left in it; a
    folder with other files moves beside `dest` under a visible name (a hidden one would be swept later)."""
    _remove_files(old, _own_files(old))
    if not any(old.iterdir()):
        old.rmdir()
        return None
    kept = dest.with_name(f"{dest.name}.kept-{os.getpid()}")
    old.rename(kept)
    return kept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
