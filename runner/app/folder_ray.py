"""`run --ray [ADDRESS]`: a folder run spread over the workers of a Ray cluster (a local one, or one joined).

Each worker is a Ray actor holding one loaded bundle (runner/app/api.py's Model); it is given a few files at a
time, reads and decodes them itself and runs them through `run`'s own continuous batching (Model.file_results). Results come back to the driver, which writes each file's record once, through the same Reporter
and --out file a single-process run uses: the records are that run's. A worker that dies is restarted and its
files given to it again (the actor's max_restarts, its tasks' max_task_retries); the driver keeps the first
result of each file, so a retried file is neither lost nor written twice. The workers must see the files at the
paths the driver names (one machine, or a shared file system).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from runner.app.e2e_summary import E2ESummary
from runner.app.folder import FilePlan
from runner.app.os_errors import reason
from runner.app.run_args import RAY_PROBE_S, RunOptions
from runner.errors import RunnerError

LOCAL = "local"  # --ray without an address: start a Ray cluster on this machine
CHUNK_BATCHES = 4  # a worker is given this many batches of files at a time: its batch stays full between chunks
MAX_RESTARTS = 3  # a worker that dies is started again this many times (its bundle loaded again)
MAX_TASK_RETRIES = 3  # and its files given to it again
INSTALL = 'pip install -e ".[ray]"'
CHECK_FLAGS = {"reference": "--reference", "expect": "--expect", "expect_tokens": "--expect-tokens", "wer": "--wer"}
# --ray ADDRESS: the connection, then the server's first answer, each within this. ray.init itself dials a dead
# address for many minutes (Ray 2.60: 20 tries of about 35 s each), so the address is tried first.
PROBE_S = RAY_PROBE_S
# What a gRPC server (Ray's GCS, or its client server behind ray://) is sent first: HTTP/2's client preface and an
# empty SETTINGS frame. It answers with a SETTINGS frame of its own (frame type 4, the 4th byte of the 9-byte head).
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
H2_SETTINGS = 4


def check_args(args: argparse.Namespace) -> None:
    """--ray's one-line refusals, before any file is read: Ray missing, no --out, a check that needs one process."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise RunnerError(f"--ray needs Ray: {INSTALL}") from None
    if args.out is None:
        raise RunnerError("--ray needs --out FILE: the workers' records are written there")
    given = [flag for name, flag in CHECK_FLAGS.items() if getattr(args, name, None)]
    if given:
        raise RunnerError(
            f"--ray: {', '.join(given)} check(s) the run as a whole on one machine; run them without --ray, or "
            "check the --out records after"
        )


@dataclass(frozen=True)
class Finished:
    """A file's outcome as a worker sends it back: its result, or its error's message."""

    audio: str
    result: object | None  # a GenerationResult
    error: str | None = None


class Worker:
    """One loaded bundle in a Ray actor; `transcribe` runs a chunk of files through `run`'s batching."""

    def __init__(self, bundle: str, options: RunOptions):
        from runner.app.api import Model

        self.options = options
        self.problem: str | None = None  # the bundle cannot run here: said once by the driver
        try:
            self.model = Model(bundle, options.runtime)
            self._check()
        except RunnerError as e:
            self.problem = str(e)

    def _check(self) -> None:
        from runner.app.run import STREAMING

        m = self.model
        if m.capabilities.streaming:
            raise RunnerError(f"{m.bundle_dir}: {STREAMING}")
        if self.options.word_timestamps:
            m.check_word_timestamps()

    def ready(self) -> str | None:
        return self.problem

    def transcribe(self, paths: list[str]) -> list[Finished]:
        from runner.app.run import generation_options

        o = self.options
        files = [Path(p) for p in paths]
        done = self.model.file_results(
            files, generation_options(o), batch=o.batch, prompt=o.prompt, language=o.language
        )
        return [Finished(str(r.job.key), r.result, None if r.error is None else str(r.error)) for r in done]


def run_on_ray(args: argparse.Namespace, plan: FilePlan) -> int:
    """Every file of `plan` through the cluster's workers; the exit code as `run --out` gives it."""
    import ray

    from runner.bundle import read_manifest

    options = RunOptions.from_args(args)
    manifest = read_manifest(args.bundle)
    started = not ray.is_initialized()  # a driver already connected (a notebook, the tests) keeps its cluster
    if started:
        _connect(ray, args.ray, args.workers)
    workers: list = []
    try:
        _start_workers(ray, workers, args.bundle, options, manifest.device == "cuda", args.workers)
        return _report(ray, workers, plan, options, args.bundle, manifest)
    finally:
        for w in workers:  # their CPUs and GPUs free at once, in a cluster that outlives this run too
            ray.kill(w, no_restart=True)
        if started:
            ray.shutdown()


def _connect(ray, address: str, workers: int | None) -> None:
    quiet = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    if address == LOCAL:  # "local", never $RAY_ADDRESS: a new cluster of this machine's CPUs and GPUs
        ray.init(address=LOCAL, num_cpus=workers, **quiet)
        return
    quiet.pop("include_dashboard")  # the joined cluster's head decides that
    why = unreachable(address)
    if why is not None:
        raise RunnerError(f"--ray {address}: cannot join a Ray cluster there ({why})")
    try:
        ray.init(address=address, **quiet)
    except (ConnectionError, ValueError, RuntimeError) as e:  # no cluster there, or not one Ray can join
        raise RunnerError(f"--ray {address}: cannot join a Ray cluster there ({str(e).strip().splitlines()[0]})") from e


