"""The peers `bench` measures beside our bundle, with the same clock, plan and figures (runner/app/bench/measure.py):
our eager model with the bundle's weights, and transformers' Voxtral with the same weights (eager, and static
cache + torch.compile), the one users would pick. transformers is imported only when it is compared."""

from __future__ import annotations

import gc
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from runner.app.bench.measure import (
    Clock,
    Plan,
    bench_e2e,
    bench_methods,
    method_inputs,
    peak_memory_mb,
    reset_peak_memory,
)
from runner.app.bench.report import BackendResult
from runner.audio_chunks import pad_to_chunks
from runner.bundle import Manifest, weight_files
from runner.dtypes import torch_dtype
from runner.families.voxtral import Tekken
from runner.models.mel import LogMelSpectrogram
from runner.reference.hf import HFEngine, hf_config, to_hf_keys
from runner.reference.voxtral import eager_engine, model_from_bundle
from runner.runtime.prompt import TextSegment
from runner.runtime.weights import free_device_bytes


def bench_eager(bundle: Path, manifest: Manifest, plan: Plan, tok: Tekken, clock: Clock, vocab: int) -> BackendResult:
    res, engine = BackendResult("eager"), None
    for _ in range(plan.load_runs):
        engine = None
        gc.collect()
        clock.sync()
        t0 = time.perf_counter()
        engine = eager_engine(bundle, manifest, device=plan.device)
        clock.sync()
        res.samples.setdefault("load_total_ms", []).append((time.perf_counter() - t0) * 1e3)
    reset_peak_memory(plan.device)
    wave, ids = method_inputs(plan, vocab, plan.device)
    res.samples.update(bench_methods(engine, plan, clock, wave, ids))
    e2e, info, _, _ = bench_e2e(engine, tok, plan, clock)
    res.samples.update(e2e)
    res.info.update(info)
    res.samples["peak_memory_mb"] = [peak_memory_mb(plan.device, res.samples)]
    return res


class _Stamps:
    """A generate() streamer that notes when each token is out: the first put() is the prompt, the second the
    first generated token."""

    def __init__(self, clock: Clock):
        self.clock, self.times = clock, []

    def put(self, value):
        self.clock.sync()
        self.times.append(time.perf_counter())

    def end(self):
        pass


HF_HEADROOM = 4 * 2**30  # transformers' activations and static cache beside the weights, with room to spare


def weights_device(manifest: Manifest, device: str) -> str:
    """Where the bundle's weights are read for transformers' copy: the GPU, or the host where the GPU cannot hold
    them twice (the largest models' on one card). transformers' model is built on `device` either way."""
    if device != "cuda":
        return device
    size = sum(manifest.files[f].size for f in weight_files(manifest))
    return device if free_device_bytes() >= 2 * size + HF_HEADROOM else "cpu"


def bench_hf(
    kind: str,
    bundle: Path,
    manifest: Manifest,
    plan: Plan,
    tok: Tekken,
    clock: Clock,
    vocab: int,
    prompt_ids: list[int],
    our_tokens: list[int],
) -> BackendResult:
    import transformers

    transformers.logging.set_verbosity_error()
    res = BackendResult(kind, info={"transformers": transformers.__version__})
    device, dtype = plan.device, torch_dtype(manifest.dtype)
    model = _load_hf(bundle, manifest, plan, tok, clock, res)
    mel_module = LogMelSpectrogram(manifest.model["config"]["audio"]["n_mels"]).to(device)
    reset_peak_memory(device)
    if kind == "hf":
        engine = HFEngine(model, device, dtype)
        wave, ids = method_inputs(plan, vocab, device)
        with torch.inference_mode():
            mel = mel_module(wave)
        res.samples.update(bench_methods(engine, plan, clock, wave, ids, mel=mel))
        engine.reset()
    else:  # static cache + torch.compile: generate() compiles the decoding forward (on CPU only when asked)
        _compile_generate(model)
    tokens = _time_generate(model, mel_module, manifest, plan, tok, clock, prompt_ids, res)
    res.samples["peak_memory_mb"] = [peak_memory_mb(device, res.samples)]
    res.info.update(generated_tokens=str(len(tokens)), tokens_match_ours=str(tokens == our_tokens).lower())
    if kind == "hf-compile":
        res.info["note"] = (
            res.info["note"]
            + f"; the first generate() compiles ({res.info['first_run_ms']} ms)"
            + ("" if plan.warmup else ", and is among the timed runs (--warmup 0)")
        )
    return res


