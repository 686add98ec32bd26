"""Download a Hugging Face hub checkpoint in the layout `python -m runner export --checkpoint DIR` reads
(config.json + safetensors shards + tekken.json), skipping the duplicate consolidated weights.

    HF_TOKEN=... python ci_scripts/hub_checkpoint.py ORG/NAME DIR [--revision REV]

Used by cuda.yml's export job only when a hub checkpoint is asked for; the token comes from HF_TOKEN.
"""

from __future__ import annotations

import argparse
import re
import sys

ALLOW = [
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tekken.json",
]
# fullmatch, ASCII only: `$` would let a trailing newline through
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*", re.ASCII)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repo_id")
    ap.add_argument("dest")
    ap.add_argument("--revision", default=None)
    args = ap.parse_args(argv)
    if not REPO_ID.fullmatch(args.repo_id):
        print(f"error: {args.repo_id!r} is not a hub id (ORG/NAME)", file=sys.stderr)
        return 1
    from huggingface_hub import snapshot_download

    path = snapshot_download(args.repo_id, revision=args.revision, local_dir=args.dest, allow_patterns=ALLOW)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
