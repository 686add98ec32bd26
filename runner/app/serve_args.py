"""`serve`'s flags and the options value made from them once, apart from the server (runner/app/serve.py, which
imports starlette, uvicorn and torch): `--help` builds them without any of those."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from runner.app.options import add_runtime_flags
from runner.app.run_args import number, whole

MAX_QUEUE = 100_000
MAX_UPLOAD_MB = 100_000.0
MAX_IDLE_S = 24 * 3600.0  # a day: past it a silent connection is abandoned, not idle


@dataclass(frozen=True)
class ServeOptions:
    """What the server does, from the flags and the environment; made once, at the CLI's edge."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr, a log or an error
    max_batch: int | None = None  # None: the bundle's max_batch
    max_upload_bytes: int = 200 * 2**20
    max_queue: int = 64
    max_new_tokens: int | None = None
    realtime_idle_s: float = 60.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        return cls(
            host=args.host,
            port=args.port,
            api_key=args.api_key or args.env.api_key,  # the flag wins, as every switch with a variable
            max_batch=args.max_batch,
            max_upload_bytes=int(args.max_upload_mb * 2**20),
            max_queue=args.max_queue,
            max_new_tokens=args.max_new_tokens,
            realtime_idle_s=args.realtime_idle_s,
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", type=Path, required=True, help="bundle directory (python -m runner export)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (0.0.0.0: every interface; give --api-key then, and put TLS in front)",
    )
    p.add_argument("--port", type=whole(0, 65535), default=8000, help="TCP port (0: any free one)")
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="every route but /health needs `Authorization: Bearer KEY` (default: $VOXTRAL_RUNNER_API_KEY, else "
        "no key); a flag shows in the process list, the variable does not",
    )
    p.add_argument(
        "--max-batch",
        type=whole(1, 4096),
        default=None,
        metavar="N",
        help="decode at most N queued requests at once (default: the bundle's --max-batch; more than 1 needs a "
        "bundle exported with --max-batch)",
    )
    p.add_argument(
        "--max-upload-mb",
        type=number(0.0, MAX_UPLOAD_MB),
        default=200.0,
        metavar="MB",
        help="refuse a request body larger than this (413)",
    )
    p.add_argument(
        "--max-queue",
        type=whole(1, MAX_QUEUE),
        default=64,
        metavar="N",
        help="requests waiting for the model at most; one more is refused (429, Retry-After); on a realtime bundle, "
        "connections waiting for a stream slot (one more gets a queue_full error event)",
    )
    p.add_argument(
        "--realtime-idle-s",
        type=number(0.0, MAX_IDLE_S),
        default=60.0,
        metavar="S",
        help="close a /v1/realtime connection that sends nothing for S seconds (an idle_timeout error event first; "
        "its stream slot is given back)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=whole(1, 10**9),
        default=None,
        metavar="N",
        help="stop each transcript after N tokens (default: at </s> or the bundle's context)",
    )
    add_runtime_flags(p)
