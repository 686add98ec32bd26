"""The one place the environment is read. The CLI reads it once (`Environment.read`) and turns it and its flags
into option values that everything below takes as arguments.

    VOXTRAL_RUNNER_CACHE            compile cache and remembered digests (default $XDG_CACHE_HOME/voxtral-runner,
                                    else ~/.cache/voxtral-runner)
    VOXTRAL_RUNNER_PDL=0            no programmatic dependent launch: `export` leaves the wait out of the decode
                                    kernels, `run`/`bench` capture plain graph edges (as --no-pdl)
    VOXTRAL_RUNNER_REHASH=1         hash every bundle file again, ignoring remembered digests (as --rehash)
    DEBUG=1                         export: AOTI debug compile, generated sources kept in OUT/debug (as --debug-compile)
    GITHUB_TOKEN / GH_TOKEN         fetch: the token (never printed, never sent to the storage host)
    VOXTRAL_RUNNER_API_KEY          serve: the key clients give as `Authorization: Bearer KEY` (as --api-key;
                                    never printed)
    GITHUB_API_URL                  fetch: the API (GitHub Enterprise)
    GITHUB_SHA, GITHUB_ACTIONS,     bench: the commit measured, whether it ran in Actions, and the job summary
    GITHUB_STEP_SUMMARY             its table is appended to
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from runner.runtime.options import RuntimeOptions

TOKEN_VARS = ("GITHUB_TOKEN", "GH_TOKEN")


@dataclass(frozen=True)
class Environment:
    cache_dir: Path
    pdl: bool = True
    rehash: bool = False
    debug_compile: bool = False
    github_token: str | None = field(default=None, repr=False)  # a secret: never in a repr, a log or an error
    github_api_url: str | None = None
    github_sha: str | None = None
    github_actions: bool = False
    step_summary: Path | None = None
    api_key: str | None = field(default=None, repr=False)  # a secret, as github_token

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Environment:
        env = os.environ if environ is None else environ
        cache = env.get("VOXTRAL_RUNNER_CACHE") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "voxtral-runner"
        )
        token = next((env[v].strip() for v in TOKEN_VARS if env.get(v, "").strip()), None)
        return cls(
            cache_dir=Path(cache),
            pdl=env.get("VOXTRAL_RUNNER_PDL", "1") != "0",
            rehash=env.get("VOXTRAL_RUNNER_REHASH") == "1",
            debug_compile=env.get("DEBUG") == "1",
            github_token=token,
            github_api_url=env.get("GITHUB_API_URL") or None,
            github_sha=env.get("GITHUB_SHA") or None,
            github_actions=bool(env.get("GITHUB_ACTIONS")),
            step_summary=Path(env["GITHUB_STEP_SUMMARY"]) if env.get("GITHUB_STEP_SUMMARY") else None,
            api_key=env.get("VOXTRAL_RUNNER_API_KEY", "").strip() or None,
        )


def add_runtime_flags(p: argparse.ArgumentParser, encoder: bool = True) -> None:
    """The run-time switches of `run`, `bench` and `stream` (`encoder`: the audio_encoder's, not stream's); a
    switch with a variable above: the flag wins."""
    p.add_argument("--no-cuda-graph", action="store_true", help="CUDA: run decode steps and prefills without graphs")
    p.add_argument(
        "--no-pdl", action="store_true", help="CUDA: capture plain graph edges even where the bundle's kernels wait"
    )
    p.add_argument(
        "--no-warm-up",
        action="store_true",
        help="CUDA: skip the warm-up at load (each method called once, the decode step captured); the first "
        "file then pays for loading the kernels",
    )
    if encoder:
        p.add_argument(
            "--encoder-chunks",
            type=_count("chunks"),
            default=0,
            metavar="N",
            help="run audio_encoder on at most N 30 s chunks per call (default 0: all of a prompt's chunks at "
            "once); less GPU memory for long audio, the same transcript",
        )
        p.add_argument(
            "--prefill-chunk",
            type=_count("tokens"),
            default=0,
            metavar="T",
            help="prefill a prompt in pieces of at most T tokens (default 0: in one call), each attending to the "
            "ones before it; less GPU memory for long audio, the same transcript (CUDA bundles)",
        )
    else:
        p.set_defaults(encoder_chunks=0, prefill_chunk=0)
    p.add_argument("--rehash", action="store_true", help="hash every bundle file again (ignore remembered digests)")


# What runtime_options reads when a verb has none of the switches (export, inspect, fetch)
RUNTIME_FLAG_DEFAULTS = {
    "no_cuda_graph": False,
    "no_pdl": False,
    "no_warm_up": False,
    "encoder_chunks": 0,
    "prefill_chunk": 0,
    "rehash": False,
}


def add_runtime_defaults(p: argparse.ArgumentParser) -> None:
    """The switches' values for a parser without them; a verb that has them overrides these."""
    p.set_defaults(**RUNTIME_FLAG_DEFAULTS)


def _count(unit: str):
    """argparse's type for a whole number of `unit`, 0 or more (0: the switch is off)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = -1
        if n < 0:
            raise argparse.ArgumentTypeError(f"{text!r}: a whole number of {unit}, 0 or more")
        return n

    return parse


def runtime_options(args: argparse.Namespace, env: Environment) -> RuntimeOptions:
    """The switches (every verb has them: its own flags, or add_runtime_defaults' values) and the environment."""
    return RuntimeOptions(
        cuda_graph=not args.no_cuda_graph,
        warm_up=not args.no_warm_up,
        encoder_chunks=args.encoder_chunks,
        prefill_chunk=args.prefill_chunk,
        pdl=env.pdl and not args.no_pdl,
        rehash=env.rehash or args.rehash,
        cache_dir=env.cache_dir,
    )
