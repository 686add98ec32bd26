"""`python -m runner fetch`: download a CI run's bundle artifact, check it, and lay it out in a directory, so
`nox -s e2e -- --bundle DIR` reproduces the CI run locally (docs/ci.md).

GitHub REST API 2022-11-28. The artifact zip is served through a 302 to a signed storage URL on another host;
that hop is fetched *bare*: no token (the signature is the credential, and the storage host must never see
ours) and no logging of its query string (the signature is a bearer credential too, valid for minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import shutil
import stat
import sys
import time
import zipfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path, PurePosixPath

import requests

from runner.app.github import DEFAULT_API_URL, GitHub, RetryPolicy, quiet_urllib3
from runner.bundle import MANIFEST_NAME, verify_bundle
from runner.errors import BundleError, FetchError
from runner.publish import PublishError, make_stage, publish

MAX_RUNS_SCANNED = 30  # --latest looks at this many successful runs, newest first, before giving up
MAX_ARCHIVE_BYTES = 64 << 30  # the bf16 3B bundle is ~10 GB; anything far past that is not ours
MAX_MEMBERS = 10_000
CHUNK = 1 << 20
_REPO_RE = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")


# ---- choosing the artifact ---------------------------------------------------------------------------------------


def _created(a: dict) -> datetime:
    return datetime.fromisoformat(str(a.get("created_at", "1970-01-01T00:00:00Z")).replace("Z", "+00:00"))


def _pick(artifacts: list[dict], name: str) -> tuple[dict | None, list[dict]]:
    """The newest non-expired artifact called `name`, and the expired ones of that name (for the message)."""
    named = [a for a in artifacts if a.get("name") == name]
    live = [a for a in named if not a.get("expired")]
    return (max(live, key=_created) if live else None), [a for a in named if a.get("expired")]


def _run_artifacts(gh: GitHub, repo: str, run_id: int) -> list[dict]:
    return list(
        gh.paginate(f"/repos/{repo}/actions/runs/{run_id}/artifacts", "artifacts", f"artifacts of run {run_id}")
    )


def find_in_run(gh: GitHub, repo: str, run_id: int, name: str) -> tuple[dict, dict]:
    """(run, artifact) for an explicit run id, or a FetchError that says what the run does have."""
    run = gh.get_json(f"/repos/{repo}/actions/runs/{run_id}", f"run {run_id} of {repo}")
    artifacts = _run_artifacts(gh, repo, run_id)
    artifact, expired = _pick(artifacts, name)
    if artifact:
        return run, artifact
    if expired:
        when = max(str(a.get("expires_at") or "?") for a in expired)
        raise FetchError(f"artifact {name} of run {run_id} expired ({when}); re-run the workflow to rebuild it")
    names = sorted({str(a.get("name")) for a in artifacts})
    have = f"it has: {', '.join(names)}" if names else "it has no artifacts (still running, or the upload failed?)"
    raise FetchError(f"run {run_id} of {repo} has no artifact named {name}; {have}")


def find_latest(
    gh: GitHub, repo: str, name: str, *, branch: str | None, workflow: str | None, allow_forks: bool
) -> tuple[dict, dict]:
    """(run, artifact) from the newest successful run that still has a live artifact called `name`.

    Runs of pull requests from forks are skipped unless asked for: their bundle is a stranger's `.so`."""
    path = f"/repos/{repo}/actions/workflows/{workflow}/runs" if workflow else f"/repos/{repo}/actions/runs"
    params = {"status": "success", **({"branch": branch} if branch else {})}
    where = " ".join(filter(None, [f"of {workflow}" if workflow else "", f"on {branch}" if branch else ""]))
    scanned = 0
    for run in gh.paginate(path, "workflow_runs", f"runs {where or 'of ' + repo}".strip(), params=params):
        head = run.get("head_repository")
        head = head.get("full_name") if isinstance(head, dict) else None
        # a run whose origin is unknown (no head repository) counts as foreign, as a fork's does
        if not allow_forks and (not isinstance(head, str) or head.lower() != repo.lower()):
            continue
        scanned += 1
        artifact, _ = _pick(_run_artifacts(gh, repo, int(run["id"])), name)
        if artifact:
            return run, artifact
        if scanned >= MAX_RUNS_SCANNED:
            break
    raise FetchError(
        f"no successful run {where + ' ' if where else ''}in {repo} (newest {scanned} looked at) "
        f"has a live artifact named {name}"
    )


# ---- download and extraction -------------------------------------------------------------------------------------


