"""`python -m runner bench`: time a bundle (load, each method, end-to-end transcription) beside the eager model
with the same weights and optionally transformers' Voxtral, in one process and one run; then the table, the v3
JSON, the chart, and the regression gate against a baseline."""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from runner.app.bench.args import GROUPS, PEERS
from runner.app.bench.chart import write_chart
from runner.app.bench.gate import NO_BASELINE, GateResult, Thresholds, evaluate, parse_thresholds, read_baseline
from runner.app.bench.measure import Clock, Plan, bench_ours
from runner.app.bench.peers import bench_eager, bench_hf
from runner.app.bench.report import (
    BackendResult,
    BenchRun,
    figure_for,
    from_records,
    markdown,
    read_records,
    throughput_batches,
    throughput_errors,
    to_records,
    write_json,
)
from runner.app.bench.throughput import plan_throughput, throughput_table
from runner.app.options import Environment
from runner.audio import SAMPLE_RATE, TOKENS_PER_CHUNK, load_audio
from runner.bundle import MANIFEST_NAME, Manifest, bundle_digest, read_manifest
from runner.errors import RunnerError
from runner.families import family_for
from runner.families.voxtral import VoxtralFamily, transcription_prompt
from runner.runtime.generate import GenerationOptions
from runner.runtime.prompt import TextSegment

REPO = Path(__file__).resolve().parents[3]  # the checkout, for the commit measured


# ---------------------------------------------------------------- context and the verb


def _git_sha(env: Environment) -> str:
    """The commit measured; "-dirty" when tracked files differ from it (a copied working tree whose history is
    stale says so, rather than naming a commit whose code did not run)."""
    if env.github_sha:
        return env.github_sha
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


def context(bundle: Path, manifest: Manifest, plan: Plan, audio: Path, env: Environment) -> dict[str, str]:
    src = manifest.model.get("source", {})
    cpu = f"{platform.machine()} x{os.cpu_count()}"
    gpu = torch.cuda.get_device_name() if plan.device == "cuda" else ""
    return {
        "model": str(src.get("name", manifest.model.get("family"))),
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
        "git_sha": _git_sha(env),
        "bundle": str(bundle),
        "bundle_digest": bundle_digest(bundle / MANIFEST_NAME),
        # a method compiled as its fallback (export's last resort) is slower: its figures must say so
        "fallbacks": "; ".join(f"{m} ({why})" for m, why in manifest.model.get("fallbacks", {}).items()),
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
        "runner": "github-actions" if env.github_actions else "local",
        # other work on the machine skews CPU figures badly (OpenMP threads wait for busy cores): say how much
        "load_average": _load_average(),
    }


def _load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):  # no load average on this system (Windows has no os.getloadavg)
        return "n/a"


def _parse_compare(text: str) -> list[str]:
    peers = [p.strip() for p in text.split(",") if p.strip() and p.strip() != "none"]
    for p in peers:
        if p not in PEERS:
            raise RunnerError(f"--compare {p}: unknown peer; choose from {', '.join(PEERS)} (or none)")
    return list(dict.fromkeys(peers))


def _parse_gate(text: str) -> set[str]:
    gate = {g.strip() for g in text.split(",") if g.strip()}
    if not gate:  # an empty gate checks nothing and so passes anything
        raise RunnerError(f"--gate {text!r}: name at least one figure or group ({', '.join(GROUPS)})")
    unknown = sorted(g for g in gate if g not in GROUPS and figure_for(g) is None)
    if unknown:
        raise RunnerError(f"--gate {','.join(unknown)}: not a figure or group ({', '.join(GROUPS)})")
    return gate


def make_plan(args: argparse.Namespace, manifest: Manifest, family: VoxtralFamily) -> Plan:
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
    segments = transcription_prompt(family.tokenizer, audio, args.language)
    text = sum(len(s.ids) for s in segments if isinstance(s, TextSegment))
    prefill = args.chunks * TOKENS_PER_CHUNK + text
    if prefill + 1 > m["max_seq_len"]:
        raise RunnerError(
            f"--chunks {args.chunks}: prefill {prefill} + 1 decode step exceeds the bundle's context "
            f"({m['max_seq_len']} tokens)"
        )
    device = args.device or manifest.device
    throughput = plan_throughput(args, family, m["max_audio_chunks"])
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
        throughput=throughput,
    )


