"""A small GitHub REST client (API 2022-11-28) for `runner fetch`: the token only ever goes to the API host,
redirects are followed by hand, rate limits and 5xx are retried within a bound, every failure is one line."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests
import requests.auth

from runner.errors import FetchError

DEFAULT_API_URL = "https://api.github.com"
API_VERSION = "2022-11-28"
USER_AGENT = "voxtral-aoti-runner-fetch"
MAX_REDIRECTS = 5
TIMEOUT = (15, 120)  # (connect, read) seconds
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}
PER_PAGE = 100
_MAX_EPOCH = 253402300800  # 10000-01-01: datetime's end
MAX_PAGES = 100  # a list endpoint's `next` links are followed this far (a looping or endless list must end)


@dataclass(frozen=True)
class RetryPolicy:
    """Rate limits and 5xx are retried a few times; a wait longer than `max_wait` is not worth blocking on."""

    attempts: int = 5
    max_wait: float = 120.0
    backoff: float = 2.0  # first 5xx/connection retry waits this long, then doubles


def redact(url: str) -> str:
    """scheme://host/path: what may be shown of a URL whose query string is a credential."""
    try:
        p = urlsplit(url)
        host = p.hostname or ""
        if p.port:
            host = f"{host}:{p.port}"
    except ValueError:  # a bad port or bracket: show nothing of it
        return "(an unparseable URL)"
    return f"{p.scheme}://{host}{p.path}"


def _origin(url: str) -> tuple[str, str, int | None]:
    try:
        p = urlsplit(url)
        return p.scheme, (p.hostname or "").lower(), p.port
    except ValueError:
        return "", "", None  # matches no origin: never followed


def _check_transport(url: str, what: str) -> None:
    # A token or a signed URL over plain http is readable by anyone on the path; loopback is for tests.
    scheme, host, _ = _origin(url)
    if not scheme:
        raise FetchError(f"{what} {redact(url)} is not a usable URL")
    if scheme == "https" or (scheme == "http" and host in _LOOPBACK):
        return
    raise FetchError(f"{what} {redact(url)} is not https; refusing to send credentials over it")


def _no_auth(r: requests.PreparedRequest) -> requests.PreparedRequest:
    # An explicit auth hook so requests neither adds ~/.netrc credentials nor keeps an Authorization header.
    r.headers.pop("Authorization", None)
    return r


class _Bearer(requests.auth.AuthBase):
    """The token as an auth hook, not a plain header: with no auth given, requests would replace the header
    with ~/.netrc credentials for the host."""

    def __init__(self, token: str) -> None:
        self._token = token

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        r.headers["Authorization"] = f"Bearer {self._token}"
        return r


@contextlib.contextmanager
def quiet_urllib3() -> Iterator[None]:
    """urllib3 logs request lines (query string included) at DEBUG; keep signed URLs out of any debug log."""
    log = logging.getLogger("urllib3.connectionpool")
    level = log.level
    log.setLevel(max(level, logging.INFO))
    try:
        yield
    finally:
        log.setLevel(level)


def _when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%H:%M:%S UTC")


def _message(resp: requests.Response) -> str:
    try:
        body = resp.json()
    except (ValueError, RecursionError):
        body = None
    msg = body.get("message", "") if isinstance(body, dict) else ""
    return " ".join(str(msg).split())[:200]


def check_token(token: str) -> None:
    """A token is printable ASCII: anything else cannot go in a header (requests raised UnicodeEncodeError)."""
    if any(c.isspace() for c in token):
        raise FetchError("the GitHub token contains whitespace; check GITHUB_TOKEN / GH_TOKEN")
    if not (token.isascii() and token.isprintable()):
        raise FetchError("the GitHub token contains characters no token has (non-ASCII or control characters); "
                         "check GITHUB_TOKEN / GH_TOKEN")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class GitHubAccess:
    """How to reach GitHub: the API root and the token, and for tests the HTTP session, retries and clock. A value;
    `connect()` makes the client. (Keyword-only, so a test can swap `sleep`'s default in __init__.__kwdefaults__
    for a run through the CLI.)"""

    api_url: str | None = None  # None: DEFAULT_API_URL
    token: str | None = None
    session: requests.Session | None = None
    retry: RetryPolicy = RetryPolicy()
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.time

    def check(self) -> None:
        """A token is there and could go in a header (before any request, and before --dest is touched)."""
        if not self.token:
            raise FetchError(
                "no GitHub token: set GITHUB_TOKEN or GH_TOKEN (artifact downloads need one, even from public repos)"
            )
        check_token(self.token)

    def connect(self) -> GitHub:
        self.check()
        return GitHub(
            self.api_url or DEFAULT_API_URL,
            self.token,
            session=self.session,
            retry=self.retry,
            sleep=self.sleep,
            clock=self.clock,
        )


