"""Export's own state (issue 23): the compile cache checks every entry against the digest in its name before a
copy of it can reach dlopen, and heals (a cut-short `.so` used to kill every later export with SIGBUS, and with
--no-check to publish a bundle whose digests all matched and whose `run` died the same way); a DEBUG=1 export keeps
the generated sources in DIR/debug/ whether it compiled or found the methods in the cache; every file of a bundle
has one mode, 0644."""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from runner.app.cli import main
from runner.bundle import MANIFEST_NAME, read_manifest, verify_bundle
from runner.digests import sha256_file
from runner.export.compile_cache import CompileCache

ROOT = Path(__file__).resolve().parents[2]
AUDIO = ROOT / "fixtures" / "audio" / "short.wav"
try:
    from tests.conftest import CACHE
except ImportError:  # tests/ on sys.path rather than importable as a package
    from conftest import CACHE

LIB = b"\x7fELF" + bytes(range(256)) * 64  # the bytes of a "library": the cache never loads what it holds


def _entry(root: Path, key: str, method: str, data: bytes = LIB) -> Path:
    cache = CompileCache(root)
    so = root.parent / f"{method}.built.so"
    so.write_bytes(data)
    return cache.store(key, method, so)


def test_an_entry_is_named_after_its_digest_and_comes_back_whole(tmp_path):
    entry = _entry(tmp_path / "c", "k", "audio_encoder")
    assert entry.name == f"audio_encoder.{sha256_file(entry)}.so"
    dest = tmp_path / "stage.so"
    assert CompileCache(tmp_path / "c").fetch("k", "audio_encoder", dest) and dest.read_bytes() == LIB


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(p.read_bytes()[: len(LIB) // 2]),  # cut short (the SIGBUS)
        lambda p: p.write_bytes(b""),  # emptied (an error naming a stage that no longer existed)
        lambda p: p.write_bytes(LIB[:100] + bytes([LIB[100] ^ 1]) + LIB[101:]),  # one flipped byte, same size
        lambda p: p.rename(p.with_name("audio_encoder.so")),  # an older runner's entry: no digest to check
    ],
    ids=["cut short", "0 bytes", "flipped byte", "no digest"],
)
def test_a_bad_entry_is_never_handed_out_and_is_removed_with_a_note(tmp_path, caplog, damage):
    root = tmp_path / "c"
    damage(_entry(root, "k", "audio_encoder"))
    dest = tmp_path / "stage.so"
    with caplog.at_level(logging.WARNING):
        assert not CompileCache(root).fetch("k", "audio_encoder", dest)
    assert not dest.exists() and list((root / "k").iterdir()) == []
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "compiling audio_encoder again" in notes[0] and str(root / "k") in notes[0]


def test_a_good_entry_is_found_behind_a_bad_one(tmp_path):
    root = tmp_path / "c"
    good = _entry(root, "k", "preprocessor")
    bad = good.with_name(f"preprocessor.{'0' * 64}.so")
    bad.write_bytes(LIB)  # newer, and not what its name says
    os.utime(bad, (good.stat().st_mtime + 10,) * 2)
    dest = tmp_path / "stage.so"
    assert CompileCache(root).fetch("k", "preprocessor", dest) and dest.read_bytes() == LIB
    assert not bad.exists() and good.exists()


def test_a_full_disk_under_the_stage_is_the_exports_error_and_keeps_the_entry(tmp_path, monkeypatch):
    """Copying a good entry onto a full disk fails the export ("No space left"); the entry is not the one at fault."""
    import errno

    import runner.export.compile_cache as cc

    entry = _entry(tmp_path / "c", "k", "preprocessor")

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(cc.shutil, "copyfile", full)
    with pytest.raises(OSError, match="No space left"):
        CompileCache(tmp_path / "c").fetch("k", "preprocessor", tmp_path / "stage.so")
    assert entry.read_bytes() == LIB


def test_a_cache_that_cannot_be_written_costs_only_time(tmp_path, caplog):
    (tmp_path / "c").write_text("a file where the cache directory belongs")
    so = tmp_path / "m.so"
    so.write_bytes(LIB)
    with caplog.at_level(logging.WARNING):
        assert CompileCache(tmp_path / "c").store("k", "m", so) is None
    assert "cannot write" in caplog.text and so.read_bytes() == LIB


def _python_m_runner(*argv, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runner", *map(str, argv)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=900,
    )


def _sizes(bundle: Path) -> list[str]:
    """The export options the bundle was made with: the same compile-cache keys."""
    m = read_manifest(bundle).model
    return ["--max-audio-chunks", str(m["max_audio_chunks"]), "--max-seq-len", str(m["max_seq_len"])]


