"""The eager Whisper with exactly a bundle's weights, as an Engine (cross-attended audio)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from runner.bundle import Manifest
from runner.dtypes import torch_dtype
from runner.models import whisper
from runner.models.quant_linear import use_quant_layout
from runner.models.state import empty_model, load_state
from runner.models.whisper import Whisper, WhisperConfig
from runner.reference.engine import EagerEngine


def whisper_from_bundle(bundle_dir: Path, manifest, device: str = "cpu") -> Whisper:
    """The eager Whisper with exactly the bundle's weights, mapped back from each method's FQNs."""
    config = WhisperConfig.from_dict(manifest.model["config"])
    dtype = torch_dtype(manifest.dtype)
    state: dict[str, torch.Tensor] = {}
    files = {m: load_file(str(Path(bundle_dir) / manifest.methods[m].weights), device=device) for m in manifest.methods}
    for k, v in files["audio_encoder"].items():
        head, _, rest = k.partition(".")
        if head in ("cross_k", "cross_v"):
            i, _, param = rest.partition(".")
            state[f"decoder.layers.{i}.encoder_attn.{head[-1]}_proj.{param}"] = v
        else:
            state[k] = v
    for m in ("token_embedding", "text_decoder"):
        state.update({f"decoder.{k}": v for k, v in files[m].items()})
    model = empty_model(lambda: Whisper(config))
    if quant := manifest.model.get("quant"):  # an int4 bundle: its decoder linears as QuantLinear
        use_quant_layout(model, quant)
    load_state(model, state, source=str(bundle_dir), assign=True)
    model = model.to(device=device, dtype=dtype).eval()
    model.setup_caches(manifest.model["max_seq_len"], dtype)
    if heads := manifest.model.get("alignment_heads"):
        model.alignment_heads = tuple(tuple(h) for h in heads)
    return model


def eager_engine(bundle_dir: Path, manifest: Manifest, device: str | None = None) -> EagerEngine:
    device = device or manifest.device
    eot = manifest.model.get("special_tokens", {}).get("eot")
    return engine_for(whisper_from_bundle(bundle_dir, manifest, device=device), device, eot)


def engine_for(model: Whisper, device: str = "cpu", eot: int | None = None) -> EagerEngine:
    """Over an eager model with its caches set up (tests, and references without a bundle); with the tokenizer's
    `eot`, word timing too."""
    return EagerEngine(
        whisper.methods(model, eot),
        device=device,
        max_seq_len=model.decoder.layers[0].self_attn.kv_cache.k_cache.shape[2],
        max_audio_chunks=1,
        encoder_dtype=model.decoder.embed_tokens.weight.dtype,
        reset=model.reset_caches,
        cross_attention=True,
    )
