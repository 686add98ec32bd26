"""The GPU workflow's first job, on a hosted runner, in seconds: is there a GPU runner to send the jobs to, and
are the dispatch inputs ones the jobs can run? One `error:` line (and a `::error::` annotation) per problem.

    python ci_scripts/preflight.py   # reads CUDA_RUNNER_LABEL, PRESET, CHECKPOINT, DTYPE, MAX_NEW_TOKENS, BENCHMARK_RUNS
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping

PRESETS = ("voxtral-mini-3b", "tiny")
DTYPES = ("bf16", "fp32")
MAX_NEW_TOKENS = (1, 4096)
BENCHMARK_RUNS = (1, 100)
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def _whole(value: str, name: str, lo: int, hi: int) -> str | None:
    if not value.strip().isdigit() or not lo <= int(value) <= hi:
        return f"{name} {value!r}: a whole number from {lo} to {hi}"
    return None


def problems(env: Mapping[str, str]) -> list[str]:
    out = []
    if not env.get("CUDA_RUNNER_LABEL", "").strip():
        out.append(
            "no GPU runner configured: set the repository variable CUDA_RUNNER_LABEL to the label of a self-hosted "
            "GPU runner (docs/ci.md says what it must provide)"
        )
    checkpoint = env.get("CHECKPOINT", "")
    if checkpoint and not (checkpoint.startswith("/") or HUB_ID.match(checkpoint)):
        out.append(f"checkpoint {checkpoint!r}: a hub id (OWNER/NAME) or an absolute path on the runner")
    if not checkpoint and env.get("PRESET", "") not in PRESETS:
        out.append(f"preset {env.get('PRESET', '')!r}: choose from {', '.join(PRESETS)}")
    if env.get("DTYPE", "") not in DTYPES:
        out.append(f"dtype {env.get('DTYPE', '')!r}: choose from {', '.join(DTYPES)}")
    for name, (lo, hi) in (("MAX_NEW_TOKENS", MAX_NEW_TOKENS), ("BENCHMARK_RUNS", BENCHMARK_RUNS)):
        p = _whole(env.get(name, ""), name.lower().replace("_", "-"), lo, hi)
        if p:
            out.append(p)
    return out


def main(env: Mapping[str, str] | None = None) -> int:
    found = problems(os.environ if env is None else env)
    for p in found:
        print(f"::error::{p}")
        print(f"error: {p}", file=sys.stderr)
    if not found:
        print("preflight: a GPU runner is configured and the inputs are valid")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