def test_damaged_cache_entries_are_compiled_again_and_the_bundle_runs(tiny_bundle, tiny_checkpoint, tmp_path):
    """The tiny bundle's compiled methods in a cache of their own; one entry cut short, one emptied. `export
    --no-check` (in a process of its own: a SIGBUS kills it) compiles those two again with a note each, the
    bundle runs, and the cache holds good entries again. Before: exit 135 (SIGBUS), no message."""
    cache = tmp_path / "cache"
    libs = {
        m.name: read_manifest(tiny_bundle).files[m.library].sha256 for m in read_manifest(tiny_bundle).methods.values()
    }
    for method, digest in libs.items():  # the entries the tiny bundle was exported from (equal bytes: several keys)
        for entry in CACHE.glob(f"compiled/*/{method}.{digest}.so"):
            (cache / "compiled" / entry.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(entry, cache / "compiled" / entry.parent.name / entry.name)
    damaged = [*cache.glob(f"compiled/*/token_embedding.{libs['token_embedding']}.so"),
               *cache.glob(f"compiled/*/preprocessor.{libs['preprocessor']}.so")]  # fmt: skip
    for entry in damaged:  # cut short, and emptied
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2] if "token" in entry.name else b"")
    out, env = tmp_path / "bundle", {"VOXTRAL_RUNNER_CACHE": str(tmp_path / "digests")}

    r = _python_m_runner("export", "--checkpoint", tiny_checkpoint, *_sizes(tiny_bundle), "--no-check", "--out", out,
                         "--cache-dir", cache, env=env)  # fmt: skip
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    notes = [line for line in r.stderr.splitlines() if "compile cache:" in line]
    assert len(notes) == 2 and all(any(str(e) in n for e in damaged) for n in notes), notes
    assert read_manifest(out).model["compile_cached"] == {m: m not in ("token_embedding", "preprocessor") for m in libs}
    r = _python_m_runner("run", "--bundle", out, "--audio", AUDIO, "--max-new-tokens", 4, env=env)
    assert r.returncode == 0 and "error:" not in r.stderr, r.stderr[-3000:]
    for method in ("token_embedding", "preprocessor"):  # healed: the entries this export used are good again
        digest = read_manifest(out).files[f"{method}.so"].sha256
        assert any(sha256_file(e) == digest for e in cache.glob(f"compiled/*/{method}.{digest}.so"))


def test_debug_export_keeps_the_sources_when_it_compiles_and_when_the_cache_has_the_methods(
    tiny_bundle, tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    """DEBUG=1 (the seed's debug build): an AOTI debug compile, its generated C++ kept in DIR/debug/<method>/,
    not listed in the manifest (the bundle still verifies and runs). The second export finds every method in the
    compile cache and must still leave the sources (it left none before: only a compile wrote them)."""
    monkeypatch.setenv("DEBUG", "1")
    monkeypatch.setenv("VOXTRAL_RUNNER_CACHE", str(tmp_path / "digests"))
    for name in ("first", "second"):
        out = tmp_path / name
        argv = ["export", "--checkpoint", str(tiny_checkpoint), *_sizes(tiny_bundle), "--no-check", "--out", str(out),
                "--cache-dir", str(CACHE)]  # fmt: skip
        assert main(argv) == 0, capsys.readouterr().err[-3000:]
        m = verify_bundle(out)
        assert not any(rel.startswith("debug") for rel in m.files)
        for method in m.methods:
            assert list((out / "debug" / method).glob("*.cpp")), f"{name}: no generated sources for {method}"
        recorded = sorted(p.relative_to(out).as_posix() for p in (out / "debug").rglob("*") if p.is_file())
        assert m.model["debug_sources"] == recorded  # the sources are the bundle's own: a re-export replaces them
    assert all(read_manifest(tmp_path / "second").model["compile_cached"].values())
    capsys.readouterr()
    assert main(["run", "--bundle", str(tmp_path / "second"), "--audio", str(AUDIO), "--max-new-tokens", "4"]) == 0

    # exported again without DEBUG: the recorded sources go with the old bundle, a file of the user's stays
    monkeypatch.delenv("DEBUG")
    out = tmp_path / "first"
    (out / "debug" / "notes.txt").write_text("mine")
    argv = ["export", "--checkpoint", str(tiny_checkpoint), *_sizes(tiny_bundle), "--no-check", "--out", str(out),
            "--cache-dir", str(CACHE)]  # fmt: skip
    assert main(argv) == 1 and "debug/notes.txt" in capsys.readouterr().err  # refused: not the bundle's own
    (out / "debug" / "notes.txt").unlink()
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    assert not (out / "debug").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["digests", "first", "second"]


def test_every_file_of_a_bundle_has_one_mode(tiny_bundle):
    """0644 files in a 0755 directory: weights came out 0600 (safetensors) and the rest 0644."""
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tiny_bundle.iterdir()}
    assert set(modes.values()) == {0o644}, modes
    assert stat.S_IMODE(tiny_bundle.stat().st_mode) == 0o755 and MANIFEST_NAME in modes


def test_note_lines_name_the_entry(tmp_path, caplog):
    """The note is one line that a person can act on: the entry's path and the method."""
    root = tmp_path / "c"
    _entry(root, "k", "text_decoder").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        CompileCache(root).fetch("k", "text_decoder", tmp_path / "s.so")
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in msg and re.search(r"text_decoder\.[0-9a-f]{64}\.so does not hash to its name", msg)
