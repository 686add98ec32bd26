"""How `bench` measures: the clock, peak memory, the plan of shapes, each method's time, end-to-end generation,
and our bundle's figures. The peers (runner/app/bench/peers.py) are measured with the same pieces.

Every backend is measured the same way and one after another (loaded, timed, freed), so each one's peak memory
is its own: warm-up runs first, then `--runs` timed ones; on CUDA the clock is read after a device
synchronise, since the methods run asynchronously on their own streams.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.app.bench.report import OURS, BackendResult
from runner.app.bench.throughput import ThroughputPlan, bench_throughput
from runner.audio import N_SAMPLES
from runner.errors import RunnerError
from runner.families.voxtral import Tekken
from runner.runtime.engine import Engine, ProgramEngine, to_encoder_dtype
from runner.runtime.generate import GenerationOptions, MultimodalRunner
from runner.runtime.graphs import PrefillGraphs
from runner.runtime.options import RuntimeOptions
from runner.runtime.program import Program
from runner.runtime.prompt import Segment
from runner.stats import Stats

# ---------------------------------------------------------------- clocks and memory


class Clock:
    """Wall clock around a call; on CUDA synchronised on both sides (our methods run on their own streams,
    and torch.cuda.synchronize waits for all of them)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn: Callable[[], object]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3

    def repeat(
        self, fn: Callable[[], object], runs: int, warmup: int, before: Callable[[], object] | None = None
    ) -> list[float]:
        out = []
        for i in range(warmup + runs):
            if before is not None:
                before()  # untimed: resets, cache rewinds
            t = self.time_ms(fn)
            if i >= warmup:
                out.append(t)
        return out


def reset_peak_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return
    reset_host_peak()


def reset_host_peak() -> None:
    try:  # Linux: "5" resets the process's peak RSS (VmHWM) to its current RSS
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # elsewhere the peak is the process's since start (ru_maxrss)


# the phases whose own peak GPU memory with_peak records (bench_methods' methods and generate())
PHASE_PEAKS = tuple(
    f"peak_memory_{p}_mb" for p in ("audio_encoder", "text_decoder_prefill", "text_decoder_decode", "e2e")
)


def peak_memory_mb(device: str, samples: dict | None = None) -> float:
    """The peak since the last reset; with `samples`, also over the phase peaks recorded there (each phase resets
    the CUDA counter, so the run's peak is the largest of them and what came after)."""
    now = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else host_peak_mb()
    return max([now, *(samples[k][0] for k in PHASE_PEAKS if k in (samples or {}))])


def with_peak(clock: Clock, samples: dict, phase: str, fn):
    """fn(); on CUDA its own peak GPU memory goes to samples[peak_memory_<phase>_mb] (weights and caches
    included): where a long input's memory goes."""
    if clock.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    result = fn()
    if clock.cuda:
        torch.cuda.synchronize()
        samples[f"peak_memory_{phase}_mb"] = [torch.cuda.max_memory_allocated() / 2**20]
    return result


def host_peak_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------- what is measured


@dataclass(frozen=True)
class Plan:
    device: str
    runs: int
    warmup: int
    load_runs: int
    chunks: int
    prefill_tokens: int  # chunks x 375 audio tokens + the transcription prompt's text tokens
    segments: list[Segment]  # the e2e prompt (the audio file, transcription)
    opts: GenerationOptions
    audio_seconds: float
    throughput: ThroughputPlan | None = None  # --throughput-files: N files at each --batch


