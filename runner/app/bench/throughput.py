"""bench's throughput figure: N files through `generate_many` at each batch size (batch 1, serial, beside the
batched ones), one timed pass each after an untimed warm-up, on the program bench already loaded.

Per batch size B: generated tokens over the pass's wall time (prefill and encoder included: what a folder run
gets), audio seconds per wall second (RTFx), p50/p99 of each file's latency, and the wall time. A file's latency
runs from when generate_many takes its job (a slot is free) to when its result comes back: its own time in the
batch, not its wait in the queue. Audio is decoded before the pass, once per distinct file.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.app.bench.report import (
    BenchRun,
    percentile,
    throughput_batches,
    throughput_error_key,
    throughput_errors,
    throughput_key,
)
from runner.app.folder import read_list
from runner.audio import SAMPLE_RATE
from runner.errors import RunnerError
from runner.families import Family
from runner.runtime.batch import Job, generate_many
from runner.runtime.generate import GenerationOptions, MultimodalRunner
from runner.runtime.prompt import AudioSegment, Prompt


@dataclass(frozen=True)
class ThroughputPlan:
    names: tuple[str, ...]  # the distinct files, for the report
    prompts: tuple[list[Prompt], ...]  # each of the N files' prompt windows (a repeated file: the same list)
    audio_seconds: tuple[float, ...]  # each of the N files'
    batches: tuple[int, ...]

    def describe(self) -> str:
        names = ", ".join(self.names[:3]) + (f" and {len(self.names) - 3} more" if len(self.names) > 3 else "")
        return f"{names}; {sum(self.audio_seconds):.1f} s of audio in all"


def parse_batches(text: str) -> tuple[int, ...]:
    try:
        batches = tuple(dict.fromkeys(int(b) for b in text.split(",") if b.strip()))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise RunnerError(f"--batch {text}: give batch sizes >= 1, e.g. 1 or 1,8,32")
    return batches


def plan_throughput(args: argparse.Namespace, family: Family, max_audio_chunks: int) -> ThroughputPlan | None:
    """None without --throughput-files / --throughput-list. The files: the list's (cycled to N), else --audio
    repeated N times."""
    batches = parse_batches(args.batch)
    n, listed = args.throughput_files, args.throughput_list
    if n is None and listed is None:
        if args.batch != "1":
            raise RunnerError(f"--batch {args.batch}: give --throughput-files N (or --throughput-list FILE) to time")
        return None
    if n is not None and n < 1:
        raise RunnerError(f"--throughput-files {n}: must be >= 1")
    paths = read_list(listed) if listed is not None else [Path(args.audio)]
    n = n if n is not None else len(paths)
    windows = {p: family.prompts(p, None, args.language, max_audio_chunks) for p in dict.fromkeys(paths)}
    chosen = [paths[i % len(paths)] for i in range(n)]
    return ThroughputPlan(
        names=tuple(p.name for p in dict.fromkeys(chosen)),
        prompts=tuple(windows[p] for p in chosen),
        audio_seconds=tuple(_audio_seconds(windows[p]) for p in chosen),
        batches=batches,
    )


def _audio_seconds(windows: list[Prompt]) -> float:
    return sum(s.num_samples for w in windows for s in w if isinstance(s, AudioSegment)) / SAMPLE_RATE


def bench_throughput(
    runner: MultimodalRunner, plan: ThroughputPlan, opts: GenerationOptions, clock, warmup: int
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Each batch size's figures (one value each) and info (tokens, files, audio seconds; or the error that left
    that batch size out: the others are still measured)."""
    samples: dict[str, list[float]] = {}
    info: dict[str, str] = {}
    for b in plan.batches:
        try:
            if warmup:  # graph capture and first-call costs, for this batch size's shapes
                _pass(runner, plan.prompts[: max(b, 1)], opts, b, clock)
            wall_s, tokens, latencies = _pass(runner, plan.prompts, opts, b, clock)
        except RunnerError as e:
            info[throughput_error_key(b)] = " ".join(str(e).split())[:300]
            continue
        audio = sum(plan.audio_seconds)
        step_ms = percentile(_step_times(runner.engine, b, clock, runs=max(warmup, 1) * 10, warmup=warmup), 50)
        figures = {
            "throughput_decode_tokens_per_s": tokens / wall_s,
            "throughput_rtfx": audio / wall_s,
            "throughput_file_p50_ms": percentile(latencies, 50),
            "throughput_file_p99_ms": percentile(latencies, 99),
            "throughput_wall_ms": wall_s * 1e3,
            "throughput_step_ms": step_ms,
        }
        samples.update({throughput_key(k, b): [v] for k, v in figures.items()})
        info.update(
            {
                f"throughput_b{b}_files": str(len(plan.prompts)),
                f"throughput_b{b}_tokens": str(tokens),
                f"throughput_b{b}_audio_seconds": f"{audio:.3f}",
            }
        )
    return samples, info


