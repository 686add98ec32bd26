"""Voxtral Realtime's configuration: frozen dataclasses, named presets, and conversion from/to transformers'
`VoxtralRealtimeConfig` (config.json)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from runner.audio import HOP_LENGTH, N_MELS, SAMPLE_RATE
from runner.errors import ExportError
from runner.json_file import read_json_object
from runner.models.config_fields import check_tower, read_heads, read_real, read_whole, real, section, whole

ADA_DIM = 32  # AdaRMSNorm's bottleneck: fixed in transformers' VoxtralRealtimeTextAdaRmsNorm
CONV_STRIDE = 2  # conv2 halves the mel frame rate: 8 mel frames -> 4 encoder frames -> 1 text position


@dataclass(frozen=True)
class RealtimeAudioConfig:
    n_mels: int = N_MELS
    dim: int = 1280
    n_layers: int = 32
    n_heads: int = 32
    head_dim: int = 64
    ffn_dim: int = 5120
    rope_theta: float = 1e6
    norm_eps: float = 1e-5
    sliding_window: int = 750  # encoder frames (50 per second): 15 s


@dataclass(frozen=True)
class RealtimeTextConfig:
    vocab_size: int = 131072
    dim: int = 3072
    ffn_dim: int = 9216
    n_layers: int = 26
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1e6
    norm_eps: float = 1e-5
    sliding_window: int = 8192  # text positions (12.5 per second): ~11 min


@dataclass(frozen=True)
class RealtimeConfig:
    audio: RealtimeAudioConfig = field(default_factory=RealtimeAudioConfig)
    text: RealtimeTextConfig = field(default_factory=RealtimeTextConfig)
    downsample_factor: int = 4  # encoder frames concatenated into one projector input
    num_delay_tokens: int = 6  # transformers' default_num_delay_tokens (480 ms)
    initializer_range: float = 0.02

    def __post_init__(self):
        a, t = self.audio, self.text
        check_tower(a, "audio ")
        check_tower(t, "text ")
        whole(self.downsample_factor, "downsample_factor", "downsample_factor")
        whole(self.num_delay_tokens, "num_delay_tokens", "num_delay_tokens")
        if t.n_heads % t.n_kv_heads:
            raise ExportError("text query heads must be a multiple of its KV heads")
        if a.head_dim % 2 or t.head_dim % 2 or t.dim % 2:
            raise ExportError("head dims and the text width must be even (RoPE, time embedding)")

    @property
    def mel_frames_per_token(self) -> int:
        return CONV_STRIDE * self.downsample_factor  # 8: one text position per 80 ms

    @property
    def samples_per_token(self) -> int:
        return self.mel_frames_per_token * HOP_LENGTH  # 1280 samples at 16 kHz

    @property
    def seconds_per_token(self) -> float:
        return self.samples_per_token / SAMPLE_RATE

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RealtimeConfig:
        return cls(
            audio=RealtimeAudioConfig(**d["audio"]),
            text=RealtimeTextConfig(**d["text"]),
            downsample_factor=d["downsample_factor"],
            num_delay_tokens=d["num_delay_tokens"],
            initializer_range=d.get("initializer_range", 0.02),
        )

    def to_hf(self) -> dict:
        """transformers' VoxtralRealtimeConfig kwargs for the same model (the test-time reference)."""
        a, t = self.audio, self.text
        return dict(
            audio_config=dict(
                hidden_size=a.dim,
                intermediate_size=a.ffn_dim,
                num_hidden_layers=a.n_layers,
                num_attention_heads=a.n_heads,
                head_dim=a.head_dim,
                num_mel_bins=a.n_mels,
                rms_norm_eps=a.norm_eps,
                sliding_window=a.sliding_window,
                rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta},
                initializer_range=self.initializer_range,
            ),
            text_config=dict(
                vocab_size=t.vocab_size,
                hidden_size=t.dim,
                intermediate_size=t.ffn_dim,
                num_hidden_layers=t.n_layers,
                num_attention_heads=t.n_heads,
                num_key_value_heads=t.n_kv_heads,
                head_dim=t.head_dim,
                rms_norm_eps=t.norm_eps,
                sliding_window=t.sliding_window,
                rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta},
                tie_word_embeddings=True,
                initializer_range=self.initializer_range,
            ),
            downsample_factor=self.downsample_factor,
            audio_length_per_tok=self.mel_frames_per_token,
            default_num_delay_tokens=self.num_delay_tokens,
        )

    @classmethod
    def from_hf(cls, hf: dict) -> RealtimeConfig:
        """From what `VoxtralRealtimeConfig.save_pretrained` writes. Every field the model is built from is checked
        first; an error names it as the file spells it."""
        if not isinstance(hf, dict):
            raise ExportError("not a JSON object")
        a, t = section(hf, "audio_config"), section(hf, "text_config")
        if a.get("activation_function", "gelu") != "gelu" or hf.get("projector_hidden_act", "gelu") != "gelu":
            raise ExportError("only GELU activations are supported in the audio encoder and projector")
        if a.get("hidden_act", "silu") != "silu" or t.get("hidden_act", "silu") != "silu":
            raise ExportError("only SiLU-gated MLPs are supported")
        if not hf.get("tie_word_embeddings", True):
            raise ExportError("Voxtral Realtime ties its output projection to the embeddings; this config does not")
        factor = read_whole(hf, "", ("downsample_factor",), "downsample_factor", 4)
        if hf.get("audio_length_per_tok", CONV_STRIDE * factor) != CONV_STRIDE * factor:
            raise ExportError(f"audio_length_per_tok must be {CONV_STRIDE} x downsample_factor ({factor})")
        delay = read_whole(hf, "", ("default_num_delay_tokens",), "num_delay_tokens", 6)
        init = read_real(t, "text_config.", "initializer_range", 0.02)
        return cls(_audio_from_hf(a), _text_from_hf(t), factor, delay, init)

    @classmethod
    def from_hf_file(cls, path: Path) -> RealtimeConfig:
        """config.json, read and checked: any error names the file."""
        doc = read_json_object(path, ExportError)
        try:
            return cls.from_hf(doc)
        except ExportError as e:
            raise ExportError(f"{path}: {e}") from None


