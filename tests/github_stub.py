"""A loopback stand-in for the GitHub REST API's Actions artifact endpoints, and for the blob storage its zip
downloads redirect to (on another host name: the API on 127.0.0.1, storage on localhost).

Like the real storage, the blob host treats the signed query string as the credential; unlike the real one, it
also *fails* any request that carries an Authorization header, so a leaked token is a test failure, not a log line.
Helpers build fake bundles and zips (good ones and hostile ones) for the fetch and workflow tests.
"""

from __future__ import annotations

import hashlib
import io
import json
import stat
import threading
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from runner.bundle import FORMAT_VERSION, METHOD_NAMES, Manifest, MethodSpec, file_entries, write_manifest

TOKEN = "ghs_stubtoken0123456789"
SIGNATURE = "sv=2025&sig=SeCrEtSiGnAtUrE"


# ---- fake bundles and zips -----------------------------------------------------------------------------------------


# The model fields every manifest has (runner/manifest_fields.py), at tiny sizes.
FAKE_MODEL = {
    "family": "voxtral",
    "required_methods": list(METHOD_NAMES),
    "config": {"text": {"vocab_size": 64, "dim": 8, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1},
               "audio": {"dim": 8, "n_layers": 1}},
    "max_seq_len": 64,
    "max_audio_chunks": 1,
    "tokens_per_chunk": 375,
    "tokenizer": "tekken.json",
    "special_tokens": {"bos": 1, "eos": 2},
}  # fmt: skip


def write_fake_bundle(bundle_dir: Path, *, seed: int = 0) -> Manifest:
    """A bundle that passes verify_bundle: one small `.so` and weights file per method, tekken.json, model.pte."""
    bundle_dir.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    methods = {}
    for i, m in enumerate(METHOD_NAMES):
        lib, weights = f"{m}.so", f"{m}.safetensors"
        (bundle_dir / lib).write_bytes(bytes([seed, i]) * 64)
        (bundle_dir / weights).write_bytes(bytes([i, seed, 7]) * 100)
        names += [lib, weights]
        methods[m] = MethodSpec(name=m, library=lib, weights=weights, inputs=[], outputs=[])
    (bundle_dir / "tekken.json").write_text(json.dumps({"seed": seed}))
    names.append("tekken.json")
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        torch_version="2.13.0",
        device="cpu",
        gpu_arch=None,
        dtype="float32",
        model={"preset": "fake", **FAKE_MODEL},
        methods=methods,
        files=file_entries(bundle_dir, names),
    )
    write_manifest(bundle_dir, manifest)
    return manifest


