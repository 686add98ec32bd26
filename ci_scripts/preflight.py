"""The GPU workflow's first job, on a hosted runner, in seconds: is there a GPU runner to send the jobs to, and
are the dispatch inputs ones the jobs can run? One `error:` line (and a `::error::` annotation) per problem.
When all is well it writes the jobs' matrix (`matrix=` JSON, with --github-output): by default every preset in
CELLS at the chosen dtype; a dispatch may pick one preset, or a checkpoint (one cell).

    python ci_scripts/preflight.py [--github-output FILE]
        # reads CUDA_RUNNER_LABEL, PRESET, CHECKPOINT, DTYPE, QUANT, MAX_NEW_TOKENS, BENCHMARK_RUNS
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping

PRESETS = ("voxtral-mini-3b", "tiny")
# The matrix's cells: (cell key, preset, random weights, --quant). The cell key names the export job's digest
# output (`digest-<cell>` in cuda.yml), so a new cell needs a line there too.
CELLS = (
    ("tiny", "tiny", False, "none"),
    ("3b", "voxtral-mini-3b", True, "none"),
    ("3b-int4", "voxtral-mini-3b", True, "int4"),
)
ALL = "all"
DTYPES = ("bf16", "fp32")
QUANTS = ("none", "int4")
INT4_DTYPE = "bf16"  # torch's int4 kernels (tinygemm) take bf16: the exporter refuses int4 on CUDA in fp32
MAX_NEW_TOKENS = (1, 4096)
BENCHMARK_RUNS = (1, 100)
# fullmatch, ASCII only: `$` would let a trailing newline through, \d and str.isdigit take other scripts' digits
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*", re.ASCII)
WHOLE = re.compile(r"[0-9]{1,9}", re.ASCII)
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _whole(value: str, name: str, lo: int, hi: int) -> str | None:
    if not WHOLE.fullmatch(value) or not lo <= int(value) <= hi:
        return f"{name} ({name.lower().replace('_', '-')}) {value!r}: a whole number from {lo} to {hi}"
    return None


def _checkpoint_ok(checkpoint: str) -> bool:
    if checkpoint.startswith("/"):
        return not CONTROL.search(checkpoint)  # a line break would split the job's outputs and commands
    return bool(HUB_ID.fullmatch(checkpoint))


def preset_cells(preset: str, quant: str, dtype: str = INT4_DTYPE) -> list[tuple]:
    """The CELLS a dispatch's preset and quant (either may be "all") pick at `dtype` (int4 cells: bf16 only)."""
    return [
        c for c in CELLS if preset in (ALL, c[1]) and quant in (ALL, c[3]) and (c[3] != "int4" or dtype == INT4_DTYPE)
    ]


def problems(env: Mapping[str, str]) -> list[str]:
    out = []
    if not env.get("CUDA_RUNNER_LABEL", "").strip():
        out.append(
            "no GPU runner configured: set the repository variable CUDA_RUNNER_LABEL to the label of a self-hosted "
            "GPU runner (docs/ci.md says what it must provide)"
        )
    checkpoint = env.get("CHECKPOINT", "")
    if checkpoint and not _checkpoint_ok(checkpoint):
        out.append(f"checkpoint {checkpoint!r}: a hub id (OWNER/NAME) or an absolute path on the runner")
    if not checkpoint and env.get("PRESET", "") not in (*PRESETS, ALL):
        out.append(f"preset {env.get('PRESET', '')!r}: choose from {', '.join((ALL, *PRESETS))}")
    if env.get("DTYPE", "") not in DTYPES:
        out.append(f"dtype {env.get('DTYPE', '')!r}: choose from {', '.join(DTYPES)}")
    quant, preset = env.get("QUANT", ALL), env.get("PRESET", "")
    if quant not in (ALL, *QUANTS):
        out.append(f"quant {quant!r}: choose from {', '.join((ALL, *QUANTS))}")
    elif quant == "int4" and env.get("DTYPE", "") in DTYPES and env.get("DTYPE") != INT4_DTYPE:
        out.append(
            f"quant int4 runs in {INT4_DTYPE} only (torch's int4 kernels take {INT4_DTYPE}): pick dtype {INT4_DTYPE}"
        )
    elif not checkpoint and preset in (*PRESETS, ALL) and not preset_cells(preset, quant):
        have = ", ".join(f"{c[1]} {c[3]}" for c in CELLS)
        out.append(f"no cell is preset {preset} with quant {quant}: the cells are {have}")
    for name, (lo, hi) in (("MAX_NEW_TOKENS", MAX_NEW_TOKENS), ("BENCHMARK_RUNS", BENCHMARK_RUNS)):
        p = _whole(env.get(name, ""), name, lo, hi)
        if p:
            out.append(p)
    return out


def matrix(env: Mapping[str, str]) -> dict:
    """The matrix for valid inputs: {"include": [{cell, preset, checkpoint, random-init, dtype, quant}, ...]}."""
    dtype, checkpoint, preset = env.get("DTYPE", ""), env.get("CHECKPOINT", ""), env.get("PRESET", ALL)
    quant = env.get("QUANT", ALL)
    if checkpoint:
        cells = [("checkpoint", "", False, "none" if quant == ALL else quant)]
    else:
        cells = preset_cells(preset, quant, dtype)
    include = [
        {"cell": cell, "preset": p, "checkpoint": checkpoint, "random-init": str(rand).lower(), "dtype": dtype}
        | {"quant": q}
        for cell, p, rand, q in cells
    ]
    return {"include": include}


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--github-output", help="append matrix=<JSON> here ($GITHUB_OUTPUT)")
    args = ap.parse_args(argv)
    env = os.environ if env is None else env
    found = problems(env)
    for p in found:
        print(f"::error::{p}")
        print(f"error: {p}", file=sys.stderr)
    if found:
        return 1
    cells = matrix(env)
    print(
        "preflight: a GPU runner is configured and the inputs are valid; cells: "
        + ", ".join(c["cell"] for c in cells["include"])
    )
    if args.github_output:
        with open(args.github_output, "a") as f:
            f.write(f"matrix={json.dumps(cells, separators=(',', ':'))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
