"""The GPU workflow's first job, on a hosted runner, in seconds: is there a GPU runner to send the jobs to, and
are the dispatch inputs ones the jobs can run? One `error:` line (and a `::error::` annotation) per problem.
When all is well it writes the jobs' matrix (`matrix=` JSON, with --github-output): by default every preset in
CELLS at the chosen dtype; a dispatch may pick one preset, or a checkpoint (one cell); `runs-on=` the runner's
label(s) as JSON (CUDA_RUNNER_LABEL: one label, or a JSON list such as ["self-hosted", "gpu"]); and `run=true`.
A scheduled run (EVENT_NAME schedule) in a repository without a GPU runner is not a failure: a notice, `run=false`,
and the GPU jobs are skipped. A dispatch without one still fails in one line.

    python ci_scripts/preflight.py [--github-output FILE]
        # reads CUDA_RUNNER_LABEL, EVENT_NAME, PRESET, CHECKPOINT, DTYPE, QUANT, MAX_NEW_TOKENS, BENCHMARK_RUNS
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


NO_RUNNER = (
    "no GPU runner configured: set the repository variable CUDA_RUNNER_LABEL to the label of a self-hosted GPU runner "
    '(or a JSON list of labels, e.g. ["self-hosted", "gpu"]; docs/ci.md says what it must provide)'
)
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*", re.ASCII)


def runner_labels(value: str) -> list[str] | str | None:
    """CUDA_RUNNER_LABEL as runs-on takes it: one label, or a JSON list of labels; None if it is neither."""
    value = value.strip()
    if not value.startswith("["):
        return value if LABEL.fullmatch(value) else None
    try:
        labels = json.loads(value)
    except (ValueError, RecursionError):
        return None
    ok = isinstance(labels, list) and labels and all(isinstance(x, str) and LABEL.fullmatch(x) for x in labels)
    return labels if ok else None


def problems(env: Mapping[str, str]) -> list[str]:
    out = []
    label = env.get("CUDA_RUNNER_LABEL", "").strip()
    if not label:
        out.append(NO_RUNNER)
    elif runner_labels(label) is None:
        out.append(
            f'CUDA_RUNNER_LABEL {label!r}: a runner label, or a JSON list of labels such as ["self-hosted", "gpu"]'
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
    if env.get("EVENT_NAME") == "schedule" and not env.get("CUDA_RUNNER_LABEL", "").strip():
        print(f"::notice::the weekly GPU run is skipped: {NO_RUNNER}")
        print(f"preflight: skipped: {NO_RUNNER}", file=sys.stderr)
        write_outputs(args.github_output, run=False)
        return 0
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
    write_outputs(args.github_output, run=True, matrix=cells, labels=runner_labels(env["CUDA_RUNNER_LABEL"]))
    return 0


def write_outputs(path: str | None, run: bool, matrix: dict | None = None, labels=None) -> None:
    """The jobs' inputs: run=true|false, the matrix and runs-on (both JSON, for fromJSON)."""
    if not path:
        return
    if not run:  # the skipped jobs' matrix and runs-on still parse (act evaluates them)
        matrix, labels = {"include": []}, "ubuntu-latest"
    lines = [f"run={str(run).lower()}", f"matrix={json.dumps(matrix, separators=(',', ':'))}"]
    lines.append(f"runs-on={json.dumps(labels)}")
    with open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines))


if __name__ == "__main__":
    sys.exit(main())
