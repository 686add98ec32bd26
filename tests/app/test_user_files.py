"""Files the runner did not make are never cut, appended to or deleted (issue 42, "User files"): `run --out` takes
only a results file of ours (every line one of our records), else one `error:` line naming it and the file as it
was; a re-export over a bundle keeps (or refuses over) `debug/` and `provenance.json` unless the bundle's own
records say they are its own. And folder runs do not lose or repeat work: an unreadable file is an error record,
a re-run from another directory skips what is done, a FIFO as `--out` is named, a refused run leaves no folders.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from runner import publish as pub
from runner.app.cli import main
from runner.app.results_file import ResultsFile
from runner.bundle import MANIFEST_NAME, read_manifest, verify_bundle, write_manifest
from runner.errors import Cancellation, RunnerError

try:
    from tests.github_stub import write_fake_bundle
except ImportError:  # tests/ on sys.path rather than importable as a package
    from github_stub import write_fake_bundle

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"
NAMES = ["short.wav", "silence.wav", "speech.wav"]
FAST = ["--max-new-tokens", "4"]


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def refused_run(tmp_path: Path, out: Path | str, capsys, *extra: str) -> str:
    """`run --out OUT` on a real audio file, refused before the (missing) bundle is read: its one error line."""
    argv = ["run", "--bundle", str(tmp_path / "no-bundle"), "--audio", str(AUDIO / "short.wav"), "--out", str(out)]
    assert main([*argv, *extra]) == 1
    (line,) = error_lines(capsys)
    return line


# ---------------------------------------------------------------- run --out: only our own results file


@pytest.mark.parametrize(
    "data",
    [
        b"my notes\nsecond line without a newline",  # a notes file: the torn-line repair cut its last line
        (AUDIO / "short.wav").read_bytes(),  # a recording given as --out by mistake
        b'{"audio": "x.wav", "text": "a dataset line, not a run record"}\n',  # another tool's JSON lines
        b'{"audio": "/a.wav", "error": "ours"}\nmy line\n{"audio": "/b.wav", "error": "ours"}\n',  # a line not ours
    ],
    ids=["notes", "wav", "other-jsonl", "a-foreign-line"],
)
def test_run_refuses_an_out_file_that_is_not_our_results_file_and_leaves_it_as_it_was(tmp_path, capsys, data):
    out = tmp_path / "mine.txt"
    out.write_bytes(data)
    line = refused_run(tmp_path, out, capsys)
    assert str(out) in line and "--out" in line and "not a results file of this runner" in line
    assert out.read_bytes() == data


def test_a_symlink_to_a_users_file_is_the_users_file(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"mine\nno newline at the end")
    link = tmp_path / "results.jsonl"
    link.symlink_to(notes)
    line = refused_run(tmp_path, link, capsys)
    assert str(link) in line and "not a results file of this runner" in line
    assert notes.read_bytes() == b"mine\nno newline at the end" and link.is_symlink()


def test_our_results_file_is_still_repaired_and_a_whole_last_line_gets_its_newline(tmp_path):
    out = tmp_path / "results.jsonl"
    whole = json.dumps({"audio": "/r/a.wav", "text": "hi", "tokens": [1]}).encode()
    torn = json.dumps({"audio": "/r/b.wav", "text": "cut", "tokens": [2, 3]}).encode()[:20]
    out.write_bytes(whole + b"\n" + torn)
    f = ResultsFile.open(out)
    f.close()
    assert out.read_bytes() == whole + b"\n" and any("incomplete last line" in n for n in f.notes)
    out.write_bytes(whole)  # whole, only its newline missing
    ResultsFile.open(out).close()
    assert out.read_bytes() == whole + b"\n"


def test_a_fifo_as_out_is_one_line_naming_it(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    line = refused_run(tmp_path, fifo, capsys)
    assert str(fifo) in line and "not a regular file" in line and "Illegal seek" not in line


@pytest.mark.parametrize("why", ["no-bundle", "output-dir"])
def test_a_refused_run_removes_only_the_folders_and_file_it_made_for_out(tmp_path, capsys, why):
    keep = tmp_path / "existing"
    keep.mkdir()
    out = keep / "new" / "deeper" / "results.jsonl"
    extra = []
    if why == "output-dir":  # refused after --out was opened: a transcript file there is not ours
        (tmp_path / "subs").mkdir()
        (tmp_path / "subs" / "short.txt").write_text("mine")
        extra = ["--output-dir", str(tmp_path / "subs"), "--output-format", "txt"]
    refused_run(tmp_path, out, capsys, *extra)
    assert keep.is_dir() and not (keep / "new").exists()


def test_a_refused_run_keeps_an_existing_empty_out_file(tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    out.write_bytes(b"")  # the user's (empty) file: not ours to remove
    refused_run(tmp_path, out, capsys)
    assert out.exists()


# ---------------------------------------------------------------- folder runs: nothing lost, nothing repeated


@pytest.fixture
def folder(tmp_path) -> Path:
    d = tmp_path / "audio"
    d.mkdir()
    for n in NAMES:
        shutil.copy(AUDIO / n, d / n)
    return d


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def test_an_unreadable_file_is_an_error_record_and_the_files_after_it_run(tiny_bundle, folder, tmp_path, monkeypatch):
    import runner.audio

    locked = folder / "locked.wav"  # sorts between the others
    shutil.copy(AUDIO / "short.wav", locked)
    locked.chmod(0)
    real = runner.audio.check_wav_not_truncated

    def denied(path):  # what the OS answers a user without read permission (root reads a 0000 file anyway)
        if Path(path).name == "locked.wav":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(runner.audio, "check_wav_not_truncated", denied)
    out = tmp_path / "results.jsonl"
    assert main(["run", "--bundle", str(tiny_bundle), *FAST, "--audio-dir", str(folder), "--out", str(out)]) == 1
    recs = records(out)
    assert sorted(Path(r["audio"]).name for r in recs if "error" not in r) == sorted(NAMES)
    (bad,) = [r for r in recs if "error" in r]
    assert Path(bad["audio"]).name == "locked.wav" and "Permission denied" in bad["error"]


def test_a_rerun_from_another_directory_skips_what_is_done(tiny_bundle, folder, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["run", "--bundle", str(tiny_bundle), *FAST]
    assert main([*argv, "--audio-dir", "audio", "--out", "results.jsonl"]) == 0
    first = records(tmp_path / "results.jsonl")
    assert [r["audio"] for r in first] == [os.path.join("audio", n) for n in NAMES]  # as the user named them
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    # the bundle is gone: the skip is decided before any load
    gone = ["run", "--bundle", str(tmp_path / "gone"), *FAST]
    assert main([*gone, "--audio-dir", "../audio", "--out", "../results.jsonl"]) == 0
    assert "skipping 3 of 3 file(s)" in capsys.readouterr().err
    assert records(tmp_path / "results.jsonl") == first


# ---------------------------------------------------------------- re-export / re-fetch over a bundle


def add_debug_record(bundle: Path, rel: list[str]) -> None:
    """A debug build's bundle: its sources under debug/, recorded in its manifest as its own."""
    for r in rel:
        (bundle / r).parent.mkdir(parents=True, exist_ok=True)
        (bundle / r).write_text(f"// generated {r}")
    m = read_manifest(bundle)
    m.model["debug_sources"] = sorted(rel)
    write_manifest(bundle, m)


