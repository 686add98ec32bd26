"""Mistral's own checkpoint format (`params.json` + `consolidated.safetensors`, published beside the HF files in
mistralai/Voxtral-Mini-3B-2507) read into the HF layout our model loads.

The names, the rotary permutation and the config fields follow transformers'
`models/voxtral/convert_voxtral_weights_to_hf.py` (and vLLM's Mistral-format Voxtral loader): Mistral stores
each head's query/key rows with the rotary pairs interleaved (Meta's layout), HF with the two halves apart; the
audio encoder's sinusoidal positions are not stored at all.
"""

from __future__ import annotations

import math
import re

import torch

from runner.errors import ExportError
from runner.models.config_fields import divides, real, section, whole
from runner.models.voxtral_config import PROJECTOR_GROUP, VoxtralConfig

PARAMS = "params.json"
WEIGHTS_GLOB = "consolidated*.safetensors"

_ENC = "mm_whisper_embeddings.whisper_encoder."
_LAYER = "language_model.model.layers.{i}."
_AUDIO_LAYER = "audio_tower.layers.{i}."
# (Mistral name, HF name); {i} is a layer index, {wb} weight or bias. The first Mistral spelling of an HF key is
# the one an error names when the key is missing.
_KEYS = (
    ("output.weight", "language_model.lm_head.weight"),
    ("norm.weight", "language_model.model.norm.weight"),
    ("mm_whisper_embeddings.tok_embeddings.weight", "language_model.model.embed_tokens.weight"),
    ("tok_embeddings.weight", "language_model.model.embed_tokens.weight"),
    ("layers.{i}.attention_norm.weight", _LAYER + "input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", _LAYER + "post_attention_layernorm.weight"),
    ("layers.{i}.attention.wq.weight", _LAYER + "self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", _LAYER + "self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", _LAYER + "self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", _LAYER + "self_attn.o_proj.weight"),
    ("layers.{i}.feed_forward.w1.weight", _LAYER + "mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", _LAYER + "mlp.down_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", _LAYER + "mlp.up_proj.weight"),
    (_ENC + "conv_layers.0.{wb}", "audio_tower.conv1.{wb}"),
    (_ENC + "conv_layers.1.{wb}", "audio_tower.conv2.{wb}"),
    (_ENC + "transformer.norm.{wb}", "audio_tower.layer_norm.{wb}"),
    (_ENC + "transformer.layers.{i}.attention.wq.{wb}", _AUDIO_LAYER + "self_attn.q_proj.{wb}"),
    (_ENC + "transformer.layers.{i}.attention.wk.{wb}", _AUDIO_LAYER + "self_attn.k_proj.{wb}"),
    (_ENC + "transformer.layers.{i}.attention.wv.{wb}", _AUDIO_LAYER + "self_attn.v_proj.{wb}"),
    (_ENC + "transformer.layers.{i}.attention.wo.{wb}", _AUDIO_LAYER + "self_attn.out_proj.{wb}"),
    (_ENC + "transformer.layers.{i}.attention_norm.{wb}", _AUDIO_LAYER + "self_attn_layer_norm.{wb}"),
    (_ENC + "transformer.layers.{i}.feed_forward.w1.{wb}", _AUDIO_LAYER + "fc1.{wb}"),
    (_ENC + "transformer.layers.{i}.feed_forward.w2.{wb}", _AUDIO_LAYER + "fc2.{wb}"),
    (_ENC + "transformer.layers.{i}.ffn_norm.{wb}", _AUDIO_LAYER + "final_layer_norm.{wb}"),
    ("mm_whisper_embeddings.audio_language_projection.0.weight", "multi_modal_projector.linear_1.weight"),
    ("mm_whisper_embeddings.audio_language_projection.2.weight", "multi_modal_projector.linear_2.weight"),
)
POSITIONS = "audio_tower.embed_positions.weight"
_ROTARY = re.compile(r"language_model\.model\.layers\.\d+\.self_attn\.([qk])_proj\.weight")


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{wb\}", r"(?P<wb>weight|bias)"))


_FORWARD = tuple((_pattern(m), h) for m, h in _KEYS)
_BACKWARD = tuple((_pattern(h), m) for m, h in _KEYS)


def _translate(key: str, table) -> str | None:
    for pattern, template in table:
        if match := pattern.fullmatch(key):
            return template.format(**match.groupdict())
    return None


def mistral_name(hf_key: str) -> str:
    """How Mistral's format names an HF key (for errors about keys the file lacks)."""
    return _translate(hf_key, _BACKWARD) or hf_key


# ---------------------------------------------------------------- params.json


def _need(d: dict, key: str, where: str, field: str | None = None):
    """d[key], present and not null; checked as our config's `field` (a whole number within its bound) if named."""
    if d.get(key) is None:
        raise ExportError(f"missing {where}{key}")
    return whole(d[key], where + key, field) if field else d[key]


def _real(d: dict, key: str) -> float:
    return real(_need(d, key, ""), key)


