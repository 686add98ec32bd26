"""What is alive on the GPU at the peak of a generate() (issue 20: the 10-minute prompt's peak is 1.1 GB over the
weights and the cache, where an eager estimate of the prefill's activations says 0.65; NOTES.md 52, 56).

The bundle is loaded as `run` loads it (the warm-up at load), then generate() runs three times under torch's
allocator history: the first (a user's one-file run: the prefill called directly, its graph not yet captured),
the second (the capture) and the third (a replay). Replaying each one's allocations and frees finds the moment
the most was allocated, and the blocks alive then are listed by size with the innermost Python frame that asked
for them (an AOTInductor method's buffers name the runtime's call into it). GPU only.

    python benchmarks/memory_peak.py --bundle artifacts/3b-long --audio long.wav --out memory.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from runner.app.options import Environment, add_runtime_flags, runtime_options
from runner.audio import load_audio
from runner.families.voxtral import Tekken, transcription_prompt
from runner.runtime.engine import ProgramEngine
from runner.runtime.generate import GenerationOptions, MultimodalRunner
from runner.runtime.program import Program

MIB = 2**20


def where(frames: list[dict]) -> str:
    """The innermost frame in our code (runner/, benchmarks/), else the innermost Python one."""
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    ours = [f for f in py if "/runner/" in f["filename"] or "/benchmarks/" in f["filename"]]
    f = (ours or py or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{Path(f['filename']).name}:{f['line']} {f['name']}"


def peak_blocks(events: list[dict]) -> tuple[int, list[tuple[int, str]]]:
    """Replay alloc / free events: (the most allocated at once by them, the blocks alive at that moment)."""
    live: dict[int, tuple[int, str]] = {}
    cur = best = 0
    at_best: list[tuple[int, str]] = []
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], where(e.get("frames", [])))
            cur += e["size"]
            if cur > best:
                best, at_best = cur, list(live.values())
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])[0]
    return best, sorted(at_best, reverse=True)


def traced(fn, top: int) -> dict:
    """fn() under the allocator's history: its peak over what was allocated before, and what was alive then."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    traced_peak, blocks = peak_blocks([e for trace in snap["device_traces"] for e in trace])
    by_site: dict[str, list[int]] = {}
    for size, site in blocks:
        by_site.setdefault(site, []).append(size)
    return {
        "before_mib": round(base / MIB, 1),
        "peak_mib": round(peak / MIB, 1),
        "over_before_mib": round((peak - base) / MIB, 1),
        "traced_peak_mib": round(traced_peak / MIB, 1),
        "blocks_at_peak": [{"mib": round(s / MIB, 2), "site": site} for s, site in blocks[:top]],
        "by_site": sorted(
            ({"site": k, "blocks": len(v), "mib": round(sum(v) / MIB, 1)} for k, v in by_site.items()),
            key=lambda d: -d["mib"],
        ),
    }


def report(name: str, r: dict) -> None:
    print(f"## {name}: allocated before {r['before_mib']} MiB, peak {r['peak_mib']} MiB (+{r['over_before_mib']}); "
          f"the traced allocations' own peak {r['traced_peak_mib']} MiB")  # fmt: skip
    for d in r["by_site"][:12]:
        print(f"  {d['mib']:9.1f} MiB in {d['blocks']:4d} blocks  {d['site']}")
    print("  the largest blocks: " + ", ".join(f"{b['mib']:.1f} ({b['site']})" for b in r["blocks_at_peak"][:10]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--audio", required=True)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path)
    add_runtime_flags(ap)  # run's own switches (--encoder-chunks, --prefill-chunk, …), parsed as run parses them
    args = ap.parse_args()

    program = Program.load(args.bundle, device="cuda")
    options = runtime_options(args, Environment.read())
    engine = ProgramEngine(program, options)
    if options.warm_up:  # as `run` loads a bundle
        engine.warm_up()
    tok = Tekken.from_file(Path(args.bundle) / program.manifest.model["tokenizer"])
    runner = MultimodalRunner(engine, tok, tok.special_id("[AUDIO]"))
    segments = transcription_prompt(tok, load_audio(args.audio), "en")
    opts = GenerationOptions(max_new_tokens=args.new_tokens)
    result = {}
    for name in ("first", "capture", "replay"):  # the prefill graph is captured at a shape's second sight
        result[name] = traced(lambda: runner.generate(segments, opts), args.top)
        report(f"generate(), the {name}", result[name])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
