"""A downloaded artifact's zip laid out safely: nothing written outside the destination (absolute or '..' paths,
links, special files), members and bytes capped, a bundle's members bounded by its manifest before they are
written, and the disk's room checked first. Used by `fetch` (runner/app/fetch.py)."""

from __future__ import annotations

import re
import stat
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from runner.bundle import MANIFEST_NAME, MAX_MANIFEST_BYTES, read_manifest
from runner.errors import BundleError, FetchError
from runner.publish import free_bytes

MAX_ARCHIVE_BYTES = 64 << 30  # well past the largest bundle we build: anything bigger is not ours
MAX_MEMBERS = 10_000
CHUNK = 1 << 20


def _unsafe(info: zipfile.ZipInfo) -> str | None:
    name = info.filename
    parts = PurePosixPath(name).parts
    if not name or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or "\\" in name or "\0" in name:
        return "an absolute or non-POSIX path"
    if ".." in parts:
        return "a '..' path"
    mode = info.external_attr >> 16
    kind = stat.S_IFMT(mode)
    if kind == stat.S_IFLNK:
        return "a symbolic link"
    if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
        return "a special file"
    if info.flag_bits & 0x1:
        return "an encrypted member"
    return None


def extract_zip(archive: Path, dest: Path, *, max_bytes: int = MAX_ARCHIVE_BYTES, bundle: bool = False) -> None:
    """Extract into the (new, empty) `dest`, refusing anything that could write outside it. Every member is
    bounded by the size the zip declares for it (zipfile stops there) and all of them by `max_bytes`. With `bundle`,
    the manifest is extracted first and bounds the rest: every other member must be a file it lists, of the size
    it gives, so a small zip that inflates far past what its manifest says it holds is refused before any of it is
    written. Raises FetchError, or BundleError for a bundle whose manifest is missing or malformed."""
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError):
        raise FetchError(f"{archive.name}: not a zip archive") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > MAX_MEMBERS:
            raise FetchError(f"unsafe archive: {len(infos)} members (cap {MAX_MEMBERS})")
        seen: set[str] = set()
        for info in infos:
            why = _unsafe(info)
            if why:
                raise FetchError(f"unsafe archive: member {info.filename!r} is {why}")
            key = info.filename.rstrip("/")
            if key in seen:
                raise FetchError(f"unsafe archive: member {info.filename!r} appears twice")
            seen.add(key)
        declared = sum(i.file_size for i in infos)
        if declared > max_bytes:
            raise FetchError(f"unsafe archive: {declared} bytes uncompressed is over the {max_bytes}-byte cap")
        first = []
        if bundle:
            first = [i for i in infos if i.filename == MANIFEST_NAME]
            _bundle_sizes(zf, infos, first, dest, max_bytes)
        _check_space(dest, declared - sum(i.file_size for i in first))
        for info in infos:
            if info not in first:
                _extract_member(zf, info, dest)


def _bundle_sizes(zf: zipfile.ZipFile, infos: list[zipfile.ZipInfo], manifest: list, dest: Path, cap: int) -> None:
    """Extract the manifest (`manifest`: its member) and check every other member against it."""
    if not manifest:
        raise BundleError(f"{dest / MANIFEST_NAME}: missing (is the artifact a bundle?)")
    if manifest[0].file_size > MAX_MANIFEST_BYTES:
        raise FetchError(f"unsafe archive: {MANIFEST_NAME} is {manifest[0].file_size} bytes (cap {MAX_MANIFEST_BYTES})")
    _extract_member(zf, manifest[0], dest)
    sizes = {rel: e.size for rel, e in read_manifest(dest).files.items()}
    if sum(sizes.values()) > cap:
        raise FetchError(f"unsafe archive: {MANIFEST_NAME} lists {sum(sizes.values())} bytes, over the {cap}-byte cap")
    for info in infos:
        if info.is_dir() or info is manifest[0]:
            continue
        if info.filename not in sizes:
            raise FetchError(
                f"unsafe archive: member {info.filename!r} is not a file {MANIFEST_NAME} lists "
                "(a bundle artifact holds the manifest and its files)"
            )
        if info.file_size != sizes[info.filename]:
            raise FetchError(
                f"unsafe archive: member {info.filename!r} holds {info.file_size} bytes, "
                f"{MANIFEST_NAME} says {sizes[info.filename]}"
            )


def _check_space(dest: Path, need: int) -> None:
    """Refuse before writing what the disk cannot hold (a 10 GB bundle must not fill it, then fail)."""
    try:
        free = free_bytes(dest)  # the one probe fetch's and export's room checks read
    except OSError:
        return
    if need > free:
        raise FetchError(f"{dest.parent}: the archive needs {need} bytes once extracted, {free} are free")


def _extract_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, dest: Path) -> None:
    target = dest.joinpath(*PurePosixPath(info.filename).parts)
    try:
        if info.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(info) as src, open(target, "xb") as out:
            while block := src.read(CHUNK):  # zipfile stops at the declared size (a CRC error past it)
                out.write(block)
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error, NotImplementedError, RuntimeError, ValueError) as e:
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]  # an unknown compression, bad deflate data
        raise FetchError(f"archive member {info.filename!r}: {why}") from None
