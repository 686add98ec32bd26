"""`python -m runner bench`: time a bundle — load, each method, end-to-end transcription — beside the eager
model with the same weights (and optionally transformers' Voxtral), in one process and one run.

Every backend is measured the same way and one after another (loaded, timed, freed), so each one's peak memory
is its own: warm-up runs first, then `--runs` timed ones; on CUDA the clock is read after a device
synchronise, since the methods run asynchronously on their own streams. The eager model and transformers live
above the runtime and are imported only here, lazily (DESIGN.md §1).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.audio import N_SAMPLES, SAMPLE_RATE, TOKENS_PER_CHUNK, load_audio
from runner.bench_report import (
    FIGURE,
    OURS,
    BackendResult,
    BenchRun,
    check_baseline_matches,
    compare,
    from_records,
    markdown,
    read_records,
    to_records,
    write_chart,
    write_json,
)
from runner.bundle import MANIFEST_NAME, Manifest, bundle_digest, read_manifest
from runner.errors import RunnerError
from runner.multimodal import (
    GenerationOptions,
    MultimodalRunner,
    PrefillGraphs,
    ProgramEngine,
    Segment,
    TextSegment,
    to_encoder_dtype,
    transcription_prompt,
)
from runner.program import Program
from runner.stats import Stats
from runner.tokenizer import Tekken

REPO = Path(__file__).resolve().parents[1]
DEFAULT_AUDIO = REPO / "fixtures" / "audio" / "speech.wav"
PEERS = ("eager", "hf", "hf-compile")
GROUPS = ("load", "method", "e2e", "memory")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bundle",
        type=Path,
        default=None,
        help="bundle directory (python -m runner export); required unless --from-json",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="measure nothing: report (table, --chart, --baseline gate) from an earlier --json output",
    )
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="default: the device the bundle was built for"
    )
    p.add_argument(
        "--chunks",
        type=int,
        default=1,
        help=f"30 s audio chunks for the per-method shapes; prefill length = chunks x {TOKENS_PER_CHUNK} + prompt text",
    )
    p.add_argument("--audio", type=Path, default=DEFAULT_AUDIO, help="audio file for the end-to-end figures")
    p.add_argument("--language", default=None, help="e2e: the transcription prompt's language (adds lang:xx, as `run`)")
    p.add_argument("--runs", type=int, default=None, help="timed runs per figure (default: 5 on CPU, 10 on CUDA)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones")
    p.add_argument(
        "--load-runs", type=int, default=1, help="full loads to time per backend (the first is not a warm-up)"
    )
    p.add_argument(
        "--min-new-tokens",
        type=int,
        default=32,
        help="e2e: generate at least this many tokens (random weights hit </s> at random)",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="e2e: generate at most this many tokens")
    p.add_argument(
        "--compare",
        default="eager",
        help="comma list of peers: eager (our eager model), hf (transformers' VoxtralForConditionalGeneration), "
        "hf-compile (the same with a static cache + torch.compile); 'none' for ours only",
    )
    p.add_argument("--no-cuda-graph", action="store_true", help="CUDA: run our decode steps without graph replay")
    p.add_argument("--json", type=Path, default=None, help="write the PyTorch OSS benchmark v3 records here")
    p.add_argument("--chart", type=Path, default=None, help="write a PNG of the latency breakdown here")
    p.add_argument("--baseline", type=Path, default=None, help="earlier --json output to compare with")
    p.add_argument(
        "--max-regression",
        type=float,
        default=20.0,
        help="with --baseline: fail when one of our figures is worse by more than this percentage",
    )
    p.add_argument(
        "--gate",
        default="method,e2e,memory",
        help=f"figures the baseline gate checks: metric names or groups ({', '.join(GROUPS)})",
    )


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
    try:  # Linux: "5" resets the process's peak RSS (VmHWM) to its current RSS
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # elsewhere the peak is the process's since start (ru_maxrss)


def peak_memory_mb(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
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


def method_inputs(plan: Plan, vocab_size: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A waveform of `chunks` x 30 s and prompt ids of the prefill length (seeded: every backend sees the same)."""
    g = torch.Generator().manual_seed(0)
    wave = (torch.randn(plan.chunks * N_SAMPLES, generator=g) * 0.1).to(device)
    ids = torch.randint(0, vocab_size, (1, plan.prefill_tokens), generator=g).to(device)
    return wave, ids


def bench_methods(
    engine, plan: Plan, clock: Clock, wave: torch.Tensor, ids: torch.Tensor, mel: torch.Tensor | None = None
) -> dict[str, list[float]]:
    """Each method on the plan's shapes. `engine` is an Engine (multimodal.py); one without `preprocess` gets
    its features from `mel`. A decode step runs at position P after a prefill of P; engines with a growing
    cache (transformers') `rewind` to P before each step, untimed."""
    r, w, n = plan.runs, plan.warmup, plan.prefill_tokens
    out = {}
    if hasattr(engine, "preprocess"):
        out["preprocessor_ms"] = clock.repeat(lambda: engine.preprocess(wave), r, w)
        mel = engine.preprocess(wave)
    mel = to_encoder_dtype(mel, engine.encoder_dtype)
    out["audio_encoder_ms"] = clock.repeat(lambda: engine.encode(mel), r, w)
    if clock.cuda and isinstance(engine, ProgramEngine) and engine.use_cuda_graph:
        out.update(_encoder_graph_replay(engine, mel, clock, r, w))
    out["token_embedding_ms"] = clock.repeat(lambda: engine.embed(ids), r, w)
    embeds, step = engine.embed(ids), engine.embed(ids[:, :1])
    pos, pos1 = torch.arange(n, device=ids.device), torch.tensor([n], device=ids.device)
    out["text_decoder_prefill_ms"] = clock.repeat(lambda: engine.decode(embeds, pos), r, w, before=engine.reset)
    engine.reset()
    engine.decode(embeds, pos)
    rewind = getattr(engine, "rewind", None)
    out["text_decoder_decode_ms"] = clock.repeat(
        lambda: engine.decode(step, pos1), r, w, before=(lambda: rewind(n)) if rewind else None
    )
    engine.reset()
    return out


def _encoder_graph_replay(engine: ProgramEngine, mel: torch.Tensor, clock: Clock, runs: int, warmup: int) -> dict:
    """audio_encoder as generate() runs it on CUDA, inside a captured graph (`PrefillGraphs`: run, captured on the
    second call, replayed from the third). The direct call above pays the host's launch of each of its ~400
    kernels; a replay is the kernels' own time. A capture that fails leaves the figure out, not the run."""
    graphs = PrefillGraphs(engine, capacity=1)
    try:
        times = clock.repeat(lambda: graphs.run(engine.encode, [mel]), runs, max(warmup, 2))
    except (RuntimeError, RunnerError) as e:
        print(f"bench: audio_encoder graph replay left out: {e}", file=sys.stderr)
        return {}
    finally:
        graphs.graphs.clear()
    return {} if graphs.disabled else {"audio_encoder_graph_ms": times}  # disabled: those were direct calls


