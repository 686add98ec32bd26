"""Odd GitHub API answers end as one `error:` line or a clean retry, never a traceback (issue 23): a negative or
NaN retry-after, a NaN or absurd rate-limit reset, a list where an object belongs, an artifact without an id, an
unparseable date, a body that is not JSON, a `next` link that never ends, a token no header can carry. Then a
property over many answers at once: whatever GitHub answers, `fetch` returns a verified bundle or raises FetchError,
waits only finite, bounded times, and leaves nothing behind. tests/fuzz/fuzz_github.py runs the same for longer.

The answers come from tests/github_fake.py (no sockets); the CLI cases go through `python -m runner fetch`'s
main() with the fake in place of requests."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.app import fetch, github
from runner.app.cli import main
from runner.bundle import verify_bundle
from runner.errors import FetchError
from runner.publish import PROVENANCE_NAME

try:
    from tests import github_fake as fake
    from tests.github_stub import fake_bundle_zip
except ImportError:  # tests/ on sys.path rather than importable as a package
    import github_fake as fake
    from github_stub import fake_bundle_zip

API, ARTIFACT_ID, NAME, REPO, RUN_ID, TOKEN = fake.API, fake.ARTIFACT_ID, fake.NAME, fake.REPO, fake.RUN_ID, fake.TOKEN
FakeGitHub, Odd = fake.FakeGitHub, fake.Odd
MAX_WAIT = fetch.RetryPolicy().max_wait


def real_sleep_rules(seconds: float) -> None:
    """time.sleep's own refusals (NaN, negative), without the waiting."""
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"sleep length {seconds} is not allowed")


@pytest.fixture(scope="module")
def zip_bytes(tmp_path_factory) -> bytes:
    return fake_bundle_zip(tmp_path_factory.mktemp("zip"))


def fake_for(zip_bytes: bytes, answers: dict[str, list[Odd]]) -> FakeGitHub:
    """The fake, with `answers[path part]` edits on the first request whose URL holds that part."""
    pending = dict(answers)

    def odd(i: int) -> list[Odd]:
        url = gh.requests[i]
        part = next((p for p in pending if p in url), None)
        return pending.pop(part) if part is not None else []

    gh = FakeGitHub(zip_bytes, odd)
    return gh


@pytest.fixture
def via_cli(monkeypatch, tmp_path, capsys):
    """Run `fetch` through the CLI against a fake; returns (exit code, error lines, stdout, the fake)."""
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    monkeypatch.delenv("GH_TOKEN", raising=False)

    def go(gh: FakeGitHub, *extra: str, token: str | None = None):
        if token is not None:
            monkeypatch.setenv("GITHUB_TOKEN", token)
        monkeypatch.setattr(github.requests, "Session", lambda: gh)
        monkeypatch.setattr(requests, "get", gh.storage_get)

        def sleep(s):
            real_sleep_rules(s)
            gh.sleep(s)

        monkeypatch.setitem(fetch.GitHubAccess.__init__.__kwdefaults__, "sleep", sleep)
        dest = tmp_path / "dl" / "bundle"
        dest.parent.mkdir(exist_ok=True)
        argv = ["fetch", "--repo", REPO, "--name", NAME, "--dest", str(dest), "--no-progress", "--api-url", API]
        capsys.readouterr()
        code = main([*argv, *(extra or ("--run-id", str(RUN_ID)))])
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        if code != 0:
            assert len(errors) == 1, err
            assert list(dest.parent.iterdir()) == [], "a failed fetch left files behind"
        else:
            assert errors == [] and out.strip() == str(dest)
            verify_bundle(dest)
        assert all(math.isfinite(s) and 0 <= s <= MAX_WAIT for s in gh.sleeps), gh.sleeps
        return code, errors, gh

    return go


RUN = f"/runs/{RUN_ID}"
ARTIFACTS = f"/runs/{RUN_ID}/artifacts"