def add_fetched_provenance(bundle: Path) -> None:
    """What fetch writes beside the bundle it fetched: the manifest's sha256 binds the record to it."""
    digest = hashlib.sha256((bundle / MANIFEST_NAME).read_bytes()).hexdigest()
    (bundle / pub.PROVENANCE_NAME).write_text(json.dumps({"repository": "o/r", "bundle_digest": digest}))


@pytest.mark.parametrize(
    "path, data",
    [("debug/notes.txt", b"my notes"), (pub.PROVENANCE_NAME, b'{"mine": true}')],
    ids=["debug-notes", "provenance"],
)
def test_export_refuses_over_a_bundle_holding_a_users_debug_or_provenance_file(tmp_path, capsys, path, data):
    out = tmp_path / "b"
    write_fake_bundle(out)  # no debug build, never fetched
    (out / path).parent.mkdir(parents=True, exist_ok=True)
    (out / path).write_bytes(data)
    assert main(["export", "--preset", "tiny", "--device", "cpu", "--no-check", "--out", str(out)]) == 1
    (line,) = error_lines(capsys)
    assert str(out) in line and path in line and "--force" in line
    assert (out / path).read_bytes() == data and verify_bundle(out)


@pytest.mark.parametrize(
    "path, data",
    [("debug/notes.txt", b"my notes"), (pub.PROVENANCE_NAME, b'{"mine": true}')],
    ids=["debug-notes", "provenance"],
)
def test_publishing_over_a_bundle_keeps_a_users_file_that_appeared_in_it(tmp_path, path, data):
    dest, stage = tmp_path / "b", tmp_path / ".b.tmp-1-x"
    write_fake_bundle(dest, seed=1)
    write_fake_bundle(stage, seed=2)
    pub.check_destination(dest, merge=False)
    (dest / path).parent.mkdir(parents=True, exist_ok=True)
    (dest / path).write_bytes(data)  # after the check, before the swap
    kept = pub.publish(stage, dest, cancel=Cancellation())
    assert kept is not None and (kept / path).read_bytes() == data
    assert verify_bundle(dest) and not (dest / path).exists()


