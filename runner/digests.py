"""File digests: sha256 of a file or a range of it, and the cache of digests already computed, keyed by the file's
identity, so a verified bundle is not hashed again at every load (runner/bundle.py verifies with it)."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def is_digest(s) -> bool:
    return isinstance(s, str) and len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    return sha256_range(path, 0, None, chunk)


def sha256_range(path: Path, offset: int, length: int | None, block: int = 1 << 20) -> str:
    """sha256 of `length` bytes at `offset` (to the end when None)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left is None or left > 0:
            data = f.read(block if left is None else min(block, left))
            if not data:
                break
            h.update(data)
            if left is not None:
                left -= len(data)
    return h.hexdigest()


def workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def default_cache_dir() -> Path:
    """The user cache: compiled `.so` files (export) and verified digests (runtime). The CLI may name another
    (VOXTRAL_RUNNER_CACHE, XDG_CACHE_HOME: runner/app/options.py)."""
    return Path.home() / ".cache" / "voxtral-runner"


class DigestCache:
    """Remembers the sha256 of files already hashed, keyed by (device, inode, size, mtime_ns, ctime_ns).

    A 3B bundle is ~9 GB: hashing it on every load would dominate load time. ctime changes on any write to the
    file (and cannot be set from user space), so a stat match means the bytes hashed earlier are still there;
    anything else is hashed again. The path is not in the key: the exporter hashes its files in a staging
    directory that is then renamed into place, and the first load must not hash them again.
    `rehash` ignores what is remembered (and remembers afresh)."""

    MAX_ENTRIES = 4096  # the oldest are dropped on save: the file must not grow with every bundle ever seen

    def __init__(self, path: Path | None = None, rehash: bool = False):
        self.path = path or default_cache_dir() / "digests.json"
        self.rehash = rehash
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError, RecursionError):
            entries = {}
        # only a cache: anything but {stat key: digest} is ignored, and rebuilt as files are hashed
        if not isinstance(entries, dict):
            entries = {}
        self.entries = {k: v for k, v in entries.items() if is_digest(v)}
        self.dirty = False

    @staticmethod
    def _key(p: Path) -> str:
        st = p.stat()
        return f"{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"

    def known(self, p: Path) -> str | None:
        if self.rehash:
            return None
        return self.entries.get(self._key(p))

    def remember(self, p: Path, digest: str) -> None:
        self.entries[self._key(p)] = digest
        self.dirty = True

    def sha256(self, p: Path) -> str:
        digest = self.known(p)
        if digest is None:
            digest = sha256_file(p)
            self.remember(p, digest)
        return digest

    def sha256_all(self, paths: list[Path]) -> list[str]:
        """Digests of several files, hashed in parallel (hashlib releases the GIL on large buffers), then saved."""
        with ThreadPoolExecutor(max_workers=min(8, len(paths) or 1)) as pool:
            digests = list(pool.map(self.sha256, paths))
        self.save()
        return digests

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(dict(list(self.entries.items())[-self.MAX_ENTRIES :])))
            tmp.replace(self.path)
        except OSError:
            pass  # a read-only cache only costs time
