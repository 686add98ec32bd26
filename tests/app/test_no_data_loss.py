"""Nothing the user owns is ever deleted, and an interrupted export or fetch leaves nothing behind (issue 23,
"Data loss" and "Interruptions"): a destination that is not one of our bundles is refused (or, with --force,
the bundle's files are added beside what is there); a file that appears in the old bundle while we work is kept;
at every instant the destination holds the old bundle or the new one; a killed run's stage is swept by the next;
SIGTERM unwinds like Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner import publish as pub
from runner.app import fetch
from runner.app.cli import main
from runner.bundle import verify_bundle
from runner.errors import Cancellation, FetchError

try:
    from tests.github_stub import TOKEN, GitHubStub, fake_bundle_zip, write_fake_bundle
except ImportError:  # tests/ on sys.path rather than importable as a package
    from github_stub import TOKEN, GitHubStub, fake_bundle_zip, write_fake_bundle

ROOT = Path(__file__).resolve().parents[2]


def user_dir(d: Path) -> dict[str, bytes]:
    """A directory of the user's: an ExecuTorch program named model.pte (not our manifest) and other files."""
    d.mkdir(parents=True)
    files = {"model.pte": b"\x00ET program, not JSON", "notes.txt": b"mine", "data.bin": os.urandom(64)}
    for name, data in files.items():
        (d / name).write_bytes(data)
    return files


def contents(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


# ---------------------------------------------------------------- export --out


def test_export_refuses_a_directory_that_is_not_our_bundle_before_compiling(tmp_path, capsys):
    out = tmp_path / "mine"
    files = user_dir(out)
    assert main(["export", "--preset", "tiny", "--device", "cpu", "--out", str(out)]) == 1
    line = one_error_line(capsys)
    assert str(out) in line and "not a bundle of ours" in line and "model.pte" in line and "--force" in line
    assert contents(out) == files  # nothing lost
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]  # nothing left behind


def test_export_with_force_adds_the_bundle_beside_the_users_files(tmp_path, tiny_bundle, capsys):
    out = tmp_path / "mine"
    files = user_dir(out)
    del files["model.pte"]  # the one name the bundle takes: --force replaces it, as asked
    assert main(["export", "--preset", "tiny", "--device", "cpu", "--no-check", "--force", "--out", str(out)]) == 0
    got = contents(out)
    assert {k: got[k] for k in files} == files
    verify_bundle(out)  # a bundle, whose manifest lists its own files only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


# ---------------------------------------------------------------- the publish step


def test_replacing_our_bundle_keeps_a_file_written_into_it_meanwhile(tmp_path):
    dest, stage = tmp_path / "b", tmp_path / ".b.tmp-1-x"
    write_fake_bundle(dest, seed=1)
    write_fake_bundle(stage, seed=2)
    pub.check_destination(dest, merge=False)  # ours: may be replaced
    (dest / "written-meanwhile.txt").write_text("not ours")  # between the check and the swap
    kept = pub.publish(stage, dest, cancel=Cancellation())
    assert verify_bundle(dest).model["preset"] == "fake" and (dest / "tekken.json").read_text() == '{"seed": 2}'
    assert kept is not None and contents(kept) == {"written-meanwhile.txt": b"not ours"}
    assert not stage.exists()


def test_a_kill_between_two_renames_leaves_the_old_bundle_which_the_next_run_puts_back(tmp_path, monkeypatch):
    """Without an atomic exchange the swap is two renames; a kill after the first leaves the destination
    missing and the old bundle in a sibling named after the dead process: the next run's sweep restores it."""
    dest = tmp_path / "b"
    write_fake_bundle(dest, seed=1)
    aside = tmp_path / f".b.old-{dead_pid()}-x"
    dest.rename(aside)  # where the first rename left it
    stale = tmp_path / f".b.tmp-{dead_pid()}-y"  # and the killed run's stage
    write_fake_bundle(stale, seed=2)
    live = tmp_path / f".b.tmp-{os.getpid()}-z"  # a running export's stage is not touched
    live.mkdir()
    stage = pub.make_stage(dest)
    assert verify_bundle(dest) and (dest / "tekken.json").read_text() == '{"seed": 1}'  # the old one, back
    assert (
        not aside.exists() and not stale.exists() and live.is_dir() and stage.name.startswith(f".b.tmp-{os.getpid()}-")
    )


