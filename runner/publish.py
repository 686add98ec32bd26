"""Putting a finished directory (an exported or fetched bundle) at its destination without losing anything.

- At every instant the destination holds the old bundle or the new one: the two are exchanged in one atomic
  `renameat2(RENAME_EXCHANGE)` where the kernel has it; elsewhere two renames, with the old bundle kept in a
  sibling named after this process, which the next run puts back if it finds the destination missing.
- Only what we created is ever deleted: a destination is replaced only if it is one of our bundles (our manifest,
  the files it lists, nothing else); after the exchange only the old bundle's own files are removed, so a file
  someone wrote into it meanwhile stays (and is reported). Anything else is refused, or, when the caller allows
  it, the new bundle's files are moved in beside the other files, which are kept.
- Staging directories are named `.<dest>.tmp-<pid>-…` beside the destination; a run sweeps those of processes
  that are gone (killed mid-export) before it starts.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from pathlib import Path

from runner.bundle import MANIFEST_NAME, Manifest
from runner.errors import BundleError, RunnerError

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
PROVENANCE_NAME = "provenance.json"  # where `fetch` records the CI run and artifact a bundle came from
# a bundle's own entries besides the manifest and the files it lists
_OWN_EXTRAS = ("debug", PROVENANCE_NAME)


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
    """The entries of `d` that are its bundle's own (the manifest, the files it lists, a `debug/` folder), if `d`
    is one of our bundles and holds nothing else; else None."""
    manifest = _manifest(d)
    if manifest is None:
        return None
    own = {MANIFEST_NAME, *_OWN_EXTRAS, *(f.split("/")[0] for f in manifest.files)}
    names = {p.name for p in d.iterdir()}
    return names if names <= own else None


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
    if not dest.is_dir() or merge or not any(dest.iterdir()) or bundle_files(dest) is not None:
        return
    others = sorted(p.name for p in dest.iterdir())
    shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
    raise PublishError(
        f"{dest}: exists and is not a bundle of ours (it holds {shown}); refusing to replace it "
        "(choose another directory, or --force to add the bundle's files beside the others, which are kept)"
    )


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
    renames left aside (the destination missing). Only our own names, of processes that are gone."""
    removed = []
    for p in dest.parent.glob(f".{dest.name}.*-*"):
        kind, _, rest = p.name[len(dest.name) + 2 :].partition("-")
        pid = rest.split("-", 1)[0]
        if kind not in ("tmp", "old") or not pid.isdigit() or _alive(int(pid)) or not p.is_dir():
            continue
        if kind == "old" and not dest.exists() and bundle_files(p) is not None:
            p.rename(dest)  # the previous bundle, put back where it was
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def publish(stage: Path, dest: Path, *, merge: bool = False) -> Path | None:
    """Put `stage` at `dest`. Returns None, or the folder beside `dest` that now holds files which appeared in
    the old bundle while we worked (they are not ours to delete). `merge`: `dest` holds other files, which stay;
    the bundle's are added beside them."""
    _check_directory(dest)
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
    old = bundle_files_listed(dest)
    new = {p.name for p in stage.iterdir()}
    for name in sorted(new - {MANIFEST_NAME}):
        _replace(stage / name, dest / name)
    _replace(stage / MANIFEST_NAME, dest / MANIFEST_NAME)  # last: it points at files already in place
    for name in sorted(old - new):  # the previous bundle's files the new one does not have
        (dest / name).unlink(missing_ok=True)
    if old and PROVENANCE_NAME not in new:  # the old bundle's record would say where the new one came from
        (dest / PROVENANCE_NAME).unlink(missing_ok=True)
    shutil.rmtree(stage, ignore_errors=True)


def bundle_files_listed(d: Path) -> set[str]:
    """The files a manifest in `d` lists (none when there is no readable manifest of ours)."""
    manifest = _manifest(d)
    return {f for f in manifest.files if "/" not in f} if manifest is not None else set()


def _replace(src: Path, dst: Path) -> None:
    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)  # only a folder of the bundle's (debug/): the new one replaces it
    os.replace(src, dst)


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
    """Delete the previous bundle's own files, then its folder if nothing else is left in it; a folder with
    other files moves beside `dest` under a visible name (a hidden one would be swept later)."""
    for name in bundle_files_listed(old) | {MANIFEST_NAME, PROVENANCE_NAME}:
        (old / name).unlink(missing_ok=True)
    shutil.rmtree(old / "debug", ignore_errors=True)
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
