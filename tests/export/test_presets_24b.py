"""The voxtral-small-24b preset: the published dimensions of mistralai/Voxtral-Small-24B-2507 (cited in
runner/models/voxtral_config.py), ~24.3 B parameters, counted on the meta device (nothing allocated), and a
random init that materialises the weights once, in the export's dtype."""

from __future__ import annotations

import pytest
import torch

from runner.export.checkpoint import random_model
from runner.export.registry import preset_names
from runner.models.voxtral import Voxtral
from runner.models.voxtral_config import PRESETS, AudioConfig, TextConfig, VoxtralConfig

NAME = "voxtral-small-24b"
# The hub's config.json text_config (see voxtral_config.py for where it was read), in transformers' spelling.
HUB_TEXT_CONFIG = {
    "vocab_size": 131072,
    "hidden_size": 5120,
    "intermediate_size": 32768,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 100000000.0,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}
PAPER_PARAMS = 24.3e9  # the Voxtral paper (arXiv 2507.13264): "Voxtral Small (~24.3B)"


def _param_count(config: VoxtralConfig) -> int:
    """As transformers counts them: in its layout (ours has the encoder's zero key bias rows besides)."""
    with torch.device("meta"):
        m = Voxtral(config)
        return sum(p.numel() for p in m.to_hf_layout(dict(m.named_parameters())).values())


def test_the_preset_is_offered_to_export():
    assert NAME in preset_names()


def test_text_dims_are_the_published_ones():
    t = PRESETS[NAME].text
    assert t == TextConfig(
        vocab_size=131072,
        dim=5120,
        ffn_dim=32768,
        n_layers=40,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        rope_theta=1e8,
        norm_eps=1e-5,
    )


def test_audio_tower_is_the_mini_3b_one():
    assert PRESETS[NAME].audio == PRESETS["voxtral-mini-3b"].audio == AudioConfig()
    assert PRESETS[NAME].audio_token_id == 24


def _text_params(t: TextConfig) -> int:
    """By hand: token embeddings + untied lm_head, final norm, and per layer q/k/v/o, gate/up/down, two norms."""
    layer = t.dim * t.head_dim * (2 * t.n_heads + 2 * t.n_kv_heads) + 3 * t.dim * t.ffn_dim + 2 * t.dim
    return 2 * t.vocab_size * t.dim + t.dim + t.n_layers * layer


def test_parameter_count_is_about_24b_on_the_meta_device():
    small, mini = PRESETS[NAME], PRESETS["voxtral-mini-3b"]
    n = _param_count(small)
    assert abs(n - PAPER_PARAMS) < 0.1e9, n
    # the 3B's audio tower; the projector (5120 -> text dim -> text dim) grows with the text width
    audio_and_projector_3b = _param_count(mini) - _text_params(mini.text)
    grouped, d3, d24 = 4 * small.audio.dim, mini.text.dim, small.text.dim
    projector_growth = grouped * (d24 - d3) + d24 * d24 - d3 * d3
    assert n == _text_params(small.text) + audio_and_projector_3b + projector_growth
    assert n * 2 / 1e9 == pytest.approx(48.5, abs=0.1)  # bf16 bytes: the BF16 GGUF of it is 48.54 GB


def test_transformers_config_with_the_hub_numbers_is_the_preset():
    from transformers import VoxtralConfig as HFVoxtralConfig
    from transformers import VoxtralForConditionalGeneration

    hf = HFVoxtralConfig(text_config=dict(HUB_TEXT_CONFIG), audio_token_id=24)
    assert VoxtralConfig.from_hf(hf.to_dict()) == PRESETS[NAME]
    with torch.device("meta"):
        hf_params = sum(p.numel() for p in VoxtralForConditionalGeneration(hf).parameters())
    assert hf_params == _param_count(PRESETS[NAME])


def test_random_init_materialises_the_weights_once_in_the_target_dtype(monkeypatch):
    """The 24B model in bf16 is 48.5 GB: it must not be allocated in fp32 first (97 GB) and cast."""
    seen = []
    original = torch.nn.Module.to_empty

    def to_empty(self, *, device, recurse=True):
        seen.append({p.dtype for p in self.parameters()})
        return original(self, device=device, recurse=recurse)

    monkeypatch.setattr(torch.nn.Module, "to_empty", to_empty)
    model, _ = random_model("tiny", 0, torch.bfloat16, "cpu")
    assert seen == [{torch.bfloat16}]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_random_init_in_bf16_is_the_fp32_init_rounded():
    """Same numbers as an fp32 init cast to bf16: the regenerated weights of older bundles still match."""
    bf16, _ = random_model("tiny", 3, torch.bfloat16, "cpu")
    fp32, _ = random_model("tiny", 3, torch.float32, "cpu")
    for (name, a), (_, b) in zip(bf16.named_parameters(), fp32.named_parameters()):
        assert torch.equal(a, b.to(torch.bfloat16)), name