class _Synced:
    """An Engine whose prefill returns only when the device is done: the runner stamps prompt_eval_end right
    after it, which on CUDA would otherwise be when it was queued."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def run_prefill(self, compute, inputs):
        out = self._engine.run_prefill(compute, inputs)  # not inside: a prefill may be captured as a CUDA graph
        torch.cuda.synchronize()
        return out


def bench_e2e(
    engine, tok: Tekken, plan: Plan, clock: Clock
) -> tuple[dict[str, list[float]], dict[str, str], list[int], list[int]]:
    """The whole runner on the audio file, `runs` times; returns figures, info, prompt ids and tokens."""
    runner = MultimodalRunner(_Synced(engine) if clock.cuda else engine, tok)
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
    bundle: Path, plan: Plan, tok: Tekken, clock: Clock, cuda_graph: bool, vocab: int
) -> tuple[BackendResult, list[int], list[int]]:
    res = BackendResult(OURS)
    program = None
    try:
        for _ in range(plan.load_runs):
            if program is not None:
                program.close()
                program = None
            clock.sync()
            t0 = time.perf_counter()
            program = Program.load(bundle, device=plan.device)
            clock.sync()
            total = (time.perf_counter() - t0) * 1e3
            for k, v in program.load_ms.items():
                res.samples.setdefault(f"load_{k}_ms", []).append(v)
            res.samples.setdefault("load_total_ms", []).append(total)
        engine = ProgramEngine(program, cuda_graph=cuda_graph)
        reset_peak_memory(plan.device)
        wave, ids = method_inputs(plan, vocab, plan.device)
        res.samples.update(bench_methods(engine, plan, clock, wave, ids))
        e2e, info, prompt_ids, tokens = bench_e2e(engine, tok, plan, clock)
        res.samples.update(e2e)
        res.info.update(info, cuda_graph=str(engine.use_cuda_graph).lower())
        res.samples["peak_memory_mb"] = [peak_memory_mb(plan.device)]
    finally:
        if program is not None:
            program.close()
    return res, prompt_ids, tokens


def bench_eager(bundle: Path, manifest: Manifest, plan: Plan, tok: Tekken, clock: Clock, vocab: int) -> BackendResult:
    from runner.export.eager import EagerEngine  # the eager model lives above the runtime

    res, engine = BackendResult("eager"), None
    for _ in range(plan.load_runs):
        engine = None
        gc.collect()
        clock.sync()
        t0 = time.perf_counter()
        engine = EagerEngine(bundle, manifest, device=plan.device)
        clock.sync()
        res.samples.setdefault("load_total_ms", []).append((time.perf_counter() - t0) * 1e3)
    reset_peak_memory(plan.device)
    wave, ids = method_inputs(plan, vocab, plan.device)
    res.samples.update(bench_methods(engine, plan, clock, wave, ids))
    e2e, info, _, _ = bench_e2e(engine, tok, plan, clock)
    res.samples.update(e2e)
    res.info.update(info)
    res.samples["peak_memory_mb"] = [peak_memory_mb(plan.device)]
    return res


# ---------------------------------------------------------------- context and the verb


def _git_sha() -> str:
    """The commit measured; "-dirty" when tracked files differ from it (a copied working tree whose history is
    stale says so, rather than naming a commit whose code did not run)."""
    if os.environ.get("GITHUB_SHA"):
        return os.environ["GITHUB_SHA"]
    try:
        git = ["git", "-C", str(REPO)]
        sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, timeout=30)
        return sha + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def context(bundle: Path, manifest: Manifest, plan: Plan, audio: Path) -> dict[str, str]:
    src = manifest.model.get("source", {})
    cpu = f"{platform.machine()} x{os.cpu_count()}"
    gpu = torch.cuda.get_device_name() if plan.device == "cuda" else ""
    return {
        "model": str(src.get("name", "voxtral")),
        "weights": str(src.get("kind", "")),
        "weights_digest": str(src.get("weights_digest", "")),
        "device": plan.device,
        "dtype": manifest.dtype,
        "arch": gpu or cpu,
        "cpu": cpu,
        "gpu": gpu,
        "torch_version": torch.__version__,
        "transformers_version": _version("transformers"),
        "bundle_torch_version": manifest.torch_version,
        "git_sha": _git_sha(),
        "bundle": str(bundle),
        "bundle_digest": bundle_digest(bundle / MANIFEST_NAME),
        "runs": str(plan.runs),
        "warmup": str(plan.warmup),
        "load_runs": str(plan.load_runs),
        "chunks": str(plan.chunks),
        "prefill_tokens": str(plan.prefill_tokens),
        "audio": str(audio),
        "audio_seconds": f"{plan.audio_seconds:.2f}",
        "new_tokens": (
            str(plan.opts.max_new_tokens)
            if plan.opts.min_new_tokens == plan.opts.max_new_tokens
            else f"{plan.opts.min_new_tokens}..{plan.opts.max_new_tokens}"
        ),
        "memory_kind": (
            "torch.cuda.max_memory_allocated while running (after load)"
            if plan.device == "cuda"
            else "process peak RSS while running (VmHWM, reset after load)"
        ),
        "runner": "github-actions" if os.environ.get("GITHUB_ACTIONS") else "local",
        # other work on the machine skews CPU figures badly (OpenMP threads wait for busy cores): say how much
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a",
    }


def _parse_compare(text: str) -> list[str]:
    peers = [p.strip() for p in text.split(",") if p.strip() and p.strip() != "none"]
    for p in peers:
        if p not in PEERS:
            raise RunnerError(f"--compare {p}: unknown peer; choose from {', '.join(PEERS)} (or none)")
    return list(dict.fromkeys(peers))


def _parse_gate(text: str) -> set[str]:
    gate = {g.strip() for g in text.split(",") if g.strip()}
    unknown = sorted(g for g in gate if g not in GROUPS and g not in FIGURE)
    if unknown:
        raise RunnerError(f"--gate {','.join(unknown)}: not a figure or group ({', '.join(GROUPS)})")
    return gate


def make_plan(args: argparse.Namespace, manifest: Manifest, tok: Tekken) -> Plan:
    for flag, value, least in (
        ("--runs", args.runs, 1),
        ("--warmup", args.warmup, 0),
        ("--load-runs", args.load_runs, 1),
        ("--chunks", args.chunks, 1),
    ):
        if value is not None and value < least:
            raise RunnerError(f"{flag} {value}: must be >= {least}")
    if args.min_new_tokens > args.max_new_tokens:
        raise RunnerError(f"--min-new-tokens {args.min_new_tokens} is above --max-new-tokens {args.max_new_tokens}")
    m = manifest.model
    if args.chunks > m["max_audio_chunks"]:
        raise RunnerError(f"--chunks {args.chunks}: the bundle takes at most {m['max_audio_chunks']} chunks")
    audio = load_audio(args.audio)
    segments = transcription_prompt(tok, audio, args.language)
    text = sum(len(s.ids) for s in segments if isinstance(s, TextSegment))
    prefill = args.chunks * TOKENS_PER_CHUNK + text
    if prefill + 1 > m["max_seq_len"]:
        raise RunnerError(
            f"--chunks {args.chunks}: prefill {prefill} + 1 decode step exceeds the bundle's context "
            f"({m['max_seq_len']} tokens)"
        )
    device = args.device or manifest.device
    return Plan(
        device=device,
        runs=args.runs or (10 if device == "cuda" else 5),
        warmup=args.warmup,
        load_runs=args.load_runs,
        chunks=args.chunks,
        prefill_tokens=prefill,
        segments=segments,
        opts=GenerationOptions(max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens),
        audio_seconds=len(audio) / SAMPLE_RATE,
    )


def _say(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    peers, gate = _parse_compare(args.compare), _parse_gate(args.gate)
    baseline = read_records(args.baseline) if args.baseline else None  # fail before minutes of timing
    if args.from_json:
        run = from_records(read_records(args.from_json), args.from_json)
    elif args.bundle:
        run = measure(args, peers)
    else:
        raise RunnerError("--bundle DIR is required (or --from-json FILE to report an earlier run)")
    return report(run, args, baseline, gate)


def measure(args: argparse.Namespace, peers: list[str]) -> BenchRun:
    manifest = read_manifest(args.bundle)  # Program.load verifies every digest, timed
    family = manifest.model.get("family", "voxtral")
    if family != "voxtral":  # Whisper bundles: `run --json` stats (benchmarks/README-whisper.md)
        raise RunnerError(f"{args.bundle}: bench times Voxtral bundles; this is a {family} bundle (use `run --json`)")
    tok = Tekken.from_file(args.bundle / manifest.model["tokenizer"])
    plan = make_plan(args, manifest, tok)
    vocab = manifest.model["config"]["text"]["vocab_size"]
    clock = Clock(plan.device)

    _say(f"ours: {plan.load_runs} load(s), then {plan.warmup} warm-up + {plan.runs} timed runs per figure")
    ours, prompt_ids, tokens = bench_ours(args.bundle, plan, tok, clock, not args.no_cuda_graph, vocab)
    results = [ours]
    for peer in peers:
        _say(f"{peer}: the same figures")
        try:
            if peer == "eager":
                results.append(bench_eager(args.bundle, manifest, plan, tok, clock, vocab))
            else:
                from runner.bench_hf import bench_hf  # transformers: imported only when compared

                results.append(bench_hf(peer, args.bundle, manifest, plan, tok, clock, vocab, prompt_ids, tokens))
        except Exception as e:  # a peer that cannot run is a result to report, not a reason to lose ours
            msg = " ".join(f"{type(e).__name__}: {e}".split())[:500]
            _say(f"{peer} failed: {msg}")
            results.append(BackendResult(peer, error=msg))
        gc.collect()
        if plan.device == "cuda":
            torch.cuda.empty_cache()

    return BenchRun(context(args.bundle, manifest, plan, args.audio), results)


def report(run: BenchRun, args: argparse.Namespace, baseline: list[dict] | None, gate: set[str]) -> int:
    text = markdown(run)
    regressions = []
    if baseline is not None:
        current = to_records(run)
        check_baseline_matches(current, baseline, args.baseline)
        changes = sorted(compare(current, baseline, gate), key=lambda c: -c.worse_pct)
        regressions = [c for c in changes if c.worse_pct > args.max_regression]
        text += (
            f"\nvs baseline `{args.baseline}` (gate: {', '.join(sorted(gate))}, max regression "
            f"{args.max_regression:g}%): {len(regressions)} regression(s) in {len(changes)} figures\n"
        )
        text += "".join(f"- {'**REGRESSION** ' if c in regressions else ''}{c.describe()}\n" for c in changes)
    print(text, end="", flush=True)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as f:
            f.write(text + "\n")
    if args.json:
        write_json(run, args.json)
        _say(f"wrote {args.json}")
    if args.chart:
        write_chart(run, args.chart)
        _say(f"wrote {args.chart}")
    if regressions:
        more = (
            f" (and {len(regressions) - 1} more: {', '.join(c.metric for c in regressions[1:])})"
            if len(regressions) > 1
            else ""
        )
        raise RunnerError(
            f"regression beyond {args.max_regression:g}% vs {args.baseline}: {regressions[0].describe()}{more}"
        )
    return 0
