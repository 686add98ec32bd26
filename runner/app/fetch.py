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
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import requests

from runner.app.archive import CHUNK, MAX_ARCHIVE_BYTES, extract_zip
from runner.app.github import GitHub, GitHubAccess, RetryPolicy, quiet_urllib3, redact
from runner.bundle import (
    MANIFEST_NAME,
    bundle_digest,
    missing_weights,
    read_manifest,
    regenerable_weights,
    verify_bundle,
)
from runner.errors import BundleError, Cancellation, FetchError
from runner.publish import PROVENANCE_NAME, PublishError, absolute_destination, check_free_space, make_stage, publish

__all__ = ["ArtifactRef", "GitHubAccess", "RetryPolicy", "fetch_artifact", "main"]  # a caller's whole vocabulary

MAX_RUNS_SCANNED = 30  # --latest looks at this many successful runs, newest first, before giving up
_REPO_RE = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")


# ---- choosing the artifact ---------------------------------------------------------------------------------------


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _created(a: dict) -> datetime:
    """When an artifact was made; an unparseable or missing date sorts as the oldest."""
    try:
        when = datetime.fromisoformat(str(a.get("created_at")).replace("Z", "+00:00"))
    except ValueError:
        return _EPOCH
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def _id(d: dict) -> int | None:
    """A run's or an artifact's id: a whole number > 0 (GitHub's are), else None."""
    v = d.get("id")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _pick(artifacts: list[dict], name: str) -> tuple[dict | None, list[dict]]:
    """The newest non-expired artifact called `name`, and the expired ones of that name (for the message)."""
    named = [a for a in artifacts if a.get("name") == name]
    live = [a for a in named if not a.get("expired")]
    if live and any(_id(a) is None for a in live):
        raise FetchError(f"artifact {name}: GitHub's answer gives it no usable id ({live[0].get('id')!r})")
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
        if _id(run) is None:  # a run GitHub gives no id cannot be asked for its artifacts
            continue
        scanned += 1
        artifact, _ = _pick(_run_artifacts(gh, repo, _id(run)), name)
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
    total = _count(resp.headers.get("content-length")) or _count(artifact.get("size_in_bytes")) or None
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
    if total and _count(resp.headers.get("content-length")) and done != total:
        raise FetchError(f"{what}: download ended early ({done} of {total} bytes); try again")
    return h.hexdigest()


def _count(v) -> int | None:
    """A byte count from a header or an answer: a whole number >= 0, else None (unknown)."""
    if isinstance(v, bool):
        return None
    try:
        n = int(v)
    except (TypeError, ValueError):
        return None
    return n if n >= 0 else None


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


# ---- the whole verb ----------------------------------------------------------------------------------------------


def _prepare_dest(dest: Path, force: bool, when: str = "") -> None:
    """Checked before the download and again before the swap: files may appear in `dest` meanwhile."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise FetchError(f"{dest}: exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()) and not force:
        raise FetchError(
            f"{dest}: not empty{when}; pass --force to replace it (files that are not a bundle's are kept)"
        )


@dataclass(frozen=True)
class ArtifactRef:
    """Which artifact: its repository and name, and the run (`run_id`, or the newest successful one with `latest`,
    on `branch` / of `workflow` if given, a fork's only with `allow_forks`)."""

    repo: str
    name: str
    run_id: int | None = None
    latest: bool = False
    branch: str | None = None
    workflow: str | None = None
    allow_forks: bool = False

    def check(self) -> None:
        if not _REPO_RE.match(self.repo or ""):
            raise FetchError(f"--repo {self.repo!r}: expected OWNER/NAME")
        if (self.run_id is None) == (not self.latest):
            raise FetchError("give exactly one of --run-id ID or --latest")
        if self.run_id is not None and (self.branch or self.workflow):
            raise FetchError("--branch and --workflow only apply with --latest")
        name = self.name
        if not name or name in (".", "..") or any(c in name for c in '"/\\:<>|*?\r\n'):
            raise FetchError(f"--name {name!r}: not a valid artifact name")

    def find(self, gh: GitHub) -> tuple[dict, dict]:
        """(run, artifact), or a FetchError that says where it looked."""
        if self.latest:
            return find_latest(
                gh, self.repo, self.name, branch=self.branch, workflow=self.workflow, allow_forks=self.allow_forks
            )
        return find_in_run(gh, self.repo, int(self.run_id), self.name)


def fetch_artifact(
    ref: ArtifactRef,
    access: GitHubAccess,
    dest: str | os.PathLike,
    *,
    force: bool = False,
    bundle: bool = True,
    progress: bool = True,
    max_bytes: int = MAX_ARCHIVE_BYTES,
    log: Callable[[str], None] | None = None,
    cancel: Cancellation | None = None,
) -> Path:
    """Download artifact `ref` into `dest`, verify GitHub's digest and (a bundle's) manifest, and return `dest`.
    `force` replaces a non-empty `dest`, keeping what is not the old bundle's; `bundle=False`: plain files, no
    manifest. `cancel`: a stop asked for meanwhile (SIGTERM) publishes nothing. Raises FetchError."""
    log = log or (lambda _msg: None)
    ref.check()
    access.check()
    given = Path(dest)
    try:
        dest = absolute_destination(given)
    except PublishError as e:
        raise FetchError(str(e)) from None
    _prepare_dest(dest, force)
    gh = access.connect()
    run, artifact = ref.find(gh)
    sha = str(run.get("head_sha") or "")[:12]
    size = artifact.get("size_in_bytes", "?")
    log(f"run {run.get('id')} ({run.get('head_branch')}@{sha}): artifact {ref.name} id {artifact['id']}, {size} bytes")
    try:
        work = make_stage(dest)  # beside dest (one filesystem: the swap is a rename); a killed run's is swept
    except OSError as e:
        raise FetchError(f"{dest}: cannot create a directory beside it ({e.strerror or e})") from None
    try:
        got = _Download(gh, ref, run, artifact, dest, given, max_bytes).into(work, progress=progress, bundle=bundle)
        # swap in only now that the new one is known good, and only over what it may replace
        _prepare_dest(dest, force, when=" (files appeared in it during the download; nothing was replaced)")
        try:
            kept = publish(got.staged, dest, cancel=cancel or Cancellation(), merge=force)
        except PublishError as e:
            raise FetchError(str(e)) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"{given}: {got.what} (sha256 {got.digest[:12]} zip)")
    if kept is not None:
        log(f"note: files that were in {given} beside the old bundle are kept in {kept}")
    return given


