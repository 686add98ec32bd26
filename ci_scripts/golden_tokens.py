"""Write a bundle's greedy tokens into a golden-token file (fixtures/golden/*.json), under the bundle's device and
dtype, from the records of `python -m runner run --json`:

    python -m runner run --bundle DIR --audio fixtures/audio/*.wav ... --max-new-tokens 32 --json > run.jsonl
    python ci_scripts/golden_tokens.py --bundle DIR --records run.jsonl --golden fixtures/golden/NAME.json

The file is made if it is not there (for this bundle's model: its weights digest). A file of another model is
refused, and so is replacing tokens already there for this device and dtype unless --replace is given: golden tokens
change only on purpose. `nox -s e2e` finds the file by the bundle's weights digest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def golden_entry(manifest: dict, records: list[dict]) -> tuple[str, str, dict[str, list[int]]]:
    """(weights digest, device-dtype key, {audio file name: tokens}) of a bundle's run."""
    digest = (manifest.get("model", {}).get("source") or {}).get("weights_digest")
    if not isinstance(digest, str):
        raise ValueError("the bundle's manifest records no weights digest (model.source.weights_digest)")
    tokens = {}
    for r in records:
        if "tokens" not in r:
            raise ValueError(f"{r.get('audio', 'a record')}: no tokens (did the file fail?)")
        tokens[Path(r["audio"]).name] = [int(t) for t in r["tokens"]]
    if not tokens:
        raise ValueError("no records")
    return digest, f"{manifest['device']}-{manifest['dtype']}", tokens


def merge(golden: dict | None, digest: str, kind: str, tokens: dict, about: str, max_new: int, replace: bool) -> dict:
    if golden is None:
        golden = {"about": about, "weights_digest": digest, "max_new_tokens": max_new, "tokens": {}}
    if golden.get("weights_digest") != digest:
        raise ValueError(f"golden tokens of another model (weights digest {str(golden.get('weights_digest'))[:12]})")
    if kind in golden["tokens"] and not replace:
        raise ValueError(f"it already holds tokens for {kind} (--replace to overwrite them)")
    golden["tokens"][kind] = tokens
    return golden


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--records", type=Path, required=True, help="`run --json` output (JSON lines)")
    p.add_argument("--golden", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, default=32, help="what the run was given (recorded)")
    p.add_argument("--about", default="Greedy tokens per device-dtype on the fixture audio, transcription prompt.")
    p.add_argument("--replace", action="store_true")
    args = p.parse_args(argv)
    try:
        manifest = json.loads((args.bundle / "model.pte").read_text())
        records = [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()]
        old = json.loads(args.golden.read_text()) if args.golden.exists() else None
        digest, kind, tokens = golden_entry(manifest, records)
        new = merge(old, digest, kind, tokens, args.about, args.max_new_tokens, args.replace)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {args.golden}: {e}", file=sys.stderr)
        return 1
    args.golden.write_text(json.dumps(new, indent=1) + "\n")
    print(f"{args.golden}: {kind}, {len(tokens)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
