"""`bench`'s flags, apart from the verb (runner/app/bench/verb.py): `--help` builds them without importing torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from runner.app.bench.report import GROUPS
from runner.app.options import add_runtime_flags
from runner.audio import TOKENS_PER_CHUNK
from runner.fixtures import fixtures_dir

DEFAULT_AUDIO = fixtures_dir() / "audio" / "speech.wav"
PEERS = ("eager", "hf", "hf-compile")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bundle",
        type=Path,
        default=None,
        help="bundle directory (python -m runner export); required unless --from-json",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="measure nothing: report (table, --chart, --baseline gate) from an earlier --json output",
    )
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="default: the device the bundle was built for"
    )
    p.add_argument(
        "--chunks",
        type=int,
        default=1,
        help=f"30 s audio chunks for the per-method shapes; prefill length = chunks x {TOKENS_PER_CHUNK} + prompt text",
    )
    p.add_argument("--audio", type=Path, default=DEFAULT_AUDIO, help="audio file for the end-to-end figures")
    p.add_argument("--language", default=None, help="e2e: the transcription prompt's language (adds lang:xx, as `run`)")
    p.add_argument("--runs", type=int, default=None, help="timed runs per figure (default: 5 on CPU, 10 on CUDA)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones")
    p.add_argument(
        "--load-runs", type=int, default=1, help="full loads to time per backend (the first is not a warm-up)"
    )
    p.add_argument(
        "--min-new-tokens",
        type=int,
        default=32,
        help="e2e: generate at least this many tokens (random weights hit </s> at random)",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="e2e: generate at most this many tokens")
    p.add_argument(
        "--compare",
        default="eager",
        help="comma list of peers: eager (our eager model), hf (transformers' VoxtralForConditionalGeneration), "
        "hf-compile (the same with a static cache + torch.compile); 'none' for ours only",
    )
    p.add_argument(
        "--throughput-files",
        type=int,
        default=None,
        metavar="N",
        help="also the throughput figures: N files (--audio repeated, or --throughput-list's, cycled) through "
        "batched generation at each --batch, one timed pass each: generated tokens/s over the wall time, RTFx, "
        "p50/p99 per-file latency, wall time after load",
    )
    p.add_argument(
        "--throughput-list",
        type=Path,
        default=None,
        metavar="FILE",
        help="the throughput files: a list as `run --audio-list` reads it (default N: all of them)",
    )
    p.add_argument(
        "--batch",
        default="1",
        metavar="B[,B...]",
        help="with --throughput-files: the batch sizes to time, each a pass over the same files (1,8,32: the "
        "serial pass beside the batched ones); above 1 needs a bundle exported with --max-batch",
    )
    add_runtime_flags(p)
    p.add_argument("--json", type=Path, default=None, help="write the PyTorch OSS benchmark v3 records here")
    p.add_argument(
        "--chart",
        type=Path,
        default=None,
        help="write a PNG here: decode tokens/s and time to first token per backend, and the latency breakdown",
    )
    p.add_argument("--baseline", type=Path, default=None, help="earlier --json output to compare with")
    p.add_argument(
        "--baseline-optional",
        action="store_true",
        help="with --baseline: a missing or empty baseline file (no earlier green run) skips the gate, saying so, "
        "instead of failing",
    )
    p.add_argument(
        "--max-regression",
        type=str,
        default=20.0,
        metavar="PCT[,NAME=PCT...]",
        help="with --baseline: fail when one of our gated figures is worse by more than this percentage; a comma "
        "list sets it per figure or group, a bare number being the default (20,decode_tokens_per_s=5,memory=10)",
    )
    p.add_argument(
        "--gate",
        default="method,e2e,memory",
        help=f"figures the baseline gate checks: metric names or groups ({', '.join(GROUPS)})",
    )