def zip_dir(src: Path) -> bytes:
    """The zip upload-artifact makes of a directory: its files at the archive root."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for p in sorted(src.rglob("*")):
            if p.is_file():
                zf.write(p, p.relative_to(src).as_posix())
    return buf.getvalue()


def zip_members(members: dict[str, bytes], *, symlinks: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return buf.getvalue()


def fake_bundle_zip(tmp: Path, *, seed: int = 0) -> bytes:
    d = tmp / f"bundle-src-{seed}"
    write_fake_bundle(d, seed=seed)
    return zip_dir(d)


# ---- the server -------------------------------------------------------------------------------------------------


@dataclass
class Artifact:
    id: int
    name: str
    run_id: int
    data: bytes
    created_at: str = "2025-01-01T00:00:00Z"
    expired: bool = False
    digest: str | None = "auto"  # "auto": sha256 of data, as GitHub records for upload-artifact v4.5+

    def to_json(self, api: str, repo: str) -> dict:
        digest = f"sha256:{hashlib.sha256(self.data).hexdigest()}" if self.digest == "auto" else self.digest
        return {
            "id": self.id,
            "node_id": f"MDg6QXJ0aWZhY3Q{self.id}",
            "name": self.name,
            "size_in_bytes": len(self.data),
            "url": f"{api}/repos/{repo}/actions/artifacts/{self.id}",
            "archive_download_url": f"{api}/repos/{repo}/actions/artifacts/{self.id}/zip",
            "expired": self.expired,
            "digest": digest,
            "created_at": self.created_at,
            "updated_at": self.created_at,
            "expires_at": "2025-04-01T00:00:00Z" if self.expired else "2099-01-01T00:00:00Z",
            "workflow_run": {"id": self.run_id},
        }


@dataclass
class Run:
    id: int
    head_branch: str = "main"
    workflow: str = "ci.yml"
    conclusion: str = "success"
    head_repo: str | None = None  # None: the repository itself; "someone/fork" for a fork's pull request
    no_head: bool = False  # the API gave `head_repository: null` (a deleted fork, for one)


@dataclass
class Recorded:
    server: str  # "api" or "blob"
    host: str
    path: str
    query: str
    headers: dict[str, str]


@dataclass
class Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: dict | None = None


class GitHubStub:
    """Start with `with GitHubStub() as gh:`; add runs and artifacts; `gh.api_url` is the API root."""

    def __init__(self, repo: str = "octo/voxtral", *, page_size: int = 2) -> None:
        self.repo = repo
        self.page_size = page_size
        self.runs: list[Run] = []
        self.artifacts: list[Artifact] = []
        self.requests: list[Recorded] = []
        self.injected: list[tuple[str, Reply]] = []  # (path substring, reply): served once, in order, first
        self.blob_signature = SIGNATURE
        self.blob_status: int | None = None  # force the blob host to answer this
        self._lock = threading.Lock()
        self._api = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("api"))
        self._blob = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("blob"))
        self.api_url = f"http://127.0.0.1:{self._api.server_address[1]}"
        self.blob_url = f"http://localhost:{self._blob.server_address[1]}"

    # ---- lifecycle
    def __enter__(self) -> GitHubStub:
        for srv in (self._api, self._blob):
            threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for srv in (self._api, self._blob):
            srv.shutdown()
            srv.server_close()

    # ---- state helpers
    def add_run(self, run_id: int, **kw) -> Run:
        run = Run(run_id, **kw)
        self.runs.insert(0, run)  # newest first, as the API lists them
        return run

    def add_artifact(self, artifact_id: int, name: str, run_id: int, data: bytes, **kw) -> Artifact:
        a = Artifact(artifact_id, name, run_id, data, **kw)
        self.artifacts.append(a)
        return a

    def inject(self, path_part: str, status: int, headers: dict[str, str] | None = None, body: dict | None = None):
        self.injected.append((path_part, Reply(status, headers or {}, body)))

    def seen(self, server: str) -> list[Recorded]:
        return [r for r in self.requests if r.server == server]

    # ---- routing
    def _run_json(self, run: Run) -> dict:
        head = run.head_repo or self.repo
        return {
            "id": run.id,
            "name": run.workflow,
            "path": f".github/workflows/{run.workflow}",
            "head_branch": run.head_branch,
            "head_sha": f"{run.id:040x}",
            "status": "completed",
            "conclusion": run.conclusion,
            "html_url": f"https://github.com/{self.repo}/actions/runs/{run.id}",
            "head_repository": None if run.no_head else {"full_name": head},
            "repository": {"full_name": self.repo},
        }

    def _page(self, base: str, query: dict, items: list, key: str) -> tuple[int, dict, dict]:
        page = int(query.get("page", ["1"])[0])
        per = min(int(query.get("per_page", ["30"])[0]), self.page_size)
        chunk = items[(page - 1) * per : page * per]
        headers = {}
        if page * per < len(items):
            rest = {k: v[0] for k, v in query.items() if k != "page"}
            qs = "&".join(f"{k}={v}" for k, v in {**rest, "page": page + 1}.items())
            headers["Link"] = f'<{self.api_url}{base}?{qs}>; rel="next", <{self.api_url}{base}?page=1>; rel="first"'
        return 200, headers, {"total_count": len(items), key: chunk}

    def route_api(self, path: str, query: dict, headers: dict) -> tuple[int, dict, dict | bytes | None]:
        if headers.get("authorization") != f"Bearer {TOKEN}":
            return 401, {}, {"message": "Bad credentials", "documentation_url": "https://docs.github.com/rest"}
        if headers.get("x-github-api-version") != "2022-11-28":
            return 400, {}, {"message": "missing or wrong X-GitHub-Api-Version"}
        prefix = f"/repos/{self.repo}/actions/"
        if not path.startswith(prefix):
            return 404, {}, {"message": "Not Found"}
        rest = path[len(prefix) :].split("/")
        runs = {r.id: r for r in self.runs}
        if rest == ["runs"] or (rest[0] == "workflows" and rest[2:] == ["runs"]):
            chosen = self.runs
            if rest[0] == "workflows":
                if rest[1] not in {r.workflow for r in self.runs}:
                    return 404, {}, {"message": "Not Found"}
                chosen = [r for r in chosen if r.workflow == rest[1]]
            if "branch" in query:
                chosen = [r for r in chosen if r.head_branch == query["branch"][0]]
            if "status" in query:
                chosen = [r for r in chosen if r.conclusion == query["status"][0]]
            return self._page(path, query, [self._run_json(r) for r in chosen], "workflow_runs")
        if rest[0] == "runs" and len(rest) > 1 and rest[1].isdigit():
            run = runs.get(int(rest[1]))
            if run is None:
                return 404, {}, {"message": "Not Found"}
            if len(rest) == 2:
                return 200, {}, self._run_json(run)
            if rest[2:] == ["artifacts"]:
                items = [a for a in self.artifacts if a.run_id == run.id]
                if "name" in query:
                    items = [a for a in items if a.name == query["name"][0]]
                return self._page(path, query, [a.to_json(self.api_url, self.repo) for a in items], "artifacts")
        if rest[0] == "artifacts" and len(rest) > 1 and rest[1].isdigit() and rest[2:] == ["zip"]:
            art = next((a for a in self.artifacts if a.id == int(rest[1])), None)
            if art is None:
                return 404, {}, {"message": "Not Found"}
            if art.expired:
                return 410, {}, {"message": "Artifact has expired"}
            return 302, {"Location": f"{self.blob_url}/blobs/{art.id}.zip?{self.blob_signature}"}, None
        return 404, {}, {"message": "Not Found"}

    def route_blob(self, path: str, query: str, headers: dict) -> tuple[int, dict, bytes | dict | None]:
        if "authorization" in headers:
            return 401, {}, {"message": "Authorization header sent to the storage host"}
        if self.blob_status:
            return self.blob_status, {}, {"message": "forced"}
        if query != SIGNATURE:
            return 403, {}, {"message": "AuthenticationFailed: signature mismatch"}
        art_id = path.removeprefix("/blobs/").removesuffix(".zip")
        art = next((a for a in self.artifacts if str(a.id) == art_id), None)
        if art is None:
            return 404, {}, None
        return 200, {"Content-Type": "application/zip"}, art.data

    def _handler(self, server: str):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                headers = {k.lower(): v for k, v in self.headers.items()}
                with stub._lock:
                    stub.requests.append(Recorded(server, headers.get("host", ""), url.path, url.query, headers))
                    reply = None
                    if server == "api":
                        for i, (part, _) in enumerate(stub.injected):
                            if part in url.path:
                                reply = stub.injected.pop(i)[1]
                                break
                if reply is not None:
                    status, extra, body = reply.status, reply.headers, reply.body
                elif server == "api":
                    status, extra, body = stub.route_api(url.path, parse_qs(url.query), headers)
                else:
                    status, extra, body = stub.route_blob(url.path, url.query, headers)
                data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else b"")
                self.send_response(status)
                for k, v in extra.items():
                    self.send_header(k, v)
                if not isinstance(body, bytes):
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler
