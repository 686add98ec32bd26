"""Render a JSON results file (the benchmark's `--json` output, or any JSON object) as markdown for the job
page: `python ci_scripts/job_summary.py results.json [--title T] [--out FILE]`. --out defaults to
$GITHUB_STEP_SUMMARY when set, else stdout. A missing file is a note, not a failure: the step that was meant to
write it has already failed and said why.

Shapes: `runner bench --json` output (v3 benchmark records) becomes bench's own headline table (ours beside each
peer, with ratios, at most 15 rows; runner/app/bench/report.py, stdlib only, imported from the checkout); any other
list of flat records (or an object holding one, e.g. {"results": [...]}) becomes one table with a column per key;
any other object becomes a two-column table of its leaves, nested keys dotted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runner/ without installing it (stdlib only here)

from runner.app.bench.report import from_records, markdown  # noqa: E402
from runner.app.e2e_summary import md_text  # noqa: E402
from runner.errors import RunnerError  # noqa: E402

V3_KEYS = ("benchmark", "model", "metric")


def cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        v = json.dumps(v, separators=(",", ":"))
    return md_text(v)


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): obj}


def records(data: Any) -> list[dict] | None:
    """The list of records in `data`, if it is one or holds exactly one."""
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        return data
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]
        if len(lists) == 1:
            return lists[0]
    return None


def bench_records(data: Any) -> bool:
    """Whether `data` is a list of v3 benchmark records (what `runner bench --json` writes)."""
    return isinstance(data, list) and bool(data) and all(isinstance(r, dict) and set(V3_KEYS) <= set(r) for r in data)


def render(data: Any, title: str, source: Path = Path("results.json")) -> str:
    note = ""
    if bench_records(data):
        try:
            return markdown(from_records(data, source), title=title) + "\n"
        except RunnerError as e:  # v3 records of another tool: the generic table below
            note = f"_{md_text(e)}_\n\n"
    lines = [f"### {md_text(title)}", "", *([note] if note else [])]
    rows = records(data)
    if rows is not None:
        flat = [flatten(r) for r in rows]
        keys = list(dict.fromkeys(k for r in flat for k in r))
        lines.append("| " + " | ".join(map(md_text, keys)) + " |")
        lines.append("|" + "---|" * len(keys))
        lines += ["| " + " | ".join(cell(r.get(k, "")) for k in keys) + " |" for r in flat]
        if isinstance(data, dict):  # the scalars beside the records (device, torch version, ...)
            meta = {k: v for k, v in flatten({k: v for k, v in data.items() if not isinstance(v, list)}).items()}
            if meta:
                lines += ["", ", ".join(f"{md_text(k)}: {cell(v)}" for k, v in meta.items())]
    else:
        lines += ["| metric | value |", "|---|---:|"]
        lines += [
            f"| {md_text(k)} | {cell(v)} |"
            for k, v in flatten(data if isinstance(data, dict) else {"value": data}).items()
        ]
    return "\n".join(lines) + "\n\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--title", default=None)
    ap.add_argument("--out", type=Path, default=os.environ.get("GITHUB_STEP_SUMMARY") or None)
    args = ap.parse_args(argv)
    title = args.title or args.json.stem
    if not args.json.is_file():
        text = f"### {md_text(title)}\n\n_no results: {md_text(args.json)} was not written_\n\n"
    else:
        try:
            text = render(json.loads(args.json.read_bytes().decode("utf-8")), title, args.json)
        except (ValueError, RecursionError, OSError) as e:  # not JSON, not UTF-8 (ValueErrors), nested too deep
            why = "nested too deep" if isinstance(e, RecursionError) else " ".join(str(e).split())
            print(f"error: {args.json}: not JSON this script can read ({why})", file=sys.stderr)
            return 1
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