def method_inputs(plan: Plan, vocab_size: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A waveform of `chunks` x 30 s and prompt ids of the prefill length (seeded: every backend sees the same)."""
    g = torch.Generator().manual_seed(0)
    wave = (torch.randn(plan.chunks * N_SAMPLES, generator=g) * 0.1).to(device)
    ids = torch.randint(0, vocab_size, (1, plan.prefill_tokens), generator=g).to(device)
    return wave, ids


def bench_methods(
    engine: Engine, plan: Plan, clock: Clock, wave: torch.Tensor, ids: torch.Tensor, mel: torch.Tensor | None = None
) -> dict[str, list[float]]:
    """Each method on the plan's shapes; given `mel`, the engine's features come from it and its preprocessor
    is not timed (transformers' feature extractor is numpy). A decode step runs at position P after a prefill of
    P; an engine with a growing cache (transformers') is rewound to P before each step, untimed."""
    r, w, n = plan.runs, plan.warmup, plan.prefill_tokens
    out = {}
    if mel is None:
        out["preprocessor_ms"] = clock.repeat(lambda: engine.preprocess(wave), r, w)
        mel = engine.preprocess(wave)
    mel = to_encoder_dtype(mel, engine.encoder_dtype)
    out["audio_encoder_ms"] = with_peak(
        clock, out, "audio_encoder", lambda: clock.repeat(lambda: engine.encode(mel), r, w)
    )
    if clock.cuda and isinstance(engine, ProgramEngine) and engine.use_cuda_graph:
        out.update(_encoder_graph_replay(engine, mel, clock, r, w))
    out["token_embedding_ms"] = clock.repeat(lambda: engine.embed(ids), r, w)
    embeds, token = engine.embed(ids), ids[:, :1]
    pos = torch.arange(n, device=ids.device)
    out["text_decoder_prefill_ms"] = with_peak(
        clock,
        out,
        "text_decoder_prefill",
        lambda: clock.repeat(lambda: engine.decode(embeds, pos), r, w, before=engine.reset),
    )
    engine.reset()
    engine.decode(embeds, pos)
    # the step as generate() takes it (text_decoder prefills into an empty cache; a step attends to the cache)
    out["text_decoder_decode_ms"] = with_peak(
        clock,
        out,
        "text_decoder_decode",
        lambda: clock.repeat(lambda: engine.decode_token(token, n), r, w, before=lambda: engine.rewind(n)),
    )
    engine.reset()
    return out


def _encoder_graph_replay(engine: ProgramEngine, mel: torch.Tensor, clock: Clock, runs: int, warmup: int) -> dict:
    """audio_encoder as generate() runs it on CUDA, inside a captured graph (`PrefillGraphs`: run, captured on the
    second call, replayed from the third). The direct call above pays the host's launch of each of its
    kernels; a replay is the kernels' own time. A capture that fails leaves the figure out, not the run."""
    graphs = PrefillGraphs(engine.device, capacity=1)
    capturable = engine.capturable()
    try:
        times = clock.repeat(lambda: graphs.run(engine.encode, [mel], capturable.encode), runs, max(warmup, 2))
    except (RuntimeError, RunnerError) as e:
        print(f"bench: audio_encoder graph replay left out: {e}", file=sys.stderr)
        return {}
    finally:
        graphs.graphs.clear()
    return {} if graphs.disabled else {"audio_encoder_graph_ms": times}  # disabled: those were direct calls


def timed_runner(engine: Engine, tok: Tekken, clock: Clock) -> MultimodalRunner:
    """A runner whose prefill returns only when the device is done: it stamps prompt_eval_end right after, which
    on CUDA would otherwise be when the prefill was queued."""
    return MultimodalRunner(engine, tok, tok.special_id("[AUDIO]"), synced_prefill=clock.cuda)


def first_ttft(engine: Engine, tok: Tekken, plan: Plan, clock: Clock) -> float:
    """Time to the first token of this engine's first generate(): the first file of a `run` process."""
    runner = timed_runner(engine, tok, clock)
    stats = Stats()
    clock.sync()
    runner.generate(plan.segments, plan.opts, stats=stats)
    return stats.ttft_ms


def bench_e2e(
    engine: Engine, tok: Tekken, plan: Plan, clock: Clock
) -> tuple[dict[str, list[float]], dict[str, str], list[int], list[int]]:
    """The whole runner on the audio file, `runs` times; returns figures, info, prompt ids and tokens."""
    runner = timed_runner(engine, tok, clock)
    samples: dict[str, list[float]] = {}
    info: dict[str, str] = {}
    for i in range(plan.warmup + plan.runs):
        stats = Stats()
        clock.sync()
        result = runner.generate(plan.segments, plan.opts, stats=stats)
        if i == 0:
            info["first_run_ms"] = f"{stats.inference_end_ms - stats.inference_start_ms:.1f}"
        if i < plan.warmup:
            continue
        for key, value in (
            ("ttft_ms", stats.ttft_ms),
            ("prefill_tokens_per_s", stats.prefill_tokens_per_s),
            ("decode_tokens_per_s", stats.decode_tokens_per_s),
            ("e2e_total_ms", stats.inference_end_ms - stats.inference_start_ms),
            ("real_time_factor", stats.real_time_factor),
        ):
            samples.setdefault(key, []).append(value)
    info.update(
        prompt_tokens=str(len(result.prompt_ids)),
        generated_tokens=str(len(result.tokens)),
        stop_reason=result.stop_reason,
    )
    return samples, info, result.prompt_ids, result.tokens


def bench_ours(
    bundle: Path, plan: Plan, tok: Tekken, clock: Clock, options: RuntimeOptions, vocab: int
) -> tuple[BackendResult, list[int], list[int]]:
    res = BackendResult(OURS)
    program = None
    reset_host_peak()  # on CUDA the host's peak is its own figure: load and run, not the imports before
    try:
        for _ in range(plan.load_runs):
            if program is not None:
                program.close()
                program = None
            clock.sync()
            t0 = time.perf_counter()
            program = Program.load(bundle, device=plan.device, options=options)
            clock.sync()
            total = (time.perf_counter() - t0) * 1e3
            for k, v in program.load_ms.items():
                res.samples.setdefault(f"load_{k}_ms", []).append(v)
            res.samples.setdefault("load_total_ms", []).append(total)
        engine = ProgramEngine(program, options)
        clock.sync()
        t0 = time.perf_counter()
        if options.warm_up and engine.warm_up():  # as `run`: load to ready is load_total + load_warm_up
            clock.sync()
            res.samples["load_warm_up_ms"] = [(time.perf_counter() - t0) * 1e3]
        res.samples["first_ttft_ms"] = [first_ttft(engine, tok, plan, clock)]
        reset_peak_memory(plan.device)
        wave, ids = method_inputs(plan, vocab, plan.device)
        res.samples.update(bench_methods(engine, plan, clock, wave, ids))
        # generate()'s own peak, apart from the method phases: what a peer's e2e-only peak compares to
        e2e, info, prompt_ids, tokens = with_peak(
            clock, res.samples, "e2e", lambda: bench_e2e(engine, tok, plan, clock)
        )
        res.samples.update(e2e)
        res.info.update(info, cuda_graph=str(engine.use_cuda_graph).lower())
        for switch, value in (("encoder_chunks", engine.encoder_chunks), ("prefill_chunk", engine.prefill_chunk)):
            if value:  # recorded where not the default
                res.info[switch] = str(value)
        # batch 1's: before the batched passes
        res.samples["peak_memory_mb"] = [peak_memory_mb(plan.device, res.samples)]
        if plan.device == "cuda":
            res.samples["peak_host_rss_mb"] = [host_peak_mb()]
        if plan.throughput is not None:
            runner = MultimodalRunner(engine, tok, tok.special_id("[AUDIO]"))
            samples, info = bench_throughput(runner, plan.throughput, plan.opts, clock, plan.warmup)
            res.samples.update(samples)
            res.info.update(info)
    finally:
        if program is not None:
            program.close()
    return res, prompt_ids, tokens
