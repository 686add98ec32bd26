"""Model configuration: one frozen dataclass per tower, named presets, and conversion from HF's config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from runner.audio import N_FRAMES, N_MELS, TOKENS_PER_CHUNK
from runner.errors import ExportError
from runner.json_file import read_json_object
from runner.models.config_fields import check_tower, divides, read_heads, read_real, read_whole, real, section, whole

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
        check_tower(a, "audio ")
        check_tower(t, "text ")
        whole(self.audio_token_id, "audio_token_id", "audio_token_id")
        # Every check here is a shape the runtime relies on; fail at config time, not inside a compile.
        if a.ffn_dim != PROJECTOR_GROUP * a.dim:
            raise ExportError(f"audio ffn_dim ({a.ffn_dim}) must be {PROJECTOR_GROUP} x audio dim ({a.dim})")
        if a.max_source_positions * 2 != N_FRAMES:
            raise ExportError(f"audio max_source_positions must be {N_FRAMES // 2} (30 s chunks)")
        if a.dim % a.n_heads or t.n_heads % t.n_kv_heads:
            raise ExportError("head counts must divide the model width / query heads")
        if t.head_dim % 2:
            raise ExportError(f"text head_dim ({t.head_dim}) must be even (rotary embeddings pair its dims)")
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
        """From what `VoxtralConfig.save_pretrained` writes (transformers 4.5x and 5.x key spellings). Every field
        the model is built from is checked first; an error names it as the file spells it."""
        if not isinstance(hf, dict):
            raise ExportError("not a JSON object")
        a, t = section(hf, "audio_config"), section(hf, "text_config")
        if a.get("activation_function", "gelu") != "gelu" or hf.get("projector_hidden_act", "gelu") != "gelu":
            raise ExportError("only GELU activations are supported in the audio tower and projector")
        if t.get("hidden_act", "silu") != "silu" or t.get("attention_bias") or t.get("mlp_bias"):
            raise ExportError("text model must be Llama-style (SiLU, no biases)")
        if t.get("tie_word_embeddings"):
            raise ExportError("tied word embeddings are not supported (Voxtral's lm_head is untied)")
        text = _text_from_hf(t)
        token = read_whole(hf, "", ("audio_token_id",), "audio_token_id", 24)
        if token >= text.vocab_size:
            raise ExportError(f"audio_token_id: {token} is not below text_config.vocab_size ({text.vocab_size})")
        return cls(audio=_audio_from_hf(a), text=text, audio_token_id=token)

    @classmethod
    def from_hf_file(cls, path: Path) -> VoxtralConfig:
        """config.json, read and checked: any error names the file."""
        doc = read_json_object(path, ExportError)
        try:
            return cls.from_hf(doc)
        except ExportError as e:
            raise ExportError(f"{path}: {e}") from None


def _audio_from_hf(a: dict) -> AudioConfig:
    w = "audio_config."
    dim = read_whole(a, w, ("hidden_size", "d_model"), "dim", AudioConfig.dim)
    heads = read_whole(a, w, ("num_attention_heads", "encoder_attention_heads"), "n_heads", AudioConfig.n_heads)
    divides(dim, w + "hidden_size", heads, w + "num_attention_heads")
    ffn = read_whole(a, w, ("intermediate_size", "encoder_ffn_dim"), "ffn_dim", AudioConfig.ffn_dim)
    if ffn != PROJECTOR_GROUP * dim:
        raise ExportError(
            f"{w}intermediate_size ({ffn}) must be {PROJECTOR_GROUP} x {w}hidden_size ({dim}): the projector's ffn_dim"
        )
    positions = read_whole(a, w, ("max_source_positions",), "max_source_positions", AudioConfig.max_source_positions)
    if positions * 2 != N_FRAMES:
        raise ExportError(f"{w}max_source_positions: {positions} is not {N_FRAMES // 2} (30 s chunks)")
    return AudioConfig(
        n_mels=read_whole(a, w, ("num_mel_bins",), "n_mels", N_MELS),
        dim=dim,
        n_layers=read_whole(a, w, ("num_hidden_layers", "encoder_layers"), "n_layers", AudioConfig.n_layers),
        n_heads=heads,
        ffn_dim=ffn,
        max_source_positions=positions,
    )


def _text_from_hf(t: dict) -> TextConfig:
    w = "text_config."
    rope_key = "rope_parameters" if t.get("rope_parameters") else "rope_scaling"
    rope = section(t, rope_key, w)
    if rope.get("rope_type", "default") not in ("default", None):
        raise ExportError(f"rope type {rope.get('rope_type')!r} is not supported")
    if rope.get("rope_theta") is not None:
        theta = real(rope["rope_theta"], f"{w}{rope_key}.rope_theta")
    else:
        theta = read_real(t, w, "rope_theta", TextConfig.rope_theta)
    hidden = read_whole(t, w, ("hidden_size",), "dim", TextConfig.dim)
    heads, kv_heads, head_dim = read_heads(t, w, hidden, TextConfig.n_heads)
    return TextConfig(
        vocab_size=read_whole(t, w, ("vocab_size",), "vocab_size", TextConfig.vocab_size),
        dim=hidden,
        ffn_dim=read_whole(t, w, ("intermediate_size",), "ffn_dim", TextConfig.ffn_dim),
        n_layers=read_whole(t, w, ("num_hidden_layers",), "n_layers", TextConfig.n_layers),
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        norm_eps=read_real(t, w, "rms_norm_eps", TextConfig.norm_eps),
    )


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