def unreachable(address: str) -> str | None:
    """Why nothing at ADDRESS can be a Ray cluster, in a few words; None where one may be. The host and port
    ray.init would dial must take a TCP connection and answer HTTP/2's preface as a gRPC server does, each within
    PROBE_S (a name that does not resolve fails as fast as the system's resolver says so)."""
    target = _dialled(address)
    if target is None:  # no address to try (auto with no cluster, a malformed one): ray.init says why at once
        return None
    host, port = target
    try:
        with socket.create_connection((host, port), timeout=PROBE_S) as s:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):  # TLS first: the connection is all
                return None
            s.sendall(H2_PREFACE)
            head = _read(s, 9)
    except socket.gaierror as e:
        return f"{host} does not resolve: {reason(e)}"
    except TimeoutError:
        return f"no answer from {host}:{port} within {PROBE_S} s"
    except OSError as e:
        return f"{host}:{port}: {reason(e)}"
    if len(head) < 9 or head[3] != H2_SETTINGS:
        return f"{host}:{port} answers, but not as a Ray cluster's gRPC server does"
    return None


def _dialled(address: str) -> tuple[str, int] | None:
    """The host and port ray.init dials for ADDRESS, as Ray resolves it: auto as $RAY_ADDRESS, else a cluster
    started on this machine; localhost as this machine's address; ray://HOST:PORT through Ray's client."""
    if address == "auto" and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    if "://" in address:
        address = address.split("://", 1)[1]
    else:
        try:  # Ray's own resolution: what it dials, not what was typed
            from ray._private.services import canonicalize_bootstrap_address
        except ImportError:  # a Ray that moved it: the address as given
            pass
        else:
            try:
                address = canonicalize_bootstrap_address(address)
            except (ConnectionError, ValueError):
                return None
    if address is None:
        return None
    host, _, port = address.rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def _read(s: socket.socket, n: int) -> bytes:
    """Up to n bytes: fewer only where the other end closed first."""
    data = b""
    while len(data) < n and (chunk := s.recv(n - len(data))):
        data += chunk
    return data


def _start_workers(ray, started: list, bundle: Path, options: RunOptions, cuda: bool, workers: int | None) -> None:
    """`started` gets each worker as it is started (for the caller to stop them however this ends)."""
    resource = "GPU" if cuda else "CPU"
    have = int(ray.cluster_resources().get(resource, 0))
    n = workers or max(1, have)
    if n > have:  # an autoscaling cluster may grow to fit them; a fixed one leaves the rest waiting
        print(
            f"note: --workers {n}: the cluster has {have} {resource}(s) now; the others wait for more", file=sys.stderr
        )
    actor = ray.remote(Worker).options(
        num_cpus=1, num_gpus=1 if cuda else 0, max_restarts=MAX_RESTARTS, max_task_retries=MAX_TASK_RETRIES
    )
    started += [actor.remote(str(bundle.resolve()), options) for _ in range(n)]
    problems = [p for p in ray.get([w.ready.remote() for w in started]) if p is not None]
    if problems:
        raise RunnerError(problems[0])


def _report(ray, workers: list, plan: FilePlan, options: RunOptions, bundle: Path, manifest) -> int:
    from runner.app.report import Reporter
    from runner.runtime.batch import Job, JobResult

    summary = E2ESummary(f"run on Ray: {bundle.name} ({manifest.device}), {len(plan.todo)} file(s)", "", len(plan.todo))
    report = Reporter(options, summary, plan.out, sys.stderr.isatty(), manifest.model.get("max_seq_len"))
    by_name = {str(p): p for p in plan.todo}
    with report:  # the job summary is written however the run ends
        with report.showing_progress():
            for done in _outcomes(ray, workers, list(by_name), options.batch * CHUNK_BATCHES):
                path = by_name.pop(done.audio, None)
                if path is None:  # already written (a retried chunk's file): once only
                    continue
                if done.error is not None:
                    report.file_failed(path, RunnerError(done.error))
                    continue
                result = JobResult(Job(path, []), done.result)
                report.file_text(result)
                report.file_checked(result, [])
        report.totals([])
    return report.exit_code()


def _outcomes(ray, workers: list, files: list[str], chunk: int) -> Iterator[Finished]:
    """Each file's outcome as its chunk finishes, one chunk at a time on each worker. A chunk whose worker died
    past its retries is an error for each of its files (error records run again on a re-run)."""
    todo = deque(files[i : i + chunk] for i in range(0, len(files), chunk))
    idle, pending = deque(workers), {}
    while todo or pending:
        while idle and todo:
            worker, paths = idle.popleft(), todo.popleft()
            pending[worker.transcribe.remote(paths)] = (worker, paths)
        [ref], _ = ray.wait(list(pending), num_returns=1)
        worker, paths = pending.pop(ref)
        idle.append(worker)
        try:
            yield from ray.get(ref)
        except ray.exceptions.RayError as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            yield from (Finished(p, None, f"{p}: its Ray worker failed ({why})") for p in paths)