class GitHub:
    """A minimal REST client: auth headers on API requests only, bounded retries, Link pagination."""

    def __init__(
        self,
        api_url: str,
        token: str,
        *,
        session: requests.Session | None = None,
        retry: RetryPolicy = RetryPolicy(),
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        _check_transport(self.api_url, "API URL")
        check_token(token)
        self._token = token
        self._session = session or requests.Session()
        self._retry = retry
        self._sleep = sleep
        self._clock = clock

    def _headers(self) -> dict[str, str]:
        return {
            "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": API_VERSION,
            "User-Agent": USER_AGENT,
        }

    def _retry_after(self, resp: requests.Response, attempt: int) -> tuple[float, str] | None:
        """How long to wait before retrying `resp`, and why; None when it is not retryable."""
        h = resp.headers
        limited = resp.status_code == 429 or (
            resp.status_code == 403
            and (h.get("x-ratelimit-remaining") == "0" or "retry-after" in h or "rate limit" in _message(resp).lower())
        )
        if limited:
            if "retry-after" in h:
                return _seconds(h["retry-after"]), "GitHub API rate limit (retry-after)"
            if h.get("x-ratelimit-remaining") == "0" and "x-ratelimit-reset" in h:
                now = self._clock()
                reset = _seconds(h["x-ratelimit-reset"], default=math.nan)
                if not 0 <= reset < _MAX_EPOCH:  # NaN, negative, past year 9999: a wait we cannot know
                    return 60.0, "GitHub API rate limit exhausted (no usable reset time)"
                return max(0.0, reset - now) + 1, f"GitHub API rate limit exhausted; it resets at {_when(reset)}"
            return 60.0, "GitHub secondary rate limit"
        if resp.status_code in (500, 502, 503, 504):
            if "retry-after" in h:
                return _seconds(h["retry-after"]), f"HTTP {resp.status_code}"
            return self._retry.backoff * 2**attempt, f"HTTP {resp.status_code}"
        return None

    def request(self, url: str, what: str, *, params: dict[str, Any] | None = None, stream: bool = False):
        """GET an API URL (never follows redirects: the caller decides where the token may go)."""
        if _origin(url) != _origin(self.api_url):
            raise FetchError(f"{what}: the API pointed at {redact(url)}, off {redact(self.api_url)}; not following")
        for attempt in range(self._retry.attempts):
            last = attempt == self._retry.attempts - 1
            try:
                resp = self._session.get(
                    url,
                    params=params,
                    headers=self._headers(),
                    auth=_Bearer(self._token),
                    stream=stream,
                    allow_redirects=False,
                    timeout=TIMEOUT,
                )
            except requests.RequestException as e:
                if last:
                    raise FetchError(f"{what}: cannot reach {redact(url)} ({type(e).__name__})") from None
                self._sleep(min(self._retry.backoff * 2**attempt, self._retry.max_wait))
                continue
            wait = self._retry_after(resp, attempt)
            if wait is None:
                return resp
            seconds, why = wait
            resp.close()
            if last or seconds > self._retry.max_wait:
                raise FetchError(f"{what}: {why}; gave up after {attempt + 1} attempt(s), try again later")
            self._sleep(seconds)
        raise AssertionError("unreachable")

    def download(self, path: str, what: str) -> requests.Response:
        """GET an API path that answers with a redirect to storage on another host (an artifact's zip), and
        follow it *bare*: no token (the signature is the credential, and the storage host must never see ours),
        no netrc, no redirect following by requests, and its query string never logged (the signature is a
        bearer credential too, valid for minutes). Returns the storage host's streaming response, status checked."""
        resp = self.request(f"{self.api_url}{path}", what, stream=True)
        hops = 0
        while resp.status_code in (301, 302, 303, 307, 308):
            location = resp.headers.get("location")
            resp.close()
            if not location or hops >= MAX_REDIRECTS:
                raise FetchError(f"{what}: bad redirect from {redact(resp.url)}")
            try:
                location = urljoin(resp.url, location)
            except ValueError:  # an unparseable Location
                raise FetchError(f"{what}: bad redirect from {redact(resp.url)}") from None
            _check_transport(location, f"{what}: storage URL")
            hops += 1
            with quiet_urllib3():
                try:
                    resp = requests.get(
                        location,
                        headers={"User-Agent": USER_AGENT},
                        auth=_no_auth,
                        stream=True,
                        allow_redirects=False,
                        timeout=TIMEOUT,
                    )
                except (requests.RequestException, ValueError) as e:  # ValueError: a URL requests cannot encode
                    raise FetchError(f"{what}: cannot download from {redact(location)} ({type(e).__name__})") from None
        if resp.status_code in (401, 403) and hops:
            resp.close()
            raise FetchError(
                f"{what}: the storage host refused the download (HTTP {resp.status_code}); "
                "its signed URL may have expired, try again"
            )
        _raise_for_status(resp, what)
        return resp

    def get_json(self, path: str, what: str, *, params: dict[str, Any] | None = None) -> dict[str, Any]:
        resp = self.request(f"{self.api_url}{path}", what, params=params)
        _raise_for_status(resp, what)
        return _object(resp, what)

    def paginate(self, path: str, key: str, what: str, *, params: dict[str, Any] | None = None) -> Iterator[dict]:
        """Items of a list endpoint, following `Link: <...>; rel="next"` (which already carries the query), at most
        MAX_PAGES pages and never one twice."""
        url: str | None = f"{self.api_url}{path}"
        params = {"per_page": PER_PAGE, **(params or {})}
        seen: set[str] = set()
        while url:
            if url in seen or len(seen) >= MAX_PAGES:
                raise FetchError(f"{what}: GitHub's list did not end after {len(seen)} pages; giving up")
            seen.add(url)
            resp = self.request(url, what, params=params)
            _raise_for_status(resp, what)
            items = _object(resp, what).get(key, [])
            if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
                raise FetchError(f"{what}: unexpected answer from GitHub ({key} is not a list of objects)")
            yield from items
            url, params = resp.links.get("next", {}).get("url"), None


def _object(resp: requests.Response, what: str) -> dict[str, Any]:
    """The JSON object an API answer must be; anything else is one line, not a traceback further on."""
    try:
        body = resp.json()
    except (ValueError, RecursionError):  # HTML from a proxy, a cut-off body, nesting past the limit
        raise FetchError(f"{what}: GitHub's answer is not JSON (HTTP {resp.status_code}); try again") from None
    if not isinstance(body, dict):
        raise FetchError(f"{what}: unexpected answer from GitHub (a JSON {type(body).__name__}, not an object)")
    return body


def _seconds(value: str, default: float = 60.0) -> float:
    """A header's seconds: a finite number >= 0, else `default` (NaN, a negative or an HTTP-date wait 60 s)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return default
    return x if math.isfinite(x) and x >= 0 else default


def _raise_for_status(resp: requests.Response, what: str) -> None:
    code = resp.status_code
    if 200 <= code < 300:
        return
    msg = _message(resp)
    detail = f" ({msg})" if msg else ""
    if code == 401:
        raise FetchError(f"{what}: GitHub rejected the token (401{detail}); check GITHUB_TOKEN / GH_TOKEN")
    if code == 403:
        wanted = resp.headers.get("x-accepted-github-permissions") or resp.headers.get("x-accepted-oauth-scopes")
        need = f"it needs {wanted}" if wanted else "it needs read access to Actions (`actions: read`, or `repo` scope)"
        raise FetchError(f"{what}: forbidden (403{detail}); the token lacks access: {need}")
    if code == 404:
        raise FetchError(f"{what}: not found (404); check the name, and that the token can see the repository")
    if code == 410:
        raise FetchError(f"{what}: gone (410{detail}); the artifact has expired, re-run the workflow to rebuild it")
    raise FetchError(f"{what}: HTTP {code}{detail}")