@pytest.mark.parametrize(
    "path, data",
    [("debug/notes.txt", b"my notes"), (pub.PROVENANCE_NAME, b'{"mine": true}')],
    ids=["debug-notes", "provenance"],
)
def test_force_keeps_a_users_debug_or_provenance_file_beside_the_new_bundle(tmp_path, path, data):
    dest, stage = tmp_path / "b", tmp_path / ".b.tmp-1-x"
    write_fake_bundle(dest, seed=1)
    (dest / path).parent.mkdir(parents=True, exist_ok=True)
    (dest / path).write_bytes(data)
    write_fake_bundle(stage, seed=2)
    add_debug_record(stage, ["debug/m/a.cpp"])  # the new bundle brings its own debug/ folder
    assert pub.publish(stage, dest, merge=True, cancel=Cancellation()) is None
    assert (dest / path).read_bytes() == data and (dest / "debug/m/a.cpp").exists() and verify_bundle(dest)


def test_the_bundles_own_debug_sources_and_provenance_go_with_it(tmp_path):
    dest, stage = tmp_path / "b", tmp_path / ".b.tmp-1-x"
    write_fake_bundle(dest, seed=1)
    add_debug_record(dest, ["debug/m/a.cpp", "debug/m/a.h"])
    add_fetched_provenance(dest)
    pub.check_destination(dest, merge=False)  # all of it the bundle's own: it may be replaced
    write_fake_bundle(stage, seed=2)
    assert pub.publish(stage, dest, cancel=Cancellation()) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    assert not (dest / "debug").exists() and not (dest / pub.PROVENANCE_NAME).exists()


def test_a_recorded_debug_folder_with_a_users_file_in_it_is_refused_naming_that_file(tmp_path):
    dest = tmp_path / "b"
    write_fake_bundle(dest, seed=1)
    add_debug_record(dest, ["debug/m/a.cpp"])
    (dest / "debug" / "m" / "notes.txt").write_text("mine")
    with pytest.raises(RunnerError, match="debug/m/notes.txt"):
        pub.check_destination(dest, merge=False)
