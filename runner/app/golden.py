"""Golden token files (fixtures/golden/*.json): the tokens a bundle must give for each fixture file, read by `run`
and `stream` alike.

Golden tokens are per model (weights digest) and per device-dtype: another bundle's numerics may legitimately pick
other tokens, so for those the eager reference is the check (`--reference eager`), and `--expect-tokens` with a file
that holds none for the bundle fails rather than checking nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from runner.bundle import Manifest
from runner.errors import RunnerError

SHAPE = '{"weights_digest": "...", "tokens": {"DEVICE-DTYPE": {"FILE": [ids]}}}'


def read_golden(path: Path, manifest: Manifest) -> dict[str, list[int]]:
    """{audio file name: token ids} for this bundle's model, device and dtype. A file without them is an error:
    `--expect-tokens` asks for a check, and a check that cannot run must not pass as one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON, or not UTF-8
        raise RunnerError(f"{path}: not a golden-token file ({' '.join(str(e).split())[:200]})") from None
    by_kind = data.get("tokens") if isinstance(data, dict) else None
    if not (isinstance(by_kind, dict) and isinstance(data.get("weights_digest"), str)) or not all(
        isinstance(files, dict)
        and all(isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids) for ids in files.values())
        for files in by_kind.values()
    ):
        raise RunnerError(f"{path}: not a golden-token file (expected {SHAPE})")
    ours = (manifest.model.get("source") or {}).get("weights_digest")
    if data["weights_digest"] != ours:
        raise RunnerError(
            f"{path}: golden tokens of another model (weights digest {data['weights_digest'][:12]}, this bundle's "
            f"{str(ours)[:12]}): --expect-tokens cannot check this bundle"
        )
    kind = device_kind(manifest)
    if kind not in by_kind:
        has = ", ".join(sorted(by_kind)) or "none"
        raise RunnerError(
            f"{path}: no golden tokens for this model on {kind} (it has {has}): --expect-tokens cannot check "
            "this bundle; leave it out, or check with --reference eager"
        )
    return {k: list(v) for k, v in by_kind[kind].items()}


def device_kind(manifest: Manifest) -> str:
    """The key a golden file files a bundle's tokens under."""
    return f"{manifest.device}-{manifest.dtype}"


def golden_mismatch(golden: list[int], ours: list[int]) -> int | None:
    """The index of the first token where ours and the golden ones differ, or None. Compared as a prefix, over
    the tokens both have, so any --max-new-tokens can be checked. Stopping early at </s> is no free pass: the
    </s> is one of our tokens, compared with the golden token at its index."""
    return next((i for i, (a, b) in enumerate(zip(golden, ours)) if a != b), None)
