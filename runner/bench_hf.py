"""transformers' `VoxtralForConditionalGeneration` with a bundle's own weights, timed the way `runner.bench`
times ours (eager, and static cache + torch.compile): the peer users would pick, measured beside us.
Imported by runner.bench only when `--compare hf`/`hf-compile` asks for it."""

from __future__ import annotations

import gc
import inspect
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from runner.audio import pad_to_chunks
from runner.bench import Clock, Plan, bench_methods, method_inputs, peak_memory_mb, reset_peak_memory
from runner.bench_report import (
    BackendResult,
)
from runner.bundle import Manifest
from runner.errors import RunnerError
from runner.multimodal import (
    TextSegment,
)
from runner.tokenizer import Tekken


def hf_config(manifest: Manifest, tok: Tekken):
    """transformers' VoxtralConfig for our config (rope given both ways: 5.x reads rope_parameters, older
    releases rope_theta)."""
    from transformers import VoxtralConfig as HFVoxtralConfig

    c = manifest.model["config"]
    a, t = c["audio"], c["text"]
    return HFVoxtralConfig(
        audio_config={
            "hidden_size": a["dim"],
            "intermediate_size": a["ffn_dim"],
            "num_hidden_layers": a["n_layers"],
            "num_attention_heads": a["n_heads"],
            "num_mel_bins": a["n_mels"],
            "max_source_positions": a["max_source_positions"],
        },
        text_config={
            "vocab_size": t["vocab_size"],
            "hidden_size": t["dim"],
            "intermediate_size": t["ffn_dim"],
            "num_hidden_layers": t["n_layers"],
            "num_attention_heads": t["n_heads"],
            "num_key_value_heads": t["n_kv_heads"],
            "head_dim": t["head_dim"],
            "rms_norm_eps": t["norm_eps"],
            "rope_theta": t["rope_theta"],
            "rope_parameters": {"rope_type": "default", "rope_theta": t["rope_theta"]},
            "max_position_embeddings": max(manifest.model["max_seq_len"], 4096),
            "tie_word_embeddings": False,
            "bos_token_id": tok.bos_id,
            "eos_token_id": tok.eos_id,
        },
        audio_token_id=c["audio_token_id"],
    )


# Our keys are what save_pretrained writes; transformers 5 names them in memory as below (4.x: as ours).
_HF_LAYOUTS = (
    (
        ("audio_tower.", "model.audio_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
    ),
    (),
)


def to_hf_keys(state: dict[str, torch.Tensor], hf_keys: set[str]) -> dict[str, torch.Tensor]:
    def rename(k: str, layout) -> str:
        return next((new + k[len(old) :] for old, new in layout if k.startswith(old)), k)

    for layout in _HF_LAYOUTS:
        mapped = {rename(k, layout): v for k, v in state.items()}
        if set(mapped) == hf_keys:
            return mapped
    missing = sorted(hf_keys - {rename(k, _HF_LAYOUTS[0]) for k in state})
    raise RunnerError(f"transformers' Voxtral names its weights differently from the bundle's (e.g. {missing[:3]})")


class HFEngine:
    """transformers' model behind the Engine calls bench_methods makes (no preprocess: HF's feature extractor
    is numpy; the features come from our eager mel). Its cache grows, so the decode step rewinds it."""

    def __init__(self, model, device: str, encoder_dtype: torch.dtype):
        from transformers import DynamicCache

        self.model, self.device, self.encoder_dtype, self._cache_cls = model, device, encoder_dtype, DynamicCache
        # transformers 5.2x renamed past_key_values to cache (the old name warns): use whichever forward takes
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.reset()

    @torch.inference_mode()
    def encode(self, mel):
        out = self.model.get_audio_features(mel)
        return getattr(out, "pooler_output", out)[None]  # 5.x returns an output object, older releases a tensor

    @torch.inference_mode()
    def embed(self, ids):
        return self.model.get_input_embeddings()(ids)

    @torch.inference_mode()
    def decode(self, embeds, pos):
        out = self.model(inputs_embeds=embeds, use_cache=True, logits_to_keep=1, **{self._cache_kw: self.cache})
        return out.logits[:, -1].float()

    def reset(self):
        self.cache = self._cache_cls()

    def rewind(self, n: int):
        extra = self.cache.get_seq_length() - n
        if extra > 0:
            self.cache.crop(-extra)  # a negative crop drops that many positions (5.2x refuses positive ones)


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
    from transformers import VoxtralForConditionalGeneration

    from runner.export.checkpoint import model_from_bundle
    from runner.export.mel import LogMelSpectrogram

    transformers.logging.set_verbosity_error()
    res = BackendResult(kind, info={"transformers": transformers.__version__})
    device, dtype = plan.device, getattr(torch, manifest.dtype)
    ours = model_from_bundle(bundle, manifest, device=device)  # exactly the bundle's weights
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
    del ours, state
    mel_module = LogMelSpectrogram(manifest.model["config"]["audio"]["n_mels"]).to(device)
    reset_peak_memory(device)

    engine = HFEngine(model, device, dtype)
    if kind == "hf":
        wave, ids = method_inputs(plan, vocab, device)
        with torch.inference_mode():
            mel = mel_module(wave)
        res.samples.update(bench_methods(engine, plan, clock, wave, ids, mel=mel))
        engine.reset()
    else:  # static cache + torch.compile: generate() compiles the decoding forward (on CPU only when asked)
        from transformers import CompileConfig

        model.generation_config.cache_implementation = "static"
        cc = CompileConfig()
        cc._compile_all_devices = True  # private in 5.x, but the only switch that compiles on CPU too
        model.generation_config.compile_config = cc

    audio = next(s for s in plan.segments if not isinstance(s, TextSegment)).samples
    wave = torch.from_numpy(pad_to_chunks(audio, manifest.model["max_audio_chunks"])).to(device)
    input_ids = torch.tensor([prompt_ids], device=device)
    stamps = _Stamps(clock)
    for i in range(plan.warmup + plan.runs):
        stamps.times.clear()
        clock.sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            features = mel_module(wave).to(dtype)
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                input_features=features,
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
        if i < plan.warmup:
            continue
        first = stamps.times[1] if len(stamps.times) > 1 else t1
        ttft, total = (first - t0) * 1e3, (t1 - t0) * 1e3
        for key, value in (
            ("ttft_ms", ttft),
            ("prefill_tokens_per_s", len(prompt_ids) / ttft * 1e3),
            ("decode_tokens_per_s", (len(tokens) - 1) / (t1 - first) if len(tokens) > 1 and t1 > first else 0.0),
            ("e2e_total_ms", total),
            ("real_time_factor", total / 1e3 / plan.audio_seconds),
        ):
            res.samples.setdefault(key, []).append(value)
    res.samples["peak_memory_mb"] = [peak_memory_mb(device)]
    res.info.update(generated_tokens=str(len(tokens)), tokens_match_ours=str(tokens == our_tokens).lower())
    if kind == "hf-compile":
        res.info["note"] = (
            res.info["note"]
            + f"; the first generate() compiles ({res.info['first_run_ms']} ms)"
            + ("" if plan.warmup else ", and is among the timed runs (--warmup 0)")
        )
    return res
