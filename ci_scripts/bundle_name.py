"""The bundle artifact's name and directory, one rule for every job and for `python -m runner fetch`:

    voxtral-bundle-<model>-<device>-<dtype>[-<quant>]   in   artifacts/<name>/

<model> is the preset (with "-random" for random weights), or a hub checkpoint id with "/" as "--" (artifact
names may not contain "/"), or a local checkpoint directory's name; <quant> is the export's --quant when it is
not "none" (an int4 bundle is another artifact than its bf16 twin).

    python ci_scripts/bundle_name.py (--preset P [--random-init] | --checkpoint ID) --device D --dtype T
        [--quant Q] [--github-output FILE]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import PurePosixPath

PREFIX = "voxtral-bundle"


def slug(model: str) -> str:
    model = PurePosixPath(model.rstrip("/")).name if model.startswith("/") else model  # a path: its last part
    return re.sub(r"[^A-Za-z0-9._-]+", "-", model.replace("/", "--")).strip("-.") or "model"


def bundle_name(model: str, device: str, dtype: str, quant: str = "none") -> str:
    name = f"{PREFIX}-{slug(model)}-{slug(device)}-{slug(dtype)}"
    return name if quant in ("", "none") else f"{name}-{slug(quant)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="")
    ap.add_argument("--random-init", default="false", nargs="?", const="true", help="true/false (a workflow env)")
    ap.add_argument("--checkpoint", default="", help="hub id or runner path; wins over --preset when set")
    ap.add_argument("--device", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--quant", default="none", help="the export's --quant (none: not in the name)")
    ap.add_argument("--github-output", help="append name= and dir= here ($GITHUB_OUTPUT)")
    args = ap.parse_args(argv)
    model = args.checkpoint or args.preset
    if not args.checkpoint and args.random_init.lower() == "true":
        model += "-random"
    if not model:
        print("error: give --preset or --checkpoint", file=sys.stderr)
        return 1
    name = bundle_name(model, args.device, args.dtype, args.quant)
    lines = f"name={name}\ndir=artifacts/{name}\n"
    print(lines, end="")
    if args.github_output:
        with open(args.github_output, "a") as f:
            f.write(lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