def _audio_from_hf(a: dict) -> RealtimeAudioConfig:
    w, d = "audio_config.", RealtimeAudioConfig
    head_dim = read_whole(a, w, ("head_dim",), "head_dim", d.head_dim)
    if head_dim % 2:
        raise ExportError(f"{w}head_dim: {head_dim} is odd (rotary embeddings pair its dims)")
    return RealtimeAudioConfig(
        n_mels=read_whole(a, w, ("num_mel_bins",), "n_mels", N_MELS),
        dim=read_whole(a, w, ("hidden_size",), "dim", d.dim),
        n_layers=read_whole(a, w, ("num_hidden_layers",), "n_layers", d.n_layers),
        n_heads=read_whole(a, w, ("num_attention_heads",), "n_heads", d.n_heads),
        head_dim=head_dim,
        ffn_dim=read_whole(a, w, ("intermediate_size",), "ffn_dim", d.ffn_dim),
        rope_theta=_rope_theta(a, w, "audio", 10000.0),
        norm_eps=read_real(a, w, "rms_norm_eps", d.norm_eps),
        sliding_window=read_whole(a, w, ("sliding_window",), "sliding_window", d.sliding_window),
    )


def _text_from_hf(t: dict) -> RealtimeTextConfig:
    w, d = "text_config.", RealtimeTextConfig
    dim = read_whole(t, w, ("hidden_size",), "dim", d.dim)
    if dim % 2:
        raise ExportError(f"{w}hidden_size: {dim} is odd (the delay's time embedding pairs its dims)")
    heads, kv_heads, head_dim = read_heads(t, w, dim, d.n_heads)
    return RealtimeTextConfig(
        vocab_size=read_whole(t, w, ("vocab_size",), "vocab_size", d.vocab_size),
        dim=dim,
        ffn_dim=read_whole(t, w, ("intermediate_size",), "ffn_dim", d.ffn_dim),
        n_layers=read_whole(t, w, ("num_hidden_layers",), "n_layers", d.n_layers),
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=_rope_theta(t, w, "text", d.rope_theta),
        norm_eps=read_real(t, w, "rms_norm_eps", d.norm_eps),
        sliding_window=read_whole(t, w, ("sliding_window",), "sliding_window", d.sliding_window),
    )


def _rope_theta(c: dict, where: str, tower: str, default: float) -> float:
    """The tower's rotary base: from its rope parameters (transformers 5; `default` where they leave it out), else
    beside them (4.x; 10000 where it is not there either)."""
    key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
    rope = section(c, key, where)
    if rope.get("rope_type", "default") != "default":
        raise ExportError(f"{tower} rope type {rope.get('rope_type')!r} is not supported")
    if rope.get("rope_theta") is not None:
        return real(rope["rope_theta"], f"{where}{key}.rope_theta")
    return default if rope else read_real(c, where, "rope_theta", 10000.0)


# tiny-realtime: the real audio front end (128 mel bins, 8 mel frames per position) and the real delay, with
# widths small enough to compile in seconds on 2 CPU cores, and windows short enough that the tests wrap both
# ring buffers (encoder 24 frames = 6 positions, decoder 16 positions). Its seeded weights are drawn wider than
# the real init (0.25, not 0.02): at 0.02 the tiny model repeats one token whatever it hears, a weak golden test.
PRESETS: dict[str, RealtimeConfig] = {
    "tiny-realtime": RealtimeConfig(
        audio=RealtimeAudioConfig(dim=32, n_layers=2, n_heads=2, head_dim=16, ffn_dim=64, sliding_window=24),
        text=RealtimeTextConfig(
            vocab_size=1024, dim=32, ffn_dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, sliding_window=16
        ),
        initializer_range=0.25,
    ),
    "voxtral-mini-4b-realtime": RealtimeConfig(),
}


def preset(name: str) -> RealtimeConfig:
    if name not in PRESETS:
        raise ExportError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
