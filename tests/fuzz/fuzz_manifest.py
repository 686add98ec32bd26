"""atheris: the bundle manifest parser (Manifest.from_json) and verify_bundle's structural checks on fuzzed
`model.pte` bytes. Only BundleError may escape; anything else is a crash atheris reports with its input.

    python tests/fuzz/fuzz_manifest.py [BUNDLE_DIR] -max_total_time=300 [CORPUS_DIR]     (nox -s fuzz)

With BUNDLE_DIR (a real bundle, default $VOXTRAL_FUZZ_BUNDLE), each input is also written as a copy's model.pte
and verified (sizes, paths, links, listed files; digests off, for speed), then read as the runner reads it before
any dlopen (compatibility, family and tokenizer, `inspect`): only RunnerError may escape those. A custom mutator edits the JSON tree
(replace or delete a value anywhere) half of the time, so inputs get past the format check and reach the
per-field code; the other half are libFuzzer's byte mutations.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared JSON-path helpers
from json_paths import mutate  # noqa: E402
from json_paths import paths as json_paths  # noqa: E402

with atheris.instrument_imports():
    from runner.app.inspect_bundle import render_manifest
    from runner.bundle import MANIFEST_NAME, Manifest, verify_bundle
    from runner.errors import BundleError, RunnerError
    from runner.families import family_for
    from runner.runtime.program import check_compatible

_VALUES = [
    None,
    True,
    0,
    -1,
    1,
    2**63,
    2**70,
    1.5,
    float("inf"),
    float("nan"),
    "",
    "x",
    "1024",
    "float8",
    "cuda",
    "text_decoder.so",
    "tekken.json",
    "../x.so",
    "/abs.so",
    "a\\b",
    "lib/x.so",
    [],
    {},
    [1],
    ["x"],
    {"a": 1},
    {"min": 1, "max": 0},
    {"min": 0, "max": 2**70},
    {"name": "x", "dtype": "float32", "shape": [1]},
    {"text": {}, "audio": {}},
]  # fmt: skip  (field types: every JSON type, and values of the right type but wrong)


def mutate_json(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        return atheris.Mutate(data, max_size)
    if rng.random() < 0.5 or not isinstance(d, dict):
        return atheris.Mutate(data, max_size)
    for _ in range(rng.randint(1, 3)):
        candidates = [p for p in json_paths(d) if p]
        if not candidates:
            break
        path = rng.choice(candidates)
        # a deep copy: a shared value could end up nested in itself
        mutate(d, path, "delete" if rng.random() < 0.3 else copy.deepcopy(rng.choice(_VALUES)))
    out = json.dumps(d).encode()
    return out[:max_size]


class Target:
    def __init__(self, bundle: Path | None):
        self.copy = None
        if bundle:
            self.copy = Path(tempfile.mkdtemp(prefix="fuzz-bundle-")) / "b"
            shutil.copytree(bundle, self.copy)

    def __call__(self, data: bytes) -> None:
        try:
            Manifest.from_json(data.decode("utf-8", errors="replace"))
        except BundleError:
            pass
        if self.copy is not None:
            (self.copy / MANIFEST_NAME).write_bytes(data)
            try:
                manifest = verify_bundle(self.copy, check_digests=False)
                consume(self.copy, manifest)
            except RunnerError:
                pass


def consume(bundle: Path, manifest) -> None:
    """What reads a verified manifest before any dlopen: the compatibility check, the family (its tokenizer), and
    `inspect`'s rendering. A field of a wrong type must be a RunnerError here too, not a TypeError."""
    check_compatible(manifest, bundle, manifest.device)
    family_for(bundle, manifest.model)
    with contextlib.redirect_stdout(io.StringIO()):
        render_manifest(manifest, bundle, verified=False)


def main() -> None:
    argv = list(sys.argv)
    bundle = os.environ.get("VOXTRAL_FUZZ_BUNDLE")
    if len(argv) > 1 and not argv[1].startswith("-") and (Path(argv[1]) / MANIFEST_NAME).is_file():
        bundle = argv.pop(1)
    target = Target(Path(bundle) if bundle else None)
    seeds = [a for a in argv[1:] if not a.startswith("-")]
    if bundle and seeds:  # seed the corpus with the real manifest
        Path(seeds[0]).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(bundle) / MANIFEST_NAME, Path(seeds[0]) / "model.pte")
    atheris.Setup(argv, target, custom_mutator=mutate_json)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