# case -> (edits by URL part, exit code, a needle of the error line or None)
CASES = {
    "negative retry-after (429)": ({RUN: [Odd("status", value=429), Odd("header", "retry-after", "-5")]}, 0, None),
    "NaN retry-after (503)": ({RUN: [Odd("status", value=503), Odd("header", "retry-after", "nan")]}, 0, None),
    "NaN rate-limit reset": (
        {
            RUN: [
                Odd("status", value=403),
                Odd("header", "x-ratelimit-remaining", "0"),
                Odd("header", "x-ratelimit-reset", "nan"),
            ]
        },
        0,
        None,
    ),  # fmt: skip
    "a reset past year 9999": (
        {
            RUN: [
                Odd("status", value=403),
                Odd("header", "x-ratelimit-remaining", "0"),
                Odd("header", "x-ratelimit-reset", "1e300"),
            ]
        },
        0,
        None,
    ),  # fmt: skip
    "a list where the run object belongs": ({RUN: [Odd("body", value=[1, 2])]}, 1, "not an object"),
    "artifacts that are not a list": ({ARTIFACTS: [Odd("body", value={"artifacts": {"id": 1}})]}, 1, "not a list"),
    "an artifact without an id": (
        {ARTIFACTS: [Odd("body", value={"artifacts": [{"name": NAME, "expired": False}]})]},
        1,
        "no usable id",
    ),
    "an unparseable created_at": (
        {ARTIFACTS: [Odd("body", value={"artifacts": [{"id": ARTIFACT_ID, "name": NAME, "created_at": "yesterday"}]})]},
        0,
        None,
    ),  # fmt: skip
    "a 200 answer that is not JSON": ({RUN: [Odd("raw", value=b"<html>proxy</html>")]}, 1, "not JSON"),
    "a next link to itself, forever": (
        {ARTIFACTS: [Odd("header", "link", f'<{API}/repos/{REPO}/actions/runs/1/artifacts>; rel="next"')]},
        1,
        "did not end",
    ),  # fmt: skip
    "a bad port in the storage redirect": (
        {"/zip": [Odd("header", "location", "https://blob.example.test:99999/x")]},
        1,
        "not a usable URL",
    ),
    "an unparseable storage redirect": ({"/zip": [Odd("header", "location", "http://[::1")]}, 1, "redirect"),
    "a content-length that is not a number": ({"blobs/": [Odd("header", "content-length", "many")]}, 0, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_odd_answer_is_one_line_or_a_clean_retry(case, zip_bytes, via_cli):
    answers, want, needle = CASES[case]
    code, errors, gh = via_cli(fake_for(zip_bytes, answers))
    assert code == want, errors
    if needle:
        assert needle in errors[0], errors


def test_an_endless_list_of_foreign_runs_ends(zip_bytes, via_cli):
    """--latest skips runs of forks without counting them: a `next` link that never ends must still stop."""
    loop = f'<{API}/repos/{REPO}/actions/runs?page=2>; rel="next"'
    odd = [Odd("body", value={"workflow_runs": [{"id": 5, "head_repository": {"full_name": "a/fork"}}]}),
           Odd("header", "link", loop)]  # fmt: skip
    gh = FakeGitHub(zip_bytes, lambda i: odd)
    code, errors, gh = via_cli(gh, "--latest")
    assert code == 1 and "did not end" in errors[0] and len(gh.requests) <= github.MAX_PAGES + 1


@pytest.mark.parametrize("token", ["ghp_\u20ac\u20ac", "ghp_\x07x", "ghp_tab\tx"])
def test_a_token_no_header_can_carry_is_one_line(token, zip_bytes, via_cli):
    code, errors, gh = via_cli(FakeGitHub(zip_bytes), token=token)
    assert code == 1 and "GITHUB_TOKEN" in errors[0] and gh.requests == []


def test_fetch_records_the_artifact_it_verified(zip_bytes, via_cli, tmp_path):
    """provenance.json beside the bundle: the run, the artifact, GitHub's digest and ours, and the bundle digest
    `bench` records, so a result traces back to its CI artifact."""
    import hashlib
    import json

    from runner.bundle import MANIFEST_NAME, bundle_digest

    code, _, _ = via_cli(FakeGitHub(zip_bytes))
    dest = tmp_path / "dl" / "bundle"
    record = json.loads((dest / PROVENANCE_NAME).read_text())
    zip_sha = hashlib.sha256(zip_bytes).hexdigest()
    assert code == 0 and record["zip_sha256"] == zip_sha and record["artifact"]["digest"] == f"sha256:{zip_sha}"
    assert record["bundle_digest"] == bundle_digest(dest / MANIFEST_NAME)
    assert record["repository"] == REPO and record["run"]["id"] == RUN_ID and record["artifact"]["id"] == ARTIFACT_ID
    # a second fetch over it replaces the bundle and its record (ours), and leaves nothing else behind
    code, _, _ = via_cli(FakeGitHub(zip_bytes), "--run-id", str(RUN_ID), "--force")
    assert code == 0 and sorted(p.name for p in dest.parent.iterdir()) == ["bundle"]


# ---------------------------------------------------------------- the property

_odd = st.one_of(
    st.builds(Odd, st.just("status"), st.none(), st.sampled_from(fake.STATUSES)),
    st.builds(Odd, st.just("header"), st.sampled_from(fake.HEADERS), st.sampled_from(fake.HEADER_VALUES)),
    st.builds(Odd, st.just("body"), st.none(), st.sampled_from(fake.VALUES)),
    st.builds(Odd, st.just("raw"), st.none(), st.binary(max_size=16)),
    st.builds(Odd, st.just("edit"), st.integers(0, 64), st.sampled_from(fake.VALUES)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    odds=st.dictionaries(st.integers(0, 8), st.lists(_odd, min_size=1, max_size=3), max_size=4),
    latest=st.booleans(),
)
def test_any_answer_gives_a_bundle_or_one_fetch_error(zip_bytes, tmp_path, monkeypatch, odds, latest):
    gh = FakeGitHub(zip_bytes, lambda i: odds.get(i, []))
    monkeypatch.setattr(requests, "get", gh.storage_get)
    work = Path(tmp_path) / f"p{len(list(tmp_path.iterdir()))}"
    work.mkdir()
    ref = fetch.ArtifactRef(REPO, NAME, **({"latest": True} if latest else {"run_id": RUN_ID}))

    def sleep(s):
        real_sleep_rules(s)
        gh.sleep(s)

    try:
        access = fetch.GitHubAccess(api_url=API, token=TOKEN, session=gh, sleep=sleep)
        dest = fetch.fetch_artifact(ref, access, work / "b", progress=False)
    except FetchError as e:
        assert "\n" not in str(e) and list(work.iterdir()) == []
    else:
        verify_bundle(dest)
    assert all(math.isfinite(s) and 0 <= s <= MAX_WAIT for s in gh.sleeps), gh.sleeps