@dataclass
class _Staged:
    staged: Path  # the checked files, ready to publish
    digest: str  # the zip's sha256
    what: str  # what was checked, for the log line


@dataclass
class _Download:
    """One artifact of one run, downloaded and unpacked into a stage directory and checked there."""

    gh: GitHub
    ref: ArtifactRef
    run: dict
    artifact: dict
    dest: Path  # where it will be published (absolute)
    shown_as: Path  # --dest as given: what a message names in place of the stage
    max_bytes: int

    def into(self, work: Path, *, progress: bool, bundle: bool) -> _Staged:
        size = self.artifact.get("size_in_bytes", "?")
        if isinstance(size, int):  # the zip and, until it is removed, the files extracted from it
            try:
                what = f"artifact {self.ref.name} (its zip, then the files in it)"
                check_free_space(work, self.dest, 2 * size, what)
            except PublishError as e:
                raise FetchError(str(e)) from None
        archive = work / "artifact.zip"
        digest = download_zip(
            self.gh, self.ref.repo, self.artifact, archive, progress=progress, max_bytes=self.max_bytes
        )
        check_digest(self.artifact, digest)
        staged = work / "bundle"
        staged.mkdir()
        manifest = self._unpack(archive, staged, bundle)
        if manifest is None:
            return _Staged(staged, digest, f"{sum(1 for p in staged.rglob('*') if p.is_file())} files")
        write_provenance(staged, self.gh.api_url, self.ref.repo, self.run, self.artifact, digest)
        what = f"{len(manifest.files)} files verified against {MANIFEST_NAME}"
        if missing_weights(staged, manifest):  # an artifact of a bundle whose weights are made again
            what += f"; its weights travel apart: make them with `python -m runner export --regenerate {self.shown_as}`"
        return _Staged(staged, digest, what)

    def _unpack(self, archive: Path, staged: Path, bundle: bool):
        """Extract the zip into `staged` and remove it; a bundle's manifest is verified and returned."""
        try:
            extract_zip(archive, staged, max_bytes=self.max_bytes, bundle=bundle)
            archive.unlink()
            # one mode for every file, as export writes them; before verifying: chmod changes the ctime that the
            # digest cache's key holds, and the first run would hash everything again
            for p in (staged, *staged.rglob("*")):
                p.chmod(0o755 if p.is_dir() else 0o644)
            return verify_bundle(staged, absent=regenerable_weights(read_manifest(staged))) if bundle else None
        except BundleError as e:
            shown = str(e).replace(str(staged), str(self.shown_as))
            raise FetchError(
                f"artifact {self.ref.name} of run {self.run.get('id')} is not a valid bundle: {shown}"
            ) from None


def write_provenance(staged: Path, api_url: str, repo: str, run: dict, artifact: dict, zip_sha256: str) -> None:
    """Where the bundle came from, beside it (PROVENANCE_NAME): the run, the artifact and the digests fetch
    verified. `bundle_digest` (model.pte's sha256) is what `bench` records of a bundle, so a result traces back
    to the CI artifact; `zip_sha256` is the artifact digest GitHub shows. The manifest's digests prove the files
    are the ones it names (integrity); this record says which CI run made them (origin, as far as the token's
    view of GitHub can tell: docs/ci.md)."""

    def plain(v):  # what GitHub answered, kept only where it is a plain value
        return v if isinstance(v, (str, int)) and not isinstance(v, bool) else None

    record = {
        "repository": repo,
        "api_url": redact(api_url),
        "run": {k: plain(run.get(k)) for k in ("id", "html_url", "head_sha", "head_branch", "event", "path")},
        "artifact": {k: plain(artifact.get(k)) for k in ("id", "name", "size_in_bytes", "created_at", "digest")},
        "zip_sha256": zip_sha256,
        "bundle_digest": bundle_digest(staged / MANIFEST_NAME),
        "fetched_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    path = staged / PROVENANCE_NAME
    path.write_text(json.dumps(record, indent=2) + "\n")
    path.chmod(0o644)


def main(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    ref = ArtifactRef(
        args.repo,
        args.name,
        run_id=args.run_id,
        latest=args.latest,
        branch=args.branch,
        workflow=args.workflow,
        allow_forks=args.allow_forks,
    )
    dest = fetch_artifact(
        ref,
        GitHubAccess(api_url=args.api_url or args.env.github_api_url, token=args.env.github_token),
        args.dest or Path("artifacts") / args.name,
        force=args.force,
        bundle=not args.files,
        progress=not args.no_progress and sys.stderr.isatty(),
        log=log,
        cancel=args.cancel,
    )
    print(dest)  # stdout carries only the directory, for DIR=$(python -m runner fetch ...)
    return 0