def _progress(total: int | None, enabled: bool, label: str):
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    columns = (f"[bold]{label}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    return Progress(*columns, console=Console(stderr=True), transient=False)


def download_zip(
    gh: GitHub, repo: str, artifact: dict, out: Path, *, progress: bool, max_bytes: int = MAX_ARCHIVE_BYTES
) -> str:
    """Stream the artifact's zip to `out`; returns its sha256 hex."""
    what = f"artifact {artifact['name']} ({artifact['id']})"
    resp = gh.download(f"/repos/{repo}/actions/artifacts/{artifact['id']}/zip", what)
    total = int(resp.headers.get("content-length") or artifact.get("size_in_bytes") or 0) or None
    if total and total > max_bytes:
        raise FetchError(f"{what}: {total} bytes is over the {max_bytes}-byte cap")
    h = hashlib.sha256()
    done = 0
    try:
        with quiet_urllib3(), resp, open(out, "xb") as f, _progress(total, progress, artifact["name"]) as bar:
            task = bar.add_task("download", total=total) if bar else None
            try:
                for block in resp.iter_content(CHUNK):
                    done += len(block)
                    if done > max_bytes:
                        raise FetchError(f"{what}: download passed the {max_bytes}-byte cap; stopped")
                    h.update(block)
                    f.write(block)
                    if bar:
                        bar.update(task, advance=len(block))
            except requests.RequestException as e:
                raise FetchError(f"{what}: download interrupted ({type(e).__name__}); try again") from None
    except OSError as e:  # disk full, file size limit: the caller removes the partial file
        raise FetchError(f"{what}: cannot write the download in {out.parent.parent} ({e.strerror or e})") from None
    if total and resp.headers.get("content-length") and done != total:
        raise FetchError(f"{what}: download ended early ({done} of {total} bytes); try again")
    return h.hexdigest()


def check_digest(artifact: dict, sha256: str) -> None:
    """GitHub records `digest: "sha256:<hex>"` for artifacts uploaded by upload-artifact v4.5+; older ones have none."""
    digest = artifact.get("digest")
    if not digest:
        return
    algo, _, expected = str(digest).partition(":")
    if algo.lower() == "sha256" and expected.lower() != sha256:
        raise FetchError(
            f"artifact {artifact['name']} ({artifact['id']}): sha256 {sha256} does not match GitHub's digest "
            f"{expected}; the download is corrupt or was tampered with"
        )


def _unsafe(info: zipfile.ZipInfo) -> str | None:
    name = info.filename
    parts = PurePosixPath(name).parts
    if not name or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or "\\" in name or "\0" in name:
        return "an absolute or non-POSIX path"
    if ".." in parts:
        return "a '..' path"
    mode = info.external_attr >> 16
    kind = stat.S_IFMT(mode)
    if kind == stat.S_IFLNK:
        return "a symbolic link"
    if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
        return "a special file"
    if info.flag_bits & 0x1:
        return "an encrypted member"
    return None


def extract_zip(archive: Path, dest: Path, *, max_bytes: int = MAX_ARCHIVE_BYTES) -> None:
    """Extract into the (new, empty) `dest`, refusing anything that could write outside it."""
    try:
        zf = zipfile.ZipFile(archive)
    except zipfile.BadZipFile:
        raise FetchError(f"{archive.name}: not a zip archive") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > MAX_MEMBERS:
            raise FetchError(f"unsafe archive: {len(infos)} members (cap {MAX_MEMBERS})")
        seen: set[str] = set()
        for info in infos:
            why = _unsafe(info)
            if why:
                raise FetchError(f"unsafe archive: member {info.filename!r} is {why}")
            key = info.filename.rstrip("/")
            if key in seen:
                raise FetchError(f"unsafe archive: member {info.filename!r} appears twice")
            seen.add(key)
        declared = sum(i.file_size for i in infos)
        if declared > max_bytes:
            raise FetchError(f"unsafe archive: {declared} bytes uncompressed is over the {max_bytes}-byte cap")
        written = 0
        for info in infos:
            target = dest.joinpath(*PurePosixPath(info.filename).parts)
            try:
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "xb") as out:
                    while block := src.read(CHUNK):
                        written += len(block)
                        if written > max_bytes:
                            raise FetchError(f"unsafe archive: more than {max_bytes} bytes once extracted")
                        out.write(block)
            except (zipfile.BadZipFile, OSError, EOFError) as e:
                raise FetchError(f"archive member {info.filename!r}: {type(e).__name__}: {e}") from None


# ---- the whole verb ----------------------------------------------------------------------------------------------