def _step_times(engine, batch: int, clock, runs: int, warmup: int) -> list[float]:
    """One decode step at `batch`, timed alone (ms), as generate_many runs it: batch 1 through decode_token (the
    decode graph), B > 1 through decode_batch (the graph of its bucket). Positions past a 30 s prompt; the cost
    does not depend on them (the attention reads the whole cache under a mask). Leaves the cache empty."""
    e, at = engine, min(450, engine.max_seq_len - 1)
    if batch == 1:
        token = torch.zeros(1, 1, dtype=torch.int64, device=e.device)
        step = lambda: e.decode_token(token, at)  # noqa: E731
    else:
        tokens = torch.zeros(batch, 1, dtype=torch.int64, device=e.device)
        pos = torch.full((batch,), at, dtype=torch.int64, device=e.device)
        step = lambda: e.decode_batch(tokens, pos)  # noqa: E731
    try:
        return clock.repeat(step, runs, warmup)
    finally:
        e.reset()


def _pass(
    runner: MultimodalRunner, prompts: tuple[list[Prompt], ...], opts: GenerationOptions, batch: int, clock
) -> tuple[float, int, list[float]]:
    """One pass over `prompts` at `batch`: wall seconds, generated tokens, each file's latency (ms)."""
    taken: dict[int, float] = {}

    def jobs():
        for i, windows in enumerate(prompts):
            taken[i] = time.perf_counter()  # generate_many takes a job when a slot is free
            yield Job(i, windows)

    clock.sync()
    t0 = time.perf_counter()
    tokens, latencies = 0, []
    for done in generate_many(runner, jobs(), opts, batch):
        if done.error is not None:  # the bench's own files: one that fails is a broken measurement
            raise RunnerError(f"file {done.job.key + 1} of {len(prompts)}: {done.error}")
        latencies.append((time.perf_counter() - taken[done.job.key]) * 1e3)
        tokens += len(done.result.tokens)
    clock.sync()
    return time.perf_counter() - t0, tokens, latencies


def throughput_table(run: BenchRun) -> list[str]:
    """One row per batch size (the serial pass, batch 1, beside the batched ones), and the speed-up over it."""
    ours, ctx = run.ours, run.context
    lines = [
        f"#### Throughput: {ctx.get('throughput_files', '?')} files ({ctx.get('throughput_audio', '?')}), one timed "
        "pass per batch size, wall time after load",
        "",
        "| batch | wall (s) | generated tokens/s | RTFx (audio s / s) | per-file p50 (ms) | per-file p99 (ms) | "
        "decode step (ms) | decode tokens/s (batch / step) | tokens/s vs batch 1 | step vs batch 1 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    errors = []

    def value(key: str, batch: int) -> float | None:
        s = ours.summary(throughput_key(key, batch))
        return s.median if s else None

    serial, serial_step = value("throughput_decode_tokens_per_s", 1), value("throughput_step_ms", 1)
    left_out = throughput_errors(ours)
    for b in throughput_batches(ours):
        if (err := left_out.get(b)) is not None:
            errors.append(f"batch {b}: not measured: {err}")
            continue
        rate, wall, step = (
            value(k, b) for k in ("throughput_decode_tokens_per_s", "throughput_wall_ms", "throughput_step_ms")
        )
        cells = [
            f"{wall / 1e3:.2f}" if wall is not None else "–",
            f"{rate:.1f}" if rate is not None else "–",
            *(
                f"{v:.1f}" if (v := value(k, b)) is not None else "–"
                for k in ("throughput_rtfx", "throughput_file_p50_ms", "throughput_file_p99_ms")
            ),
            f"{step:.3f}" if step is not None else "–",
            f"{b * 1e3 / step:.1f}" if step else "–",  # every row decoding: the steady state between prefills
            f"{rate / serial:.2f}x" if rate is not None and serial else "–",
            f"{step / serial_step:.2f}x" if step is not None and serial_step else "–",
        ]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return lines + [f"\n{e}" for e in errors]
