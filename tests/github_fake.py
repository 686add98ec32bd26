"""A scripted GitHub without sockets, for the properties on odd API answers (tests/app/test_github_answers.py) and
their atheris fuzzer (tests/fuzz/fuzz_github.py): one repository, one successful run, one artifact holding a
small valid bundle. Each request gets the answer the real API would give, or that answer with odd parts put in
(`Odd` edits, drawn by the test or the fuzzer): another status, a header of a strange value, a body of another
shape. The client under test is runner.app.github through runner.app.fetch.fetch_artifact.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import requests
from requests.structures import CaseInsensitiveDict

try:
    from tests.json_paths import mutate, paths
except ImportError:  # tests/ on sys.path rather than importable as a package
    from json_paths import mutate, paths

REPO, NAME, RUN_ID, ARTIFACT_ID = "octo/voxtral", "voxtral-bundle-tiny-cpu-fp32", 1, 10
API = "https://api.example.test"  # https: the client refuses plain http off loopback
STORAGE = "https://blob.example.test"
TOKEN = "ghs_faketoken0123456789"

STATUSES = (200, 204, 301, 302, 307, 401, 403, 404, 410, 429, 500, 502, 503)
HEADERS = ("retry-after", "x-ratelimit-remaining", "x-ratelimit-reset", "content-length", "location", "link")
HEADER_VALUES = (
    "nan", "-5", "inf", "-inf", "1e309", "0", "1", "3600", "Wed, 21 Oct 2015 07:28:00 GMT", "", "x", "\u20ac",
    "99999999999999999999", f'<{API}/repos/{REPO}/actions/runs/1/artifacts?page=2>; rel="next"',
    f'<{API}/repos/{REPO}/actions/runs/1/artifacts>; rel="next"', '<https://evil.test/x>; rel="next"',
    "https://evil.test/x", "http://[::1", f"//{urlsplit(STORAGE).hostname}/y", f"{STORAGE}:99999/x", "/relative",
    f"{STORAGE}/blobs/{ARTIFACT_ID}.zip?sig=1",
)  # fmt: skip
VALUES = (None, True, False, 0, -1, 1, 2**63, 1.5, float("nan"), "", "x", "2025-13-45T99:99:99Z", "\u20ac", [], {},
          [1], {"a": 1}, [{"id": 1}], {"full_name": REPO}, "sha256:" + "0" * 64)  # fmt: skip


@dataclass(frozen=True)
class Odd:
    """One edit of an answer: kind "status" (value: a code), "header" (name, value), "body" (a whole JSON
    value), "raw" (bytes that are not JSON), "edit" (a path into the JSON body, chosen by index, and a value)."""

    kind: str
    name: object = None
    value: object = None


@dataclass
class Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: object = None  # JSON value, or bytes as they are


def response(url: str, a: Answer) -> requests.Response:
    r = requests.Response()
    r.status_code = a.status
    r.url = url
    if isinstance(a.body, bytes):
        r._content = a.body
    else:
        r._content = b"" if a.body is None else json.dumps(a.body).encode()
    r._content_consumed = True  # iter_content serves _content
    r.headers = CaseInsensitiveDict({"content-length": str(len(r._content)), **a.headers})
    r.encoding = "utf-8"
    return r


def apply(a: Answer, odds: list[Odd]) -> Answer:
    a = Answer(a.status, dict(a.headers), copy.deepcopy(a.body))
    for odd in odds:
        if odd.kind == "status":
            a.status = int(odd.value)
        elif odd.kind == "header":
            a.headers[str(odd.name)] = str(odd.value)
        elif odd.kind == "body":
            a.body = copy.deepcopy(odd.value)  # a shared value could end up nested in itself
        elif odd.kind == "raw":
            a.body = bytes(odd.value)
        elif odd.kind == "edit" and isinstance(a.body, (dict, list)):
            where = [p for p in paths(a.body) if p]
            if where:
                mutate(a.body, where[int(odd.name) % len(where)], copy.deepcopy(odd.value))
    return a


class FakeGitHub:
    """`session` for GitHub(session=...) and `storage_get` in place of requests.get; `odd(i)` gives the edits of
    the i-th request's answer. Records every request and every sleep."""

    def __init__(self, zip_bytes: bytes, odd: Callable[[int], list[Odd]] = lambda i: []):
        self.zip, self.odd = zip_bytes, odd
        self.requests: list[str] = []
        self.sleeps: list[float] = []

    def _run(self) -> dict:
        return {
            "id": RUN_ID, "name": "ci.yml", "path": ".github/workflows/ci.yml", "head_branch": "main",
            "head_sha": "ab" * 20, "status": "completed", "conclusion": "success", "event": "push",
            "html_url": f"https://github.com/{REPO}/actions/runs/{RUN_ID}", "head_repository": {"full_name": REPO},
        }  # fmt: skip

    def _artifact(self) -> dict:
        return {
            "id": ARTIFACT_ID, "name": NAME, "size_in_bytes": len(self.zip), "expired": False,
            "digest": "sha256:" + hashlib.sha256(self.zip).hexdigest(), "created_at": "2025-01-01T00:00:00Z",
            "expires_at": "2099-01-01T00:00:00Z", "workflow_run": {"id": RUN_ID},
        }  # fmt: skip

    def good(self, url: str) -> Answer:
        u = urlsplit(url)
        if u.hostname == urlsplit(STORAGE).hostname:
            return Answer(200, {"content-type": "application/zip"}, self.zip)
        base = f"/repos/{REPO}/actions/"
        path = u.path.removeprefix(base)
        if path == f"runs/{RUN_ID}":
            return Answer(200, {}, self._run())
        if path == f"runs/{RUN_ID}/artifacts":
            return Answer(200, {}, {"total_count": 1, "artifacts": [self._artifact()]})
        if path == "runs" or (path.startswith("workflows/") and path.endswith("/runs")):
            return Answer(200, {}, {"total_count": 1, "workflow_runs": [self._run()]})
        if path == f"artifacts/{ARTIFACT_ID}/zip":
            return Answer(302, {"location": f"{STORAGE}/blobs/{ARTIFACT_ID}.zip?sig=1"})
        return Answer(404, {}, {"message": "Not Found"})

    def _answer(self, url: str) -> requests.Response:
        i = len(self.requests)
        self.requests.append(url)
        if len(self.requests) > 500:
            raise AssertionError("the client does not stop asking")
        return response(url, apply(self.good(url), self.odd(i)))

    def get(self, url, params=None, headers=None, auth=None, **kw) -> requests.Response:  # the API session
        return self._answer(url)

    def storage_get(self, url, **kw) -> requests.Response:
        assert "auth" in kw and kw["auth"] is not None, "the storage hop must carry the no-auth hook"
        return self._answer(url)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