def _prepare_dest(dest: Path, force: bool, when: str = "") -> None:
    """Checked before the download and again before the swap: files may appear in `dest` meanwhile."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise FetchError(f"{dest}: exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()) and not force:
        raise FetchError(
            f"{dest}: not empty{when}; pass --force to replace it (files that are not a bundle's are kept)"
        )


def fetch_artifact(
    repo: str,
    *,
    run_id: int | None = None,
    latest: bool = False,
    branch: str | None = None,
    workflow: str | None = None,
    name: str,
    dest: str | os.PathLike,
    api_url: str | None = None,
    token: str | None,
    progress: bool = True,
    force: bool = False,
    allow_forks: bool = False,
    bundle: bool = True,
    max_bytes: int = MAX_ARCHIVE_BYTES,
    log: Callable[[str], None] | None = None,
    session: requests.Session | None = None,
    retry: RetryPolicy = RetryPolicy(),
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.time,
) -> Path:
    """Download bundle artifact `name` of a run (`run_id`, or the newest successful one with `latest`) into
    `dest`, verify GitHub's digest and the bundle manifest, and return `dest`. Raises FetchError."""
    log = log or (lambda _msg: None)
    if not _REPO_RE.match(repo or ""):
        raise FetchError(f"--repo {repo!r}: expected OWNER/NAME")
    if (run_id is None) == (not latest):
        raise FetchError("give exactly one of --run-id ID or --latest")
    if run_id is not None and (branch or workflow):
        raise FetchError("--branch and --workflow only apply with --latest")
    if not name or name in (".", "..") or any(c in name for c in '"/\\:<>|*?\r\n'):
        raise FetchError(f"--name {name!r}: not a valid artifact name")
    if not token:
        raise FetchError(
            "no GitHub token: set GITHUB_TOKEN or GH_TOKEN (artifact downloads need one, even from public repos)"
        )
    if any(c.isspace() for c in token):
        raise FetchError("the GitHub token contains whitespace; check GITHUB_TOKEN / GH_TOKEN")
    dest = Path(dest)
    _prepare_dest(dest, force)

    gh = GitHub(api_url or DEFAULT_API_URL, token, session=session, retry=retry, sleep=sleep, clock=clock)
    if latest:
        run, artifact = find_latest(gh, repo, name, branch=branch, workflow=workflow, allow_forks=allow_forks)
    else:
        run, artifact = find_in_run(gh, repo, int(run_id), name)
    sha = str(run.get("head_sha") or "")[:12]
    size = artifact.get("size_in_bytes", "?")
    log(f"run {run.get('id')} ({run.get('head_branch')}@{sha}): artifact {name} id {artifact['id']}, {size} bytes")

    try:
        work = make_stage(dest)  # beside dest (one filesystem: the swap is a rename); a killed run's is swept
    except OSError as e:
        raise FetchError(f"{dest}: cannot create a directory beside it ({e.strerror or e})") from None
    try:
        archive = work / "artifact.zip"
        digest = download_zip(gh, repo, artifact, archive, progress=progress, max_bytes=max_bytes)
        check_digest(artifact, digest)
        staged = work / "bundle"
        staged.mkdir()
        extract_zip(archive, staged, max_bytes=max_bytes)
        archive.unlink()
        if bundle:
            try:
                manifest = verify_bundle(staged)
            except BundleError as e:
                shown = str(e).replace(str(staged), str(dest))
                raise FetchError(f"artifact {name} of run {run.get('id')} is not a valid bundle: {shown}") from None
            what = f"{len(manifest.files)} files verified against {MANIFEST_NAME}"
        else:
            what = f"{sum(1 for p in staged.rglob('*') if p.is_file())} files"
        # swap in only now that the new one is known good, and only over what it may replace
        _prepare_dest(dest, force, when=" (files appeared in it during the download; nothing was replaced)")
        try:
            kept = publish(staged, dest, merge=force)
        except PublishError as e:
            raise FetchError(str(e)) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"{dest}: {what} (sha256 {digest[:12]} zip)")
    if kept is not None:
        log(f"note: files that were in {dest} beside the old bundle are kept in {kept}")
    return dest


def main(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    dest = fetch_artifact(
        args.repo,
        run_id=args.run_id,
        latest=args.latest,
        branch=args.branch,
        workflow=args.workflow,
        name=args.name,
        dest=args.dest or Path("artifacts") / args.name,
        api_url=args.api_url or args.env.github_api_url,
        token=args.env.github_token,
        progress=not args.no_progress and sys.stderr.isatty(),
        force=args.force,
        allow_forks=args.allow_forks,
        bundle=not args.files,
        log=log,
    )
    print(dest)  # stdout carries only the directory, for DIR=$(python -m runner fetch ...)
    return 0
