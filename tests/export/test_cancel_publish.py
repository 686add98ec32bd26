"""A stop requested (SIGTERM) before a bundle is published publishes nothing, even when the signal's exception
was swallowed on the way (torch's cleanup, a finalizer): every publish checks the cancellation right before it
swaps the bundle in, and a signal during the swap takes effect once it is done (issue 42, "SIGTERM then
publish"). Deterministic: the signal is raised by a monkeypatched step, no sleeps."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from runner import publish as pub
from runner.app import fetch
from runner.app.cli import main
from runner.bundle import MANIFEST_NAME, verify_bundle
from runner.errors import Cancellation, Terminated

try:
    from tests.github_stub import TOKEN, GitHubStub, fake_bundle_zip, write_fake_bundle
except ImportError:  # tests/ on sys.path rather than importable as a package
    from github_stub import TOKEN, GitHubStub, fake_bundle_zip, write_fake_bundle


def swallowed_sigterm() -> None:
    """SIGTERM, its exception lost on the way (as "Exception ignored in ..." loses it): only the cancellation
    the handler set is left to say a stop was asked for."""
    try:
        signal.raise_signal(signal.SIGTERM)
    except Terminated:
        pass


@pytest.fixture
def sigterm_raises():
    """The CLI's handler, for tests that call publish directly: cancel, then raise where the process is."""
    cancel = Cancellation()

    def handler(signum, frame):
        cancel.cancel()
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    yield cancel
    signal.signal(signal.SIGTERM, previous)


def test_an_export_told_to_stop_just_before_it_publishes_publishes_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "b"
    real = pub._check_directory

    def check_then_sigterm(dest: Path) -> None:
        real(dest)
        staged = [p for p in dest.parent.glob(f".{dest.name}.tmp-*") if (p / MANIFEST_NAME).exists()]
        if staged:  # the bundle is complete in its stage: this is the publish
            swallowed_sigterm()

    monkeypatch.setattr(pub, "_check_directory", check_then_sigterm)
    argv = ["export", "--preset", "tiny", "--device", "cpu", "--no-check", "--out", str(out)]
    assert main(argv) == 128 + signal.SIGTERM
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")] == ["error: terminated"]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_publish_checks_the_cancellation_and_leaves_both_directories(tmp_path):
    dest, stage = tmp_path / "b", tmp_path / ".b.tmp-1-x"
    write_fake_bundle(dest, seed=1)
    write_fake_bundle(stage, seed=2)
    cancel = Cancellation()
    cancel.cancel()
    with pytest.raises(Terminated):
        pub.publish(stage, dest, cancel=cancel)
    assert (dest / "tekken.json").read_text() == '{"seed": 1}' and verify_bundle(stage)
    with pytest.raises(Terminated):  # nor a first publish, where nothing is there yet
        pub.publish(stage, tmp_path / "new", cancel=cancel)
    assert not (tmp_path / "new").exists()


def test_a_sigterm_during_the_swap_takes_effect_once_it_is_done(tmp_path, monkeypatch, sigterm_raises):
    """After the exchange the stage's name holds the old bundle: a stop there must not leave it (nor let the
    caller's cleanup delete it with the user's files in it)."""
    dest, stage = tmp_path / "b", tmp_path / ".b.tmp-1-x"
    write_fake_bundle(dest, seed=1)
    write_fake_bundle(stage, seed=2)
    real = pub._remove_old

    def sigterm_then_remove(old: Path, d: Path):
        signal.raise_signal(signal.SIGTERM)
        return real(old, d)

    monkeypatch.setattr(pub, "_remove_old", sigterm_then_remove)
    with pytest.raises(Terminated):
        pub.publish(stage, dest, cancel=sigterm_raises)
    assert (dest / "tekken.json").read_text() == '{"seed": 2}' and verify_bundle(dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_a_fetch_told_to_stop_during_the_download_publishes_nothing(tmp_path, monkeypatch, sigterm_raises):
    real = fetch.download_zip

    def download_then_sigterm(*a, **k):
        digest = real(*a, **k)
        swallowed_sigterm()
        return digest

    monkeypatch.setattr(fetch, "download_zip", download_then_sigterm)
    dest = tmp_path / "dest"
    with GitHubStub("o/r") as gh:
        gh.add_run(1)
        gh.add_artifact(10, "bundle", 1, fake_bundle_zip(tmp_path))
        access = fetch.GitHubAccess(api_url=gh.api_url, token=TOKEN, retry=fetch.RetryPolicy(attempts=1))
        ref = fetch.ArtifactRef("o/r", "bundle", run_id=1)
        with pytest.raises(Terminated):
            fetch.fetch_artifact(ref, access, dest, progress=False, cancel=sigterm_raises)
    assert not dest.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name != "bundle-src-0") == []
