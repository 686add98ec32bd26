"""The bundle artifact's name and directory for a CI job, by the package's one rule (runner/bundle_name.py):

    voxtral-bundle-<model>-<device>-<dtype>[-<quant>]-torch<major>.<minor>   in   artifacts/<name>/

The torch release comes from --torch-spec (the workflow's TORCH_SPEC: `torch==2.13.0+cpu` -> torch2.13); a spec
that pins no version (`preinstalled`, `torch>=2.13`) is answered by the torch this Python imports. The step runs
before anything is installed, so only the stdlib and that one stdlib-only module of the package are imported.

    python ci_scripts/bundle_name.py (--preset P [--random-init] | --checkpoint ID) --device D --dtype T
        [--quant Q] [--torch-spec SPEC] [--github-output FILE]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runner/ without installing it (stdlib only here)

from runner.bundle_name import ARTIFACTS, bundle_name  # noqa: E402
from runner.errors import RunnerError  # noqa: E402

# `torch==2.13.0+cpu`, `torch===2.13.0`, `torch==2.13.*`; a torch wheel's path or URL
_PINNED = re.compile(r"torch\s*(?:\[[^\]]*\])?\s*===?\s*v?(\d+\.\d+)\S*")
_WHEEL = re.compile(r"(?:^|[/@\s])torch-(\d+\.\d+)[^/\s]*\.whl")


def pinned_torch(spec: str) -> str | None:
    """The major.minor a TORCH_SPEC installs; None where it pins none (`preinstalled`, `torch`, `torch>=2.13`)."""
    spec = spec.strip()
    found = _PINNED.fullmatch(spec) or _WHEEL.search(spec)
    return found[1] if found else None


def running_torch(spec: str) -> str:
    """The version of the torch this Python imports, for a spec that pins none."""
    try:
        import torch
    except (ImportError, OSError) as e:
        raise RunnerError(
            f"--torch-spec {spec!r} pins no torch version and this Python cannot import torch "
            f"({' '.join(str(e).split())}): pass a spec such as torch==2.13.0"
        ) from None
    return str(torch.__version__)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="")
    ap.add_argument("--random-init", default="false", nargs="?", const="true", help="true/false (a workflow env)")
    ap.add_argument("--checkpoint", default="", help="hub id or runner path; wins over --preset when set")
    ap.add_argument("--device", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--quant", default="none", help="the export's --quant (none: not in the name)")
    ap.add_argument(
        "--torch-spec", default="", help="the torch the job installs ($TORCH_SPEC); none pinned: this Python's torch"
    )
    ap.add_argument("--github-output", help="append name= and dir= here ($GITHUB_OUTPUT)")
    args = ap.parse_args(argv)
    model = args.checkpoint or args.preset
    if not model:
        print("error: give --preset or --checkpoint", file=sys.stderr)
        return 1
    random_init = not args.checkpoint and args.random_init.lower() == "true"
    try:
        torch_version = pinned_torch(args.torch_spec) or running_torch(args.torch_spec)
        name = bundle_name(model, args.device, args.dtype, torch_version, quant=args.quant, random_init=random_init)
    except RunnerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    lines = f"name={name}\ndir={ARTIFACTS}/{name}\n"
    print(lines, end="")
    if args.github_output:
        with open(args.github_output, "a") as f:
            f.write(lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
