"""A repeated `export` answered before torch is imported.

The pipeline knows exactly whether --out holds the bundle an export would build (`pipeline.up_to_date`), but
only once the model is built and planned, torch imported, which is most of a no-op export's time. Here
the request itself is keyed (the command's options, every runner source, each installed distribution's version,
the files the model is read from) and remembered per --out with the digest of the manifest the export left
there. The same request over that same bundle (its manifest unchanged, every file verified) is up to date at
once; anything else goes the whole way, where the exact check still spares the compile and the writes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path

from runner.bundle import MANIFEST_NAME, verify_bundle
from runner.digests import DigestCache, sha256_file
from runner.errors import BundleError
from runner.fixtures import fixtures_dir

REMEMBERED = "exports.json"  # in the cache dir: {resolved --out: {"request": key, "manifest": sha256}}
NOT_OPTIONS = ("fn", "verb", "verbose", "debug", "env", "cancel")  # the CLI's own plumbing, not what is built


def request_key(args: argparse.Namespace, env_fields: dict) -> str | None:
    """The request's key; None where it cannot be told without torch or the model: no --device (the default asks
    CUDA), no --out (the default is named after the model), or not a build (--regenerate)."""
    if args.device is None or args.out is None or args.regenerate is not None:
        return None
    runner_dir = Path(__file__).resolve().parents[1]
    sources = hashlib.sha256()
    for path in sorted(runner_dir.rglob("*.py")):
        sources.update(path.relative_to(runner_dir).as_posix().encode() + b"\0" + path.read_bytes())
    inputs = [fixtures_dir()] + ([Path(args.checkpoint)] if args.checkpoint else [])
    blob = {
        "options": {k: str(v) for k, v in sorted(vars(args).items()) if k not in NOT_OPTIONS},
        "environment": {k: str(v) for k, v in sorted(env_fields.items())},
        "runner": sources.hexdigest(),
        "installed": sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()),
        "python": sys.version,
        "inputs": [_identity(p) for p in inputs],
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def _identity(root: Path) -> list:
    """Each file under `root` by name, size and modification time (its bytes are the exact check's to hash)."""
    root = root.resolve()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def is_fresh(out: Path, key: str, cache_dir: Path) -> bool:
    """`out` holds the bundle this request left there: its manifest unchanged since and every file verified."""
    entry = _read(cache_dir).get(str(out.resolve()))
    if not isinstance(entry, dict) or entry.get("request") != key:
        return False
    try:
        if sha256_file(out / MANIFEST_NAME) != entry.get("manifest"):
            return False
        verify_bundle(out, digests=DigestCache(cache_dir / "digests.json"))
    except (BundleError, OSError):
        return False
    return True


def remember(out: Path, key: str, cache_dir: Path) -> None:
    """Record that this request left the bundle now at `out`. Only a cache: failing to write it costs time."""
    try:
        known = _read(cache_dir)
        known[str(out.resolve())] = {"request": key, "manifest": sha256_file(out / MANIFEST_NAME)}
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f".{REMEMBERED}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        tmp.replace(cache_dir / REMEMBERED)
    except OSError:
        pass


def _read(cache_dir: Path) -> dict:
    try:
        known = json.loads((cache_dir / REMEMBERED).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}
