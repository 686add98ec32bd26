"""Model configuration: one frozen dataclass per tower, named presets, and conversion from HF's config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runner.audio import N_FRAMES, N_MELS, TOKENS_PER_CHUNK
from runner.errors import ExportError

PROJECTOR_GROUP = 4  # the projector concatenates 4 consecutive encoder frames (1500 frames -> 375 tokens)


@dataclass(frozen=True)
class AudioConfig:
    n_mels: int = N_MELS
    dim: int = 1280
    n_layers: int = 32
    n_heads: int = 20
    ffn_dim: int = 5120
    max_source_positions: int = N_FRAMES // 2  # conv2 has stride 2: 3000 mel frames -> 1500 positions


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 131072
    dim: int = 3072
    ffn_dim: int = 8192
    n_layers: int = 30
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1e8
    norm_eps: float = 1e-5


@dataclass(frozen=True)
class VoxtralConfig:
    audio: AudioConfig = field(default_factory=AudioConfig)
    text: TextConfig = field(default_factory=TextConfig)
    audio_token_id: int = 24
    initializer_range: float = 0.02

    def __post_init__(self):
        a, t = self.audio, self.text
        # Every check here is a shape the runtime relies on; fail at config time, not inside a compile.
        if a.ffn_dim != PROJECTOR_GROUP * a.dim:
            raise ExportError(f"audio ffn_dim ({a.ffn_dim}) must be {PROJECTOR_GROUP} x audio dim ({a.dim})")
        if a.max_source_positions * 2 != N_FRAMES:
            raise ExportError(f"audio max_source_positions must be {N_FRAMES // 2} (30 s chunks)")
        if a.dim % a.n_heads or t.n_heads % t.n_kv_heads:
            raise ExportError("head counts must divide the model width / query heads")
        assert a.max_source_positions // PROJECTOR_GROUP == TOKENS_PER_CHUNK

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> VoxtralConfig:
        return cls(
            audio=AudioConfig(**d["audio"]),
            text=TextConfig(**d["text"]),
            audio_token_id=d["audio_token_id"],
            initializer_range=d.get("initializer_range", 0.02),
        )

    @classmethod
    def from_hf(cls, hf: dict) -> VoxtralConfig:
        """From what `VoxtralConfig.save_pretrained` writes (transformers 4.5x and 5.x key spellings)."""
        try:
            a, t = hf.get("audio_config") or {}, hf.get("text_config") or {}
            if a.get("activation_function", "gelu") != "gelu" or hf.get("projector_hidden_act", "gelu") != "gelu":
                raise ExportError("only GELU activations are supported in the audio tower and projector")
            if t.get("hidden_act", "silu") != "silu" or t.get("attention_bias") or t.get("mlp_bias"):
                raise ExportError("text model must be Llama-style (SiLU, no biases)")
            if t.get("tie_word_embeddings"):
                raise ExportError("tied word embeddings are not supported (Voxtral's lm_head is untied)")
            rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
            if rope.get("rope_type", "default") not in ("default", None):
                raise ExportError(f"rope type {rope.get('rope_type')!r} is not supported")
            theta = rope.get("rope_theta", t.get("rope_theta", TextConfig.rope_theta))
            hidden = t.get("hidden_size", TextConfig.dim)
            heads = t.get("num_attention_heads", TextConfig.n_heads)
            audio = AudioConfig(
                n_mels=a.get("num_mel_bins", N_MELS),
                dim=a.get("hidden_size", a.get("d_model", AudioConfig.dim)),
                n_layers=a.get("num_hidden_layers", a.get("encoder_layers", AudioConfig.n_layers)),
                n_heads=a.get("num_attention_heads", a.get("encoder_attention_heads", AudioConfig.n_heads)),
                ffn_dim=a.get("intermediate_size", a.get("encoder_ffn_dim", AudioConfig.ffn_dim)),
                max_source_positions=a.get("max_source_positions", AudioConfig.max_source_positions),
            )
            text = TextConfig(
                vocab_size=t.get("vocab_size", TextConfig.vocab_size),
                dim=hidden,
                ffn_dim=t.get("intermediate_size", TextConfig.ffn_dim),
                n_layers=t.get("num_hidden_layers", TextConfig.n_layers),
                n_heads=heads,
                n_kv_heads=t.get("num_key_value_heads") or heads,
                head_dim=t.get("head_dim") or hidden // heads,
                rope_theta=float(theta),
                norm_eps=t.get("rms_norm_eps", TextConfig.norm_eps),
            )
            return cls(audio=audio, text=text, audio_token_id=hf.get("audio_token_id") or 24)
        except (TypeError, ValueError, AttributeError) as e:
            raise ExportError(f"config.json: unsupported Voxtral config ({e})") from None

    @classmethod
    def from_hf_file(cls, path: Path) -> VoxtralConfig:
        try:
            return cls.from_hf(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ExportError(f"{path}: cannot read config ({e})") from None


# mistralai/Voxtral-Small-24B-2507: the audio tower and projector of Voxtral-Mini-3B (Whisper-large-v3-style
# encoder, 1280 wide, 32 layers, 20 heads, ffn 5120, 128 mel bins, 1500 positions; 4-frame projector), a
# Mistral-Small-24B text model. The numbers are the hub's config.json (transformers 4.54.0.dev0 wrote it), read in
# its verbatim copy https://huggingface.co/Abc7347/this/blob/main/config.json ("Duplicate from
# mistralai/Voxtral-Small-24B-2507"): text_config hidden_size 5120, intermediate_size 32768, num_hidden_layers 40,
# num_attention_heads 32, num_key_value_heads 8, head_dim 128, vocab_size 131072, rope_theta 100000000.0,
# rms_norm_eps 1e-05, no biases, SiLU, rope_scaling null; audio_config as the 3B's. Consistent with: the
# Voxtral paper (arXiv 2507.13264) "Voxtral Small (~24.3B)", this preset counts 24.26 B; the BF16 GGUF
# of it (huggingface.co/handy-computer/Voxtral-Small-24B-2507-gguf) is 48.54 GB and describes "a Mistral-Small-24B
# causal LM (40 layers, GQA 32/8 ...)" behind the 3B's encoder and projector; Mistral-Small-3.2-24B-Instruct-2506's
# config.json has the same text dims and rope_theta. Not Mistral-Small-3.1's rope_theta: 3.1's config says 1e9.
VOXTRAL_SMALL_24B_TEXT = TextConfig(
    vocab_size=131072,
    dim=5120,
    ffn_dim=32768,
    n_layers=40,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,  # explicit: 32 heads x 128 = 4096, not hidden_size / heads
    rope_theta=1e8,
    norm_eps=1e-5,
)

# The tiny preset keeps the real audio geometry (128 mel bins, 30 s, 3000 frames, 1500 positions, 375
# tokens per chunk) so the runtime sees real shapes, with widths small enough to compile on 2 CPU cores.
PRESETS: dict[str, VoxtralConfig] = {
    "tiny": VoxtralConfig(
        audio=AudioConfig(dim=64, n_layers=2, n_heads=2, ffn_dim=256),
        text=TextConfig(vocab_size=1024, dim=64, ffn_dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16),
    ),
    "voxtral-mini-3b": VoxtralConfig(),
    "voxtral-small-24b": VoxtralConfig(text=VOXTRAL_SMALL_24B_TEXT),
}


def preset(name: str) -> VoxtralConfig:
    if name not in PRESETS:
        raise ExportError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
