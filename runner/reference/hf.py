"""transformers' `VoxtralForConditionalGeneration` as a peer: its config for ours, our weights under its key
names, and an engine over it for the per-method figures. transformers is imported only when used."""

from __future__ import annotations

import inspect

import torch

from runner.bundle import Manifest
from runner.errors import RunnerError
from runner.families.voxtral import Tekken
from runner.runtime.engine import Engine


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


class HFEngine(Engine):
    """transformers' model behind the Engine calls bench_methods makes (no preprocess: HF's feature extractor
    is numpy; the features come from our eager mel). Its cache grows, so the decode step rewinds it."""

    def __init__(self, model, device: str, encoder_dtype: torch.dtype):
        from transformers import DynamicCache

        super().__init__()
        self.model, self.device, self.encoder_dtype, self._cache_cls = model, device, encoder_dtype, DynamicCache
        # transformers 5.2x renamed past_key_values to cache (the old name warns): use whichever forward takes
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.reset()

    @torch.inference_mode()
    def encode(self, mel):
        out = self.model.get_audio_features(mel)
        return (out if isinstance(out, torch.Tensor) else out.pooler_output)[None]  # 5.x: an output object

    @torch.inference_mode()
    def embed(self, ids):
        return self.model.get_input_embeddings()(ids)

    @torch.inference_mode()
    def decode(self, embeds, pos):
        out = self.model(inputs_embeds=embeds, use_cache=True, logits_to_keep=1, **{self._cache_kw: self.cache})
        return out.logits[:, -1].float()

    def reset(self):
        self.cache = self._cache_cls()

    def rewind(self, length: int):
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)  # a negative crop drops that many positions (5.2x refuses positive ones)