def test_the_two_rename_fallback_publishes_and_removes_only_the_old_bundles_files(tmp_path, monkeypatch):
    dest, stage = tmp_path / "b", tmp_path / ".b.tmp-1-x"
    write_fake_bundle(dest, seed=1)
    write_fake_bundle(stage, seed=2)
    monkeypatch.setattr(pub, "_RENAME_EXCHANGE", 1 << 30)  # an exchange the kernel refuses: the fallback runs
    assert pub.publish(stage, dest, cancel=Cancellation()) is None
    assert (dest / "tekken.json").read_text() == '{"seed": 2}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


# ---------------------------------------------------------------- fetch --dest


@pytest.fixture
def gh():
    with GitHubStub("o/r") as stub:
        yield stub


def get(stub, dest: Path, **kw):
    access = fetch.GitHubAccess(
        api_url=stub.api_url, token=TOKEN, retry=fetch.RetryPolicy(attempts=2, backoff=0.01), sleep=lambda s: None
    )
    return fetch.fetch_artifact(fetch.ArtifactRef("o/r", "bundle", run_id=1), access, dest, progress=False, **kw)


def test_fetch_refuses_when_files_appear_in_dest_during_the_download(gh, tmp_path, monkeypatch):
    gh.add_run(1)
    gh.add_artifact(10, "bundle", 1, fake_bundle_zip(tmp_path))
    dest = tmp_path / "dest"
    real = fetch.download_zip

    def slow(*a, **k):  # the user saves a file into the (empty) destination while the zip downloads
        digest = real(*a, **k)
        dest.mkdir(exist_ok=True)
        (dest / "saved-meanwhile.txt").write_text("mine")
        return digest

    monkeypatch.setattr(fetch, "download_zip", slow)
    with pytest.raises(FetchError, match="files appeared in it during the download; nothing was replaced"):
        get(gh, dest)
    assert contents(dest) == {"saved-meanwhile.txt": b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("bundle-src")) == ["dest"]


def test_fetch_force_keeps_the_users_files_beside_the_bundle(gh, tmp_path):
    gh.add_run(1)
    gh.add_artifact(10, "bundle", 1, fake_bundle_zip(tmp_path))
    dest = tmp_path / "dest"
    files = user_dir(dest)
    del files["model.pte"]
    get(gh, dest, force=True)
    assert {k: contents(dest)[k] for k in files} == files
    verify_bundle(dest)


# ---------------------------------------------------------------- SIGTERM


@pytest.mark.slow  # timed (a real signal into a compiling process); tests/export/test_cancel_publish.py is not
def test_sigterm_during_an_export_leaves_nothing_behind(tmp_path):
    """What `timeout`, a CI cancellation and a closed terminal send: one `error:` line, exit 143, the stage
    (gigabytes for a 3B bundle) removed. A cold compile cache keeps the export busy long enough."""
    out = tmp_path / "b"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "runner", "export", "--preset", "tiny", "--device", "cpu", "--out", str(out)]
    proc = subprocess.Popen(
        [*cmd, "--cache-dir", str(tmp_path / "cold")], env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".b.tmp-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert list(tmp_path.glob(".b.tmp-*")), "the export never started its stage"
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert [line for line in err.splitlines() if line.startswith("error:")] == ["error: terminated"]
    assert not out.exists() and not list(tmp_path.glob(".b.*"))


def test_whatever_unwinds_after_sigterm_is_reported_as_the_termination(tmp_path, monkeypatch, capsys):
    """SIGTERM raises Terminated where the process is; torch's own cleanup may replace it on the way out (seen in
    CI: "Trying to pop empty mode stack" from a trace the signal interrupted). Still one `error: terminated` line
    and exit 143, not a traceback and exit 1."""
    import runner.app.inspect_bundle as verb
    from runner.app.cli import main

    def interrupted_then_replaced(args):
        args.cancel.cancel()  # what the SIGTERM handler does before it raises
        raise AssertionError("Trying to pop empty mode stack")

    monkeypatch.setattr(verb, "main", interrupted_then_replaced)
    assert main(["inspect", str(tmp_path)]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines() == ["error: terminated"]

    def plain_bug(args):
        raise AssertionError("a bug, no signal")

    monkeypatch.setattr(verb, "main", plain_bug)
    with pytest.raises(AssertionError, match="a bug, no signal"):  # without SIGTERM an unexpected error stays one
        main(["inspect", str(tmp_path)])
