"""`python -m runner stream --bench --bundle DIR`: what a streaming bundle sustains, on synthetic audio.

    step        one stream fed as fast as it runs: each 80 ms position's whole step (preprocessor + encoder_step +
                decoder_step + the greedy pick, host work included) p50/p99; and each half alone (device time of
                its CUDA graph's replays on CUDA): the decoder half's rate is the decode tokens/s at batch 1
    batches     B streams stepped together, for each batch size: step time p50/p99; B is held in real time while
                the p99 step is under the 80 ms of audio it covers
    latency     streams fed in real time, 80 ms blocks: how long after a block arrives its token is decided (beyond
                the model's own delay: the audio a token waits for by design), alone and at the largest batch held
    memory      one long stream (`--long-minutes`, as fast as it runs, cut at `--long-limit-s`): GPU memory
                (allocated, reserved, the device's used) and the process RSS after its first minute and at its end

Streams never stop at </s> here (random weights emit it at random). The table goes to stdout, the JSON record to
`--bench-json`. The step loop is `stream`'s own (StreamBatch): nothing is timed that a real stream would skip.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from runner.audio import SAMPLE_RATE
from runner.errors import RunnerError
from runner.families.voxtral_realtime import GraphSteps, Stream, StreamBatch, program_steps
from runner.runtime.graphs import batch_sizes

WARMUP_STEPS = 5
TARGETS = {  # what a 4B bf16 bundle should sustain on an H200
    "step_ms_p99": 3.0,
    "decode_tokens_per_s": 400.0,
    "max_streams_held": 64,
    "token_latency_ms_p99": 15.0,
    "memory_growth_mib": 0.0,
}


def synthetic(seconds: float, seed: int) -> np.ndarray:
    """Tones under noise: speech-like levels, no silence (the features are never degenerate)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    x = sum(0.05 * np.sin(2 * np.pi * f * t + rng.uniform(0, 6)) for f in rng.uniform(120, 3500, 5))
    return (x + 0.01 * rng.standard_normal(t.shape)).astype(np.float32)


def _settled(xs: list[float]) -> list[float]:
    """Without the warm-up steps (kept when a short run would have nothing left)."""
    return xs[WARMUP_STEPS:] if len(xs) > 2 * WARMUP_STEPS else xs


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def memory(device: str) -> dict[str, float]:
    out = {"rss_mib": round(_rss_mib(), 1)}
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        out |= {
            "allocated_mib": round(torch.cuda.memory_allocated() / 2**20, 1),
            "reserved_mib": round(torch.cuda.memory_reserved() / 2**20, 1),
            "device_used_mib": round((total - free) / 2**20, 1),
        }
    return out


def _streams(spec, n: int, seconds: float, seed: int = 0) -> tuple[list[Stream], list[np.ndarray]]:
    return [Stream(spec, stop_at_eos=False) for _ in range(n)], [synthetic(seconds, seed + i) for i in range(n)]


def step_times(steps, spec, seconds: float) -> list[float]:
    """One stream fed its audio at once: each step's wall time (ms), warm-up steps dropped."""
    steps.reset()
    batch = StreamBatch(steps, spec)
    (s,), (audio,) = _streams(spec, 1, seconds)
    batch.add(s)
    s.feed(audio)
    batch.run()
    return _settled(s.times.compute_ms)


