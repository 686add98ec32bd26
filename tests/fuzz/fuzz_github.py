"""atheris: `fetch` (runner.app.fetch.fetch_artifact through runner.app.github) against GitHub answers drawn from the
input: each request's answer is the real API's (tests/github_fake.py: one run, one artifact, a small valid bundle)
with odd parts put in: another status, headers of strange values (retry-after, rate-limit reset, content-length,
location, link), a body of another shape, an edited field. Only FetchError may escape; every wait must be finite
and within the retry policy's bound; a failed fetch leaves nothing behind. tests/app/test_github_answers.py holds
the same property for the default suite.

    python tests/fuzz/fuzz_github.py -max_total_time=300 [CORPUS_DIR]     (nox -s fuzz)
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fake GitHub and the fake bundle
import github_fake as fake  # noqa: E402
from github_stub import fake_bundle_zip  # noqa: E402

with atheris.instrument_imports():
    import requests

    from runner.app import fetch
    from runner.errors import FetchError

KINDS = ("status", "header", "body", "raw", "edit")
WORK = Path(tempfile.mkdtemp(prefix="fuzz-github-"))
ZIP = fake_bundle_zip(WORK / "src")
MAX_WAIT = fetch.RetryPolicy().max_wait


def odds(fdp: atheris.FuzzedDataProvider) -> dict[int, list[fake.Odd]]:
    out: dict[int, list[fake.Odd]] = {}
    for _ in range(fdp.ConsumeIntInRange(0, 6)):
        i, kind = fdp.ConsumeIntInRange(0, 8), fdp.PickValueInList(list(KINDS))
        if kind == "status":
            odd = fake.Odd(kind, value=fdp.PickValueInList(list(fake.STATUSES)))
        elif kind == "header":
            value = (
                fdp.PickValueInList(list(fake.HEADER_VALUES))
                if fdp.ConsumeBool()
                else fdp.ConsumeUnicodeNoSurrogates(24)
            )
            odd = fake.Odd(kind, fdp.PickValueInList(list(fake.HEADERS)), value)
        elif kind == "body":
            odd = fake.Odd(kind, value=fdp.PickValueInList(list(fake.VALUES)))
        elif kind == "raw":
            odd = fake.Odd(kind, value=fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)))
        else:
            odd = fake.Odd(kind, fdp.ConsumeIntInRange(0, 64), fdp.PickValueInList(list(fake.VALUES)))
        out.setdefault(i, []).append(odd)
    return out


def target(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    latest = fdp.ConsumeBool()
    plan = odds(fdp)
    gh = fake.FakeGitHub(ZIP, lambda i: plan.get(i, []))
    requests.get = gh.storage_get  # the storage hop goes through the fake too
    work = WORK / "run"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()

    def sleep(s: float) -> None:
        assert math.isfinite(s) and 0 <= s <= MAX_WAIT, s
        gh.sleep(s)

    where = {"latest": True} if latest else {"run_id": fake.RUN_ID}
    try:
        fetch.fetch_artifact(
            fetch.ArtifactRef(fake.REPO, fake.NAME, **where),
            fetch.GitHubAccess(api_url=fake.API, token=fake.TOKEN, session=gh, sleep=sleep),
            work / "b", progress=False,
        )  # fmt: skip
    except FetchError as e:
        assert "\n" not in str(e) and list(work.iterdir()) == [], (str(e), list(work.iterdir()))


def main() -> None:
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
