"""Aggregate decode throughput of continuous batching: N files at batch B against the same files at batch 1.

    python -m runner export --preset tiny --max-audio-chunks 2 --max-seq-len 1024 --max-batch 4 --out /tmp/tiny-b4
    python benchmarks/batch_throughput.py /tmp/tiny-b4 --files 8 --batch 4 --tokens 128

Every file decodes exactly --tokens tokens (EOS ignored until then), so both runs do the same work. Decode tok/s is
the decode steps (tokens after each file's first) over the run's wall time less its prefills (prefill runs at batch
1 in both); end-to-end tok/s counts every token over the whole wall time. Greedy tokens must match between the two
runs (they are compared)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from runner.families import family_for
from runner.fixtures import fixtures_dir
from runner.runtime.batch import Job, generate_many
from runner.runtime.engine import ProgramEngine
from runner.runtime.generate import GenerationOptions, MultimodalRunner
from runner.runtime.program import Program

FILES = ("speech.wav", "short.wav", "silence.wav", "long_35s.flac", "speech_48k_stereo.wav")


def run(runner, jobs, opts, batch) -> tuple[dict, dict]:
    t0 = time.perf_counter()
    results = {r.job.key: r.result for r in generate_many(runner, jobs, opts, batch)}
    wall = time.perf_counter() - t0
    tokens = sum(r.stats.generated_tokens for r in results.values())
    steps = sum(r.stats.generated_tokens - r.stats.windows for r in results.values())
    prefill = sum(r.stats.prompt_eval_ms for r in results.values()) / 1e3
    figures = {
        "batch": batch,
        "wall_s": round(wall, 3),
        "prefill_s": round(prefill, 3),
        "decode_tok_s": round(steps / (wall - prefill), 1),
        "end_to_end_tok_s": round(tokens / wall, 1),
    }
    return figures, {k: r.tokens for k, r in results.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=2, help="runs of each; the best is kept (the first warms up)")
    args = p.parse_args()
    with Program.load(args.bundle) as program:
        family = family_for(program.bundle_dir, program.manifest.model)
        runner = MultimodalRunner(ProgramEngine(program), family.tokenizer, family.audio_id)
        audio = [fixtures_dir() / "audio" / FILES[i % len(FILES)] for i in range(args.files)]
        jobs = [Job(i, family.prompts(a, None, "en", runner.engine.max_audio_chunks)) for i, a in enumerate(audio)]
        opts = GenerationOptions(max_new_tokens=args.tokens, min_new_tokens=args.tokens)
        best = {}
        for _ in range(args.repeat):
            for b in (1, args.batch):
                figures, tokens = run(runner, jobs, opts, b)
                if b not in best or figures["decode_tok_s"] > best[b][0]["decode_tok_s"]:
                    best[b] = (figures, tokens)
        assert best[1][1] == best[args.batch][1], "greedy tokens differ between batch 1 and the batch"
        for b in (1, args.batch):
            print(best[b][0])
        ratio = best[args.batch][0]["decode_tok_s"] / best[1][0]["decode_tok_s"]
        print(f"decode tok/s at batch {args.batch} / batch 1: {ratio:.2f}x")


if __name__ == "__main__":
    main()
