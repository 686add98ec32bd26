"""The export job's summary (`ci_scripts/check_bundle.py --summary`): the files, the total size, the bundle digest
and each method's compile time, with the compile cache's part where the manifest records it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from runner.bundle import read_manifest, write_manifest

try:
    from tests.github_stub import write_fake_bundle
except ImportError:  # tests/ on sys.path rather than importable as a package
    from github_stub import write_fake_bundle

ROOT = Path(__file__).resolve().parents[2]


def check_bundle(bundle: Path, summary: Path) -> str:
    r = subprocess.run(
        [sys.executable, str(ROOT / "ci_scripts" / "check_bundle.py"), str(bundle), "--summary", str(summary)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return summary.read_text()


def table(text: str, head: str) -> list[list[str]]:
    lines = text.splitlines()
    i = lines.index(head)
    rows = []
    for line in lines[i + 2 :]:
        if not line.startswith("| "):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def with_model(bundle: Path, **model) -> None:
    m = read_manifest(bundle)
    write_manifest(bundle, type(m)(**{**m.__dict__, "model": {**m.model, **model}}))


def test_files_total_size_and_digest(tmp_path):
    bundle = tmp_path / "voxtral-bundle-fake-cpu-fp32"
    manifest = write_fake_bundle(bundle)
    text = check_bundle(bundle, tmp_path / "summary.md")
    digest = re.search(r"bundle digest `([0-9a-f]{64})`", text).group(1)
    assert text.startswith(f"### Bundle {bundle.name}\n")
    files = table(text, "| file | role | size | sha256 |")
    assert [r[0].strip("`") for r in files[:-1]] == ["model.pte", *sorted(manifest.files)]
    total = (bundle / "model.pte").stat().st_size + sum(e.size for e in manifest.files.values())
    assert files[-1] == ["**total**", "", f"**{total / 1024:.1f} KiB**", ""]
    assert f"{len(manifest.files) + 1} files, {total / 1024:.1f} KiB in all" in text
    assert files[0][3] == f"`{digest[:16]}`"
    assert "compile time per method: not recorded in the manifest" in text


def test_compile_time_per_method_and_whether_it_came_from_the_cache(tmp_path):
    bundle = tmp_path / "b"
    write_fake_bundle(bundle)
    with_model(
        bundle,
        compile_seconds={"audio_encoder": 41.234, "text_decoder": 0.05},
        compile_cached={"audio_encoder": False, "text_decoder": True},
    )
    text = check_bundle(bundle, tmp_path / "summary.md")
    rows = table(text, "| method | compile time | from the compile cache |")
    assert rows == [["audio_encoder", "41.2 s", "no"], ["text_decoder", "0.05 s", "yes"]]
    assert "compile time in all: 41.3 s" in text


def test_without_the_cache_record_only_the_time(tmp_path):
    bundle = tmp_path / "b"
    write_fake_bundle(bundle)
    with_model(bundle, compile_seconds={"preprocessor": 3.0, "token_embedding": 12.0})
    text = check_bundle(bundle, tmp_path / "summary.md")
    assert table(text, "| method | compile time |") == [["preprocessor", "3.00 s"], ["token_embedding", "12.0 s"]]
    assert "from the compile cache" not in text


def test_the_tiny_bundle_has_a_compile_time_for_every_method(tiny_bundle, tmp_path):
    text = check_bundle(tiny_bundle, tmp_path / "summary.md")
    manifest = read_manifest(tiny_bundle)
    header = next(line for line in text.splitlines() if line.startswith("| method | compile time"))
    assert [r[0].strip("`") for r in table(text, header)] == list(manifest.model["compile_seconds"])
    assert set(manifest.model["compile_seconds"]) == set(manifest.methods)