def config_from_params(params: dict, audio_token_id: int) -> VoxtralConfig:
    """params.json -> our config, through the HF spelling so the same checks apply (convert_config's mapping).
    Every field is checked as params.json spells it before anything is built; errors name no file (the caller's)."""
    if not isinstance(params, dict):
        raise ExportError("not a JSON object")
    for unsupported in ("moe", "yarn", "quantization", "lora", "vision_encoder"):
        if params.get(unsupported):
            raise ExportError(f"{unsupported!r} is not supported (Voxtral Mini has none)")
    if params.get("sliding_window") is not None:
        raise ExportError("sliding-window attention is not supported")
    if params.get("use_biases"):
        raise ExportError("text model must be Llama-style (no biases)")
    whisper = section(section(params, "multimodal"), "whisper_model_args", "multimodal.")
    if not whisper:
        raise ExportError("no multimodal.whisper_model_args: not an audio (Voxtral) model")
    if whisper.get("encoder_args") is None:
        raise ExportError("missing multimodal.whisper_model_args.encoder_args")
    enc = section(whisper, "encoder_args", "multimodal.whisper_model_args.")
    if enc.get("causal") or enc.get("pos_embed", "sinusoidal") != "sinusoidal":
        raise ExportError("a causal / rotary audio encoder is Voxtral Realtime, not this family")
    downsample = section(whisper, "downsample_args", "multimodal.whisper_model_args.")
    factor = downsample.get("downsample_factor", PROJECTOR_GROUP)
    if factor != PROJECTOR_GROUP:
        raise ExportError(f"downsample_factor {factor} (the projector groups {PROJECTOR_GROUP} frames)")
    heads = _need(params, "n_heads", "", "n_heads")
    divides(heads, "n_heads", _need(params, "n_kv_heads", "", "n_kv_heads"), "n_kv_heads")
    hf = {
        "audio_config": _audio_from_params(enc),
        "text_config": {
            "vocab_size": _need(params, "vocab_size", "", "vocab_size"),
            "hidden_size": _need(params, "dim", "", "dim"),
            "intermediate_size": _need(params, "hidden_dim", "", "ffn_dim"),
            "num_hidden_layers": _need(params, "n_layers", "", "n_layers"),
            "num_attention_heads": heads,
            "num_key_value_heads": params["n_kv_heads"],
            "head_dim": _need(params, "head_dim", "", "head_dim"),
            "rms_norm_eps": _real(params, "norm_eps"),
            "rope_theta": _real(params, "rope_theta"),
            "tie_word_embeddings": bool(params.get("tied_embeddings", False)),
        },
        "audio_token_id": audio_token_id,
    }
    return VoxtralConfig.from_hf(hf)


def _audio_from_params(enc: dict) -> dict:
    """multimodal.whisper_model_args.encoder_args -> HF's audio_config, each field checked as params.json spells it."""
    where = "multimodal.whisper_model_args.encoder_args."
    dim, heads = _need(enc, "dim", where, "dim"), _need(enc, "n_heads", where, "n_heads")
    divides(dim, where + "dim", heads, where + "n_heads")
    if enc.get("head_dim") not in (None, dim // heads):
        raise ExportError(f"audio head_dim {enc['head_dim']} is not dim / n_heads ({dim // heads})")
    ffn = _need(enc, "hidden_dim", where, "ffn_dim")
    if ffn != PROJECTOR_GROUP * dim:
        raise ExportError(f"{where}hidden_dim ({ffn}) must be {PROJECTOR_GROUP} x {where}dim ({dim})")
    mel = section(enc, "audio_encoding_args", where)
    positions = enc.get("max_source_positions") or 1500
    return {
        "hidden_size": dim,
        "intermediate_size": ffn,
        "num_hidden_layers": _need(enc, "n_layers", where, "n_layers"),
        "num_attention_heads": heads,
        "num_mel_bins": _need(mel, "num_mel_bins", where + "audio_encoding_args.", "n_mels"),
        "max_source_positions": whole(positions, where + "max_source_positions", "max_source_positions"),
    }


# ---------------------------------------------------------------- weights


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's fixed positions (the HF conversion stores them; Mistral's file does not)."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2))
    scaled = torch.arange(length).view(-1, 1) * inv.view(1, -1)
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


def _halves_from_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per head, rotary pairs (x0, x1), (x2, x3)… -> first halves then second halves: the convert script's
    permute_for_rope, which turns Mistral's query/key rows into HF's."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf_state(
    state: dict[str, torch.Tensor], config: VoxtralConfig
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Mistral-named tensors -> HF-named ones (q/k rows permuted for HF's rotary), plus each HF key's name in
    the file. Keys no rule names pass through unchanged, to be reported as unexpected."""
    t = config.text
    out: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    for key, value in state.items():
        hf = _translate(key, _FORWARD) or key
        if hf in out:
            raise ExportError(f"{PARAMS} checkpoint: {names[hf]} and {key} are both {hf}")
        if match := _ROTARY.fullmatch(hf):
            heads = t.n_heads if match.group(1) == "q" else t.n_kv_heads
            if value.dim() == 2 and value.shape[0] == heads * t.head_dim and t.head_dim % 2 == 0:
                value = _halves_from_pairs(value, heads)  # a wrong shape is left for the shape report
        out[hf], names[hf] = value, key
    if POSITIONS not in out:
        a = config.audio
        out[POSITIONS] = sinusoids(a.max_source_positions, a.dim)
        names[POSITIONS] = f"{POSITIONS} (computed)"
    return out, names