def _say(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    peers, gate = _parse_compare(args.compare), _parse_gate(args.gate)
    thresholds = parse_thresholds(str(args.max_regression), gate)
    if args.baseline_optional and not args.baseline:
        raise RunnerError("--baseline-optional: give the baseline file with --baseline FILE")
    baseline, skipped = None, None
    if args.baseline:  # fail before minutes of timing
        baseline, skipped = read_baseline(args.baseline, optional=args.baseline_optional)
    if args.from_json:
        run = from_records(read_records(args.from_json), args.from_json)
    elif args.bundle:
        run = measure(args, peers)
    else:
        raise RunnerError("--bundle DIR is required (or --from-json FILE to report an earlier run)")
    return report(run, args, baseline, gate, thresholds, skipped)


def measure(args: argparse.Namespace, peers: list[str]) -> BenchRun:
    manifest = read_manifest(args.bundle)  # Program.load verifies every digest, timed
    family = family_for(args.bundle, manifest.model)
    caps = family.capabilities
    if not caps.chat_prompts:  # the figures and peers here are Voxtral's prompts (benchmarks/README-whisper.md)
        how = "`stream --bench`" if caps.streaming else "`run --json`"
        raise RunnerError(f"{args.bundle}: bench times Voxtral bundles; this is a {family.name} bundle (use {how})")
    tok = family.tokenizer
    plan = make_plan(args, manifest, family)
    vocab = manifest.model["config"]["text"]["vocab_size"]
    clock = Clock(plan.device)

    _say(f"ours: {plan.load_runs} load(s), then {plan.warmup} warm-up + {plan.runs} timed runs per figure")
    ours, prompt_ids, tokens = bench_ours(args.bundle, plan, tok, clock, args.runtime, vocab)
    results = [ours]
    for peer in peers:
        _say(f"{peer}: the same figures")
        try:
            if peer == "eager":
                results.append(bench_eager(args.bundle, manifest, plan, tok, clock, vocab))
            else:
                results.append(bench_hf(peer, args.bundle, manifest, plan, tok, clock, vocab, prompt_ids, tokens))
        except Exception as e:  # a peer that cannot run is a result to report, not a reason to lose ours
            if args.cancel.requested:  # unless a stop was asked for: whatever torch raised on the way out is that
                raise
            msg = " ".join(f"{type(e).__name__}: {e}".split())[:500]
            _say(f"{peer} failed: {msg}")
            results.append(BackendResult(peer, error=msg))
        gc.collect()
        if plan.device == "cuda":
            torch.cuda.empty_cache()

    ctx = context(args.bundle, manifest, plan, args.audio, args.env)
    if plan.throughput is not None:
        ctx.update(throughput_files=str(len(plan.throughput.prompts)), throughput_audio=plan.throughput.describe())
    return BenchRun(ctx, results)


def report(
    run: BenchRun,
    args: argparse.Namespace,
    baseline: list[dict] | None,
    gate: set[str],
    thresholds: Thresholds,
    skipped: str | None = None,
) -> int:
    """The headline table (stdout, and the job summary when there is one), the gate's table, the JSON and the
    chart; then the gate's verdict. Results are written before a regression fails the run."""
    text = markdown(run)
    if throughput_batches(run.ours):  # the table of each batch size's pass, after the same-run table
        text += "\n" + "\n".join(throughput_table(run)) + "\n"
    result = None
    if baseline is not None:
        result = evaluate(to_records(run), baseline, args.baseline, gate, thresholds)
    elif skipped is not None:
        result = GateResult(args.baseline, frozenset(gate), thresholds, skipped=skipped)
        _say(f"{NO_BASELINE} ({skipped})")
    if result is not None:
        text += "\n" + result.markdown()
    print(text, end="", flush=True)
    if args.env.step_summary:
        with open(args.env.step_summary, "a") as f:
            f.write(text + "\n")
    if args.json:
        write_json(run, args.json)
        _say(f"wrote {args.json}")
    if args.chart:
        write_chart(run, args.chart)
        _say(f"wrote {args.chart}")
    left_out = [f"throughput at batch {b} not measured: {why}" for b, why in throughput_errors(run.ours).items()]
    if left_out:  # a batch size that could not run (a bundle without --max-batch) fails the run, after its report
        raise RunnerError("; ".join(left_out))
    if result is not None and (error := result.error()):
        raise RunnerError(error)
    return 0