def halves(steps, spec, b: int, n: int) -> dict[str, float]:
    """Each half of a step of `b` rows alone, median ms: device time of the graph replays on CUDA, else the
    methods' wall time."""
    dev = steps.device
    enc, dec = [], []
    if isinstance(steps, GraphSteps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for half, out in ((steps.encode_only, enc), (steps.decode_only, dec)):
            for i in range(n + WARMUP_STEPS):
                start.record()
                half(b)
                end.record()
                end.synchronize()
                if i >= WARMUP_STEPS:
                    out.append(start.elapsed_time(end))
    else:
        wave = torch.from_numpy(synthetic(1.0, 7)[: b * spec.window].reshape(b, spec.window)).to(dev)
        pos = torch.zeros(b, dtype=torch.int64, device=dev)
        token = torch.full((b, 1), spec.bos_id, dtype=torch.int64, device=dev)
        delay = torch.full((b,), float(spec.num_delay_tokens), device=dev)
        for i in range(n + WARMUP_STEPS):
            t0 = time.perf_counter()
            audio = steps.encode(steps.preprocess(wave), pos + i)
            _sync(dev)
            t1 = time.perf_counter()
            steps.decode(token, audio, pos + i, delay).argmax(dim=-1)
            _sync(dev)
            if i >= WARMUP_STEPS:
                enc.append((t1 - t0) * 1e3)
                dec.append((time.perf_counter() - t1) * 1e3)
    steps.reset()
    return {"encoder_ms": round(_pct(enc, 50), 4), "decoder_ms": round(_pct(dec, 50), 4)}


def batch_sweep(steps, spec, sizes: list[int], n: int) -> list[dict]:
    """B streams stepped together for n steps (after the warm-up), per size; held while p99 < 80 ms."""
    budget_ms = spec.samples_per_token / SAMPLE_RATE * 1e3
    rows = []
    for b in sizes:
        steps.reset()
        batch = StreamBatch(steps, spec)
        streams, audio = _streams(spec, b, (n + WARMUP_STEPS + len(spec.prompt) + 2) * budget_ms / 1e3)
        for s, a in zip(streams, audio):
            batch.add(s)
            s.feed(a)
        for _ in range(n + WARMUP_STEPS):
            if not batch.step():
                break
        t = _settled(streams[0].times.compute_ms)
        p50, p99 = _pct(t, 50), _pct(t, 99)
        rows.append(
            {
                "batch": b,
                "step_ms_p50": round(p50, 3),
                "step_ms_p99": round(p99, 3),
                "held": p99 < budget_ms,
                "audio_s_per_s": round(b * budget_ms / p50, 1),
            }
        )
        _say(f"batch {b}: step p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    steps.reset()
    return rows


def paced_latency(steps, spec, b: int, seconds: float) -> dict[str, float]:
    """b streams fed in real time (80 ms blocks, all at once): token decided - its block arrived, ms."""
    steps.reset()
    batch = StreamBatch(steps, spec)
    streams, audio = _streams(spec, b, seconds, seed=100)
    for s in streams:
        batch.add(s)
    block = spec.samples_per_token
    t0 = time.perf_counter()
    for k in range(int(seconds * SAMPLE_RATE) // block):
        time.sleep(max(0.0, t0 + k * block / SAMPLE_RATE - time.perf_counter()))
        for s, a in zip(streams, audio):
            s.feed(a[k * block : (k + 1) * block])
        batch.run()
    lag = [x for s in streams for x in _settled(s.times.lag_ms)]
    steps.reset()
    return {
        "batch": b,
        "token_latency_ms_p50": round(_pct(lag, 50), 3),
        "token_latency_ms_p99": round(_pct(lag, 99), 3),
        "tokens": len(lag),
    }


def long_stream(steps, spec, minutes: float, limit_s: float) -> dict:
    """One stream of `minutes` of audio fed in 80 ms blocks as fast as it runs: memory after its first minute and
    at its end (cut at limit_s of wall clock)."""
    steps.reset()
    batch = StreamBatch(steps, spec)
    s = Stream(spec, stop_at_eos=False)
    batch.add(s)
    block, minute = spec.samples_per_token, SAMPLE_RATE * 60
    piece = synthetic(60.0, 200)  # a minute, repeated: memory of the source stays flat whatever the length
    first, t0, fed = None, time.perf_counter(), 0
    while fed < minutes * minute and time.perf_counter() - t0 < limit_s:
        start = fed % len(piece)
        s.feed(piece[start : start + block])
        fed += block
        batch.run()
        if first is None and fed >= minute:
            _sync(steps.device)
            first = memory(steps.device)
    _sync(steps.device)
    end = memory(steps.device)
    steps.reset()
    first = first or end
    return {
        "minutes": round(fed / minute, 2),
        "steps": s.position,
        "wall_s": round(time.perf_counter() - t0, 1),
        "after_first_minute": first,
        "at_end": end,
        "growth_mib": {k: round(end[k] - first[k], 1) for k in end},
    }


def _say(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _sizes(text: str | None, streams: int) -> list[int]:
    if text is None:
        return batch_sizes(streams)
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise RunnerError(f"--bench-batches {text!r}: a comma list of whole numbers") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > streams:
        raise RunnerError(f"--bench-batches {text}: each between 1 and the bundle's max_streams ({streams})")
    return sizes


def bench(args: argparse.Namespace, program, family) -> dict:
    spec = family.spec  # the numbers in args are in range: the parser checks them (runner/app/stream.py)
    steps = program_steps(program, args.runtime, spec.window)
    sizes = _sizes(args.bench_batches, steps.streams)
    if isinstance(steps, GraphSteps):  # replay only what was captured: round each size up to a graph's
        sizes = sorted({steps.batch_for(b) for b in sizes})
    dev = steps.device
    _say(
        f"{program.bundle_dir}: {dev}, {program.manifest.dtype}, {steps.streams} stream slots, "
        f"{'CUDA graphs' if isinstance(steps, GraphSteps) else 'method calls'}"
    )
    loaded = memory(dev)
    t = step_times(steps, spec, args.bench_seconds)
    half = halves(steps, spec, 1, args.bench_steps)
    _say(f"batch 1: step p50 {_pct(t, 50):.3f} ms, p99 {_pct(t, 99):.3f} ms; halves {half}")
    sweep = batch_sweep(steps, spec, sizes, args.bench_steps)
    held = [r["batch"] for r in sweep if r["held"]]
    latency = [paced_latency(steps, spec, 1, args.latency_seconds)]
    if held and max(held) > 1:
        latency.append(paced_latency(steps, spec, max(held), args.latency_seconds))
    for r in latency:
        _say(f"latency at batch {r['batch']}: p50 {r['token_latency_ms_p50']} ms, p99 {r['token_latency_ms_p99']} ms")
    long = long_stream(steps, spec, args.long_minutes, args.long_limit_s)
    _say(f"long stream: {long['minutes']} min in {long['wall_s']} s; growth {long['growth_mib']}")
    measured = {
        "step_ms_p50": round(_pct(t, 50), 4),
        "step_ms_p99": round(_pct(t, 99), 4),
        "steps_timed": len(t),
        **half,
        "decode_tokens_per_s": round(1e3 / half["decoder_ms"], 1) if half["decoder_ms"] > 0 else float("nan"),
        "batches": sweep,
        "max_streams_held": max(held, default=0),
        "latency": latency,
        "memory_after_load": loaded,
        "long_stream": long,
        "memory_growth_mib": long["growth_mib"].get("allocated_mib", long["growth_mib"]["rss_mib"]),
    }
    return _result(args, program, steps, spec, measured)


def _result(args: argparse.Namespace, program, steps, spec, measured: dict) -> dict:
    """The benchmark's JSON: what was measured, on what, with which settings."""
    m, dev = program.manifest, steps.device
    return {
        "bundle": str(program.bundle_dir),
        "model": m.model.get("source", {}).get("name", ""),
        "device": dev,
        "gpu": torch.cuda.get_device_name() if dev == "cuda" else "",
        "cpu": f"{platform.machine()} x{os.cpu_count()}",
        "dtype": m.dtype,
        "torch_version": torch.__version__,
        "cuda_graphs": isinstance(steps, GraphSteps),
        "max_streams": steps.streams,
        "model_delay_ms": spec.num_delay_tokens * spec.samples_per_token * 1e3 / SAMPLE_RATE,
        **measured,
        "args": {
            "bench_seconds": args.bench_seconds,
            "bench_steps": args.bench_steps,
            "latency_seconds": args.latency_seconds,
            "long_minutes": args.long_minutes,
            "long_limit_s": args.long_limit_s,
        },
    }


def _headline_rows(r: dict) -> list[tuple[str, str, str]]:
    """(figure, measured, target) for each headline figure."""
    held_at = next((x for x in r["batches"] if x["batch"] == r["max_streams_held"]), None)
    lat = {x["batch"]: x for x in r["latency"]}
    one = lat.get(1, {})
    grow = r["long_stream"]["growth_mib"]
    gpu = "allocated_mib" in grow
    rows = [
        (
            "compute per 80 ms at batch 1 (whole step), p50 / p99 (ms)",
            f"{r['step_ms_p50']:.3f} / {r['step_ms_p99']:.3f}",
            f"≤ {TARGETS['step_ms_p99']:g}",
        ),
        ("encoder half / decoder half at batch 1 (ms)", f"{r['encoder_ms']:.3f} / {r['decoder_ms']:.3f}", ""),
        ("decode at batch 1 (tokens/s)", f"{r['decode_tokens_per_s']:.1f}", f"≥ {TARGETS['decode_tokens_per_s']:g}"),
        (
            "concurrent streams held in real time (step p99 < 80 ms)",
            f"{r['max_streams_held']} of {r['max_streams']} slots"
            + (f" (step p99 {held_at['step_ms_p99']:.2f} ms)" if held_at else ""),
            f"≥ {TARGETS['max_streams_held']}",
        ),
        (
            "token latency beyond the model delay, batch 1, p50 / p99 (ms)",
            f"{one.get('token_latency_ms_p50', float('nan')):.2f} / {one.get('token_latency_ms_p99', float('nan')):.2f}",
            f"≤ {TARGETS['token_latency_ms_p99']:g} p99",
        ),
        *[
            (
                f"token latency at batch {b}, p50 / p99 (ms)",
                f"{x['token_latency_ms_p50']:.2f} / {x['token_latency_ms_p99']:.2f}",
                "",
            )
            for b, x in lat.items()
            if b != 1
        ],
        (
            f"{'GPU memory (allocated)' if gpu else 'process RSS'} growth after the first minute, "
            f"{r['long_stream']['minutes']:g} min stream (MiB)",
            f"{grow['allocated_mib' if gpu else 'rss_mib']:+.1f}",
            f"{TARGETS['memory_growth_mib']:g}",
        ),
    ]
    if gpu:
        rows.append(
            (
                "  reserved / device used growth (MiB)",
                f"{grow['reserved_mib']:+.1f} / {grow['device_used_mib']:+.1f}",
                "",
            )
        )
    return rows


def table(r: dict) -> str:
    """The headline figures beside the targets, then the batch sweep."""
    rows = _headline_rows(r)
    out = [
        f"### Voxtral Realtime streaming: `{r['model']}`, {r['device']} {r['gpu'] or r['cpu']}, {r['dtype']}, "
        f"{'CUDA graphs' if r['cuda_graphs'] else 'method calls'}, model delay {r['model_delay_ms']:.0f} ms",
        "",
        "| figure | measured | target |",
        "|---|---:|---:|",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows),
        "",
        "| batch | step p50 (ms) | step p99 (ms) | held (p99 < 80 ms) | audio seconds per second |",
        "|---:|---:|---:|---|---:|",
        *(
            f"| {x['batch']} | {x['step_ms_p50']:.3f} | {x['step_ms_p99']:.3f} | {'yes' if x['held'] else 'no'} | "
            f"{x['audio_s_per_s']:.0f} |"
            for x in r["batches"]
        ),
    ]
    return "\n".join(out) + "\n"


def main(args: argparse.Namespace, program, family) -> int:
    result = bench(args, program, family)
    if args.bench_json:
        args.bench_json.parent.mkdir(parents=True, exist_ok=True)
        args.bench_json.write_text(json.dumps(result, indent=1) + "\n")
        _say(f"wrote {args.bench_json}")
    text = table(result)
    print(text, end="", flush=True)
    if args.env.step_summary:
        with open(args.env.step_summary, "a", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0