def _load_hf(bundle: Path, manifest: Manifest, plan: Plan, tok: Tekken, clock: Clock, res: BackendResult):
    """transformers' Voxtral with exactly the bundle's weights, built --load-runs times (each one timed)."""
    from transformers import VoxtralForConditionalGeneration

    device, dtype = plan.device, torch_dtype(manifest.dtype)
    ours = model_from_bundle(bundle, manifest, device=weights_device(manifest, device))  # exactly the bundle's weights
    state = ours.to_hf_layout(ours.state_dict())
    try:
        from transformers.initialization import no_init_weights  # from_pretrained skips the random init too
    except ImportError:
        no_init_weights = nullcontext
    model = None
    for _ in range(plan.load_runs):
        model = None
        gc.collect()
        clock.sync()
        t0 = time.perf_counter()
        with torch.device(device), no_init_weights():
            model = VoxtralForConditionalGeneration._from_config(hf_config(manifest, tok), dtype=dtype)
        model.load_state_dict(to_hf_keys(state, set(model.state_dict())), strict=True)
        model = model.to(device).eval()
        clock.sync()
        res.samples.setdefault("load_total_ms", []).append((time.perf_counter() - t0) * 1e3)
    res.info["note"] = "load = build the model and copy the weights from memory (no file reading, no digests)"
    return model


def _compile_generate(model) -> None:
    """generate() with a static cache, its decoding forward compiled by torch.compile (on CPU too)."""
    from transformers import CompileConfig

    model.generation_config.cache_implementation = "static"
    cc = CompileConfig()
    cc._compile_all_devices = True  # private in 5.x, but the only switch that compiles on CPU too
    model.generation_config.compile_config = cc


def _time_generate(
    model, mel_module, manifest: Manifest, plan: Plan, tok: Tekken, clock: Clock, prompt_ids: list[int], res
) -> list[int]:
    """The end-to-end figures of transformers' generate() on the plan's audio; returns the last run's tokens."""
    device, dtype = plan.device, torch_dtype(manifest.dtype)
    audio = next(s for s in plan.segments if not isinstance(s, TextSegment)).samples
    wave = torch.from_numpy(pad_to_chunks(audio, manifest.model["max_audio_chunks"])).to(device)
    input_ids = torch.tensor([prompt_ids], device=device)
    stamps = _Stamps(clock)
    for i in range(plan.warmup + plan.runs):
        stamps.times.clear()
        clock.sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                input_features=mel_module(wave).to(dtype),
                max_new_tokens=plan.opts.max_new_tokens,
                min_new_tokens=plan.opts.min_new_tokens,
                do_sample=False,
                streamer=stamps,
                pad_token_id=tok.eos_id,
                eos_token_id=tok.eos_id,
            )
        clock.sync()
        t1 = time.perf_counter()
        tokens = out[0, input_ids.shape[1] :].tolist()
        if i == 0:
            res.info["first_run_ms"] = f"{(t1 - t0) * 1e3:.1f}"
        if i >= plan.warmup:
            _record_run(res, stamps.times[1] if len(stamps.times) > 1 else t1, t0, t1, tokens, prompt_ids, plan)
    return tokens


def _record_run(res: BackendResult, first: float, t0: float, t1: float, tokens, prompt_ids, plan: Plan) -> None:
    """One timed generate(): started at t0, its first generated token out at `first`, done at t1."""
    ttft, total = (first - t0) * 1e3, (t1 - t0) * 1e3
    for key, value in (
        ("ttft_ms", ttft),
        ("prefill_tokens_per_s", len(prompt_ids) / ttft * 1e3),
        ("decode_tokens_per_s", (len(tokens) - 1) / (t1 - first) if len(tokens) > 1 and t1 > first else 0.0),
        ("e2e_total_ms", total),
        ("real_time_factor", total / 1e3 / plan.audio_seconds),
    ):
        res.samples.setdefault(key, []).append(value)
