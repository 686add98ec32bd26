"""The eager Voxtral with exactly a bundle's weights (read from its own weight files, so fetched bundles work
too), as an Engine."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from runner.bundle import Manifest
from runner.dtypes import torch_dtype
from runner.models import voxtral
from runner.models.quant_linear import use_quant_layout
from runner.models.state import empty_model, load_state
from runner.models.voxtral import Voxtral
from runner.models.voxtral_batch import BatchDecoder, SlotCaches
from runner.models.voxtral_config import VoxtralConfig
from runner.reference.engine import EagerEngine


def model_from_bundle(bundle_dir: Path, manifest, device: str = "cpu") -> Voxtral:
    """The eager model with exactly the bundle's weights (for `--reference eager` and benchmarks): the weight
    files are keyed by each exported method's FQNs; map them back onto the full model."""
    config = VoxtralConfig.from_dict(manifest.model["config"])
    dtype = torch_dtype(manifest.dtype)
    prefix = {"audio_encoder": "", "token_embedding": "language_model.model.", "text_decoder": "language_model.model."}
    state = {}
    for method, pre in prefix.items():
        for k, v in load_file(str(Path(bundle_dir) / manifest.methods[method].weights), device=device).items():
            state["language_model." + k if k.startswith("lm_head.") else pre + k] = v
    model = empty_model(lambda: Voxtral(config)).to(dtype)  # no host-side fp32 copy of a large model
    if quant := manifest.model.get("quant"):  # a quantised bundle: its linears as QuantLinear / Fp8Linear
        use_quant_layout(model, quant)
    # each tensor in the dtype the model holds it in: the bundle's dtype, fp8 codes and their float32 scales
    want = {k: t.dtype for k, t in model.state_dict().items()}
    state = {k: v.to(want[k]) if k in want and v.is_floating_point() else v for k, v in state.items()}
    load_state(model, state, source=str(bundle_dir), assign=True)
    model.eval()
    model.setup_caches(manifest.model["max_seq_len"])
    return model


def eager_engine(bundle_dir: Path, manifest: Manifest, device: str | None = None) -> EagerEngine:
    device = device or manifest.device
    model = model_from_bundle(bundle_dir, manifest, device=device)
    batch, slots = None, []
    if manifest.model.get("max_batch", 1) > 1:  # the bundle's batched step, eagerly: as many slots, its own caches
        t, dtype = model.config.text, model.language_model.model.embed_tokens.weight.dtype
        state = SlotCaches(t, manifest.model["max_batch"], manifest.model["max_seq_len"], dtype, device)
        batch = BatchDecoder(t, model.language_model, state)
        slots = [(state.kv(i).k_cache, layer.self_attn.kv_cache.k_cache) for i, layer in enumerate(batch.layers)] + [
            (state.kv(i).v_cache, layer.self_attn.kv_cache.v_cache) for i, layer in enumerate(batch.layers)
        ]
    return EagerEngine(
        voxtral.methods(model),
        device=device,
        max_seq_len=manifest.model["max_seq_len"],
        max_audio_chunks=manifest.model["max_audio_chunks"],
        encoder_dtype=torch_dtype(manifest.dtype),
        reset=model.reset_caches,
        batch=batch,
        slots=slots,
    )
