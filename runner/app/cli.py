"""`python -m runner export|run|bench|inspect|fetch`: the verbs are the nox sessions are the workflow jobs.

Errors a user can cause end as one `error: …` line and exit code 1 (`--debug` shows the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys

from runner import __version__
from runner.app.bench.args import add_arguments as add_bench  # the flags only, no torch
from runner.app.export_cmd import add_arguments as add_export  # the flags only, no torch
from runner.app.inspect_bundle import add_arguments as add_inspect  # the flags only, no torch
from runner.app.options import Environment, add_runtime_defaults, runtime_options
from runner.app.os_errors import reason
from runner.app.run_args import add_arguments as add_run  # the flags only, no torch
from runner.app.serve_args import add_arguments as add_serve  # the flags only, no starlette or torch
from runner.app.stream import add_arguments as add_stream  # the flags only, no torch
from runner.errors import Cancellation, RunnerError, Terminated

# ---------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    from runner.app import folder

    if args.ray is not None:
        from runner.app import folder_ray

        folder_ray.check_args(args)  # Ray installed, and --out: one line before any file is read
    # the files, --batch and --out are checked (and --out read) before the program loads: a typo fails at once
    work = folder.prepare(args)
    try:
        if not work.todo:
            print(f"note: every file already has a record in {args.out}; nothing to do", file=sys.stderr)
            return 0
        if args.ray is not None:
            return folder_ray.run_on_ray(args, work)
        return _run_loaded(args, work)
    finally:
        work.close()


def _run_loaded(args: argparse.Namespace, work) -> int:
    from runner.app.run import run_files

    # a live progress bar only on a real terminal (as export's spinner): in a log it would draw its frames
    return run_files(args, work, live=sys.stderr.isatty())


# ---------------------------------------------------------------- fetch


def add_fetch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo", required=True, help="OWNER/NAME of the repository whose CI built the bundle")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--run-id", type=int, help="workflow run id (the number in .../actions/runs/ID)")
    which.add_argument("--latest", action="store_true", help="the newest successful run with that artifact")
    p.add_argument("--branch", help="with --latest: only runs on this branch")
    p.add_argument("--workflow", help="with --latest: only runs of this workflow file (e.g. ci.yml, cuda.yml)")
    p.add_argument("--name", required=True, help="artifact name, e.g. voxtral-bundle-tiny-cpu-fp32")
    p.add_argument("--dest", help="directory the bundle's files land in (default: artifacts/NAME)")
    # the URL is runner.app.github.DEFAULT_API_URL, written out: that module imports requests
    p.add_argument(
        "--api-url", default=None, help="GitHub API root (default: $GITHUB_API_URL, else https://api.github.com)"
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty --dest")
    p.add_argument("--allow-forks", action="store_true", help="with --latest: also consider fork PR runs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--files",
        action="store_true",
        help="the artifact holds files, not a bundle (e.g. benchmark-NAME results): extract them, no bundle check",
    )


# ---------------------------------------------------------------- the parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default, except None and False: those mean "unset" or "off" (and the help says why)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _add_common_flags(p: argparse.ArgumentParser, before_verb: bool) -> None:
    """-v and --debug, before the verb and after it. After it the default is SUPPRESS: the verb's parser sets
    them only when given, so it never resets a value given before the verb."""
    unset = argparse.SUPPRESS
    p.add_argument(
        "-v", "--verbose", action="count", default=0 if before_verb else unset, help="-v: per-method detail, -vv: debug"
    )
    p.add_argument("--debug", action="store_true", default=False if before_verb else unset, help="show tracebacks")


def build_parser(prog: str = "python -m runner") -> argparse.ArgumentParser:
    """The whole CLI without importing torch (or requests): each verb imports what it needs when it runs."""
    fmt = _HelpFormatter
    p = argparse.ArgumentParser(
        prog=prog,
        formatter_class=fmt,
        description="Voxtral on AOTInductor: export a bundle, run it, time it, inspect it, or fetch one from a CI run.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_common_flags(p, before_verb=True)
    add_runtime_defaults(p)  # the runtime switches' values for the verbs that have none (runtime_options reads them)
    common = argparse.ArgumentParser(add_help=False)
    _add_common_flags(common, before_verb=False)
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    verbs = {
        "export": (add_export, _verb("runner.app.export_cmd"), "build a bundle (.so per method, weights, model.pte)"),
        "run": (add_run, cmd_run, "transcribe / answer about audio files with a bundle"),
        "inspect": (add_inspect, _verb("runner.app.inspect_bundle"), "show a bundle's manifest"),
        "bench": (add_bench, _verb("runner.app.bench.verb"), "time a bundle beside the eager model"),
        "fetch": (add_fetch, _verb("runner.app.fetch"), "download a bundle artifact from a GitHub Actions run"),
        "stream": (add_stream, _verb("runner.app.stream"), "transcribe audio as it arrives (voxtral-realtime bundles)"),
        "serve": (add_serve, _verb("runner.app.serve"), "answer OpenAI-style transcription requests over HTTP"),
    }
    for name, (add, fn, help_) in verbs.items():
        sp = sub.add_parser(name, help=help_, description=help_, formatter_class=fmt, parents=[common])
        add(sp)
        sp.set_defaults(fn=fn)
    return p


def _verb(module: str):
    """A verb whose implementation (and its torch) is imported only when it runs."""

    def run(args: argparse.Namespace) -> int:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # the other verbs stay usable where this one's extras are not installed
            raise RunnerError(f"{args.verb} is unavailable here: {e}") from e
        return mod.main(args)

    return run


def console() -> int:
    """The `voxtral-runner` console script: the same CLI, its usage naming the script."""
    return main(prog="voxtral-runner")


def main(argv: list[str] | None = None, prog: str = "python -m runner") -> int:
    args = build_parser(prog).parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM (timeout, a CI cancellation, a closed terminal) unwinds like Ctrl-C, so every `finally` and
    # `except BaseException` below removes what it was building (an export's stage, a fetch's partial zip); the
    # verbs take the Cancellation to check where stopping is safe (an export, before it publishes)
    args.cancel = Cancellation()
    previous = _handle_sigterm(args.cancel)
    try:
        # the environment is read here, once; every verb takes its switches from these values
        args.env = Environment.read(os.environ)
        args.runtime = runtime_options(args, args.env)
        return args.fn(args)
    except Terminated:
        return _terminated()
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.cancel.requested:  # after SIGTERM: torch's cleanup may have replaced the exception it raised
            return _terminated()
        if args.debug or not isinstance(e, RunnerError | OSError):
            raise
        if isinstance(e, OSError):  # what the system refused (disk full, permissions), with the file it names
            print(f"error: {f'{e.filename}: ' if e.filename else ''}{reason(e)}", file=sys.stderr)
        else:
            print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _handle_sigterm(cancel: Cancellation):
    """Make SIGTERM cancel `cancel` and raise Terminated where the process is; returns the handler it replaced
    (None where none was set: not the main thread, whose embedding program keeps its own)."""

    def on_sigterm(signum, frame) -> None:
        cancel.cancel()
        raise Terminated()

    try:
        return signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread
        return None


def _terminated() -> int:
    print("error: terminated", file=sys.stderr)
    return 128 + signal.SIGTERM
