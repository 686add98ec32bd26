"""Whisper in plain PyTorch, written for torch.export: the second model family of the pipeline.

The encoder *is* Voxtral's audio tower (runner/models/voxtral.py `AudioTower`, 80 mel bins here); the decoder is
Whisper's: token + learned position embeddings, pre-LN layers of causal self-attention (static KV cache, as the
Voxtral decoder's) + cross-attention over the encoder output + GELU MLP, final LayerNorm, logits tied to the
token embedding. Parameter names are transformers' `WhisperForConditionalGeneration` names without the leading
`model.` (`to_hf_layout` splits the encoder's fused q/k/v back into them), so converted weights load into either
model.

The exported split (see `WhisperMethods`):
    audio_encoder    mel [1, n_mels, 3000] -> cross_kv [layers, 2, heads, 1500, head_dim]
    token_embedding  ids [1, S] -> embeds [1, S, d]
    text_decoder     embeds [1, S, d], cache_position [S], cross_kv -> logits [1, vocab] f32
The cross-attention K/V depend only on the audio, so the encoder method computes them once per 30 s window and
the decoder takes them as an input (zero-copy through the delegate): each decode step only attends, instead of
re-projecting 1500 encoder frames in every layer (~1.8 GMAC per token for tiny).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from runner.audio import N_FRAMES
from runner.errors import ExportError
from runner.models import fused
from runner.models.mel import LogMelSpectrogram
from runner.models.methods import Methods
from runner.models.voxtral import AudioTower, KVCache
from runner.models.voxtral_config import AudioConfig


@dataclass(frozen=True)
class WhisperTextConfig:
    vocab_size: int = 51864
    dim: int = 384
    n_layers: int = 4
    n_heads: int = 6
    ffn_dim: int = 1536
    max_target_positions: int = 448

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_kv_heads(self) -> int:  # plain multi-head attention; named as the Voxtral config does
        return self.n_heads


@dataclass(frozen=True)
class WhisperConfig:
    audio: AudioConfig = field(
        default_factory=lambda: AudioConfig(n_mels=80, dim=384, n_layers=4, n_heads=6, ffn_dim=1536)
    )
    text: WhisperTextConfig = field(default_factory=WhisperTextConfig)

    def __post_init__(self):
        a, t = self.audio, self.text
        if a.dim != t.dim:
            raise ExportError(f"Whisper encoder and decoder widths differ ({a.dim} vs {t.dim})")
        if a.max_source_positions * 2 != N_FRAMES:
            raise ExportError(f"encoder positions must be {N_FRAMES // 2} (30 s windows)")
        if a.dim % a.n_heads or t.dim % t.n_heads:
            raise ExportError("head counts must divide the model width")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["text"].update(head_dim=self.text.head_dim, n_kv_heads=self.text.n_kv_heads)  # for `inspect`
        return d

    @classmethod
    def from_dict(cls, d: dict) -> WhisperConfig:
        text = {k: v for k, v in d["text"].items() if k not in ("head_dim", "n_kv_heads")}
        return cls(audio=AudioConfig(**d["audio"]), text=WhisperTextConfig(**text))

    def to_hf(self) -> dict:
        """transformers' WhisperConfig kwargs for the same shapes (the test-time reference)."""
        a, t = self.audio, self.text
        return dict(
            vocab_size=t.vocab_size,
            num_mel_bins=a.n_mels,
            d_model=t.dim,
            encoder_layers=a.n_layers,
            encoder_attention_heads=a.n_heads,
            encoder_ffn_dim=a.ffn_dim,
            decoder_layers=t.n_layers,
            decoder_attention_heads=t.n_heads,
            decoder_ffn_dim=t.ffn_dim,
            max_source_positions=a.max_source_positions,
            max_target_positions=t.max_target_positions,
        )


# ---------------------------------------------------------------- decoder


def _heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    b, s, d = x.shape
    return x.view(b, s, n_heads, d // n_heads).transpose(1, 2)  # [b, H, S, D]


class SelfAttention(nn.Module):
    def __init__(self, c: WhisperTextConfig):
        super().__init__()
        self.n_heads = c.n_heads
        self.q_proj = nn.Linear(c.dim, c.dim)
        self.k_proj = nn.Linear(c.dim, c.dim, bias=False)  # Whisper's key projections have no bias
        self.v_proj = nn.Linear(c.dim, c.dim)
        self.out_proj = nn.Linear(c.dim, c.dim)
        self.kv_cache: KVCache | None = None

    def forward(
        self, x: torch.Tensor, input_pos: torch.Tensor | None, mask: torch.Tensor
    ) -> torch.Tensor:  # x: [1, S, d], mask: [S, max_seq]; input_pos None: the whole sequence, no cache
        b, s, d = x.shape
        q, k, v = (_heads(p(x), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        if input_pos is not None:
            k, v = self.kv_cache.update(input_pos, k, v)  # [1, H, max_seq, D], written in place
        # Written out rather than SDPA with a mask, as the Voxtral decoder (torch 2.11's CUDA export guard).
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * (d // self.n_heads) ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        y = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)  # [1, H, S, D]
        return self.out_proj(y.transpose(1, 2).reshape(b, s, d))


class CrossAttention(nn.Module):
    def __init__(self, c: WhisperTextConfig):
        super().__init__()
        self.n_heads = c.n_heads
        self.q_proj = nn.Linear(c.dim, c.dim)
        self.k_proj = nn.Linear(c.dim, c.dim, bias=False)
        self.v_proj = nn.Linear(c.dim, c.dim)
        self.out_proj = nn.Linear(c.dim, c.dim)

    def scores(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Each query's scaled dot products with the window's keys [1, H, S, 1500] float32 (before the softmax:
        what openai-whisper's word timing reads from its alignment heads)."""
        d = x.shape[-1]  # kv: [2, H, 1500, D]
        q = _heads(self.q_proj(x), self.n_heads)
        return torch.matmul(q, kv[0:1].transpose(-1, -2)).float() * (d // self.n_heads) ** -0.5

    def attend(self, x: torch.Tensor, kv: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        # Written out, softmax in float32, as the self-attention: SDPA with a dynamic query length is the kind
        # of CUDA path torch 2.11 could not export for the Voxtral decoder. Every position sees the whole window.
        y = torch.matmul(torch.softmax(scores, dim=-1).to(kv.dtype), kv[1:2])  # [1, H, S, D]
        return self.out_proj(y.transpose(1, 2).reshape(b, s, d))

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return self.attend(x, kv, self.scores(x, kv))


class DecoderLayer(nn.Module):
    def __init__(self, c: WhisperTextConfig):
        super().__init__()
        self.self_attn = SelfAttention(c)
        self.self_attn_layer_norm = nn.LayerNorm(c.dim)
        self.encoder_attn = CrossAttention(c)
        self.encoder_attn_layer_norm = nn.LayerNorm(c.dim)
        self.fc1 = nn.Linear(c.dim, c.ffn_dim)
        self.fc2 = nn.Linear(c.ffn_dim, c.dim)
        self.final_layer_norm = nn.LayerNorm(c.dim)

    def forward(self, x, input_pos, mask, kv):
        return self.forward_with_scores(x, input_pos, mask, kv)[0]

    def forward_with_scores(self, x, input_pos, mask, kv) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and its cross-attention scores [1, H, S, 1500] (before the softmax)."""
        x = x + self.self_attn(self.self_attn_layer_norm(x), input_pos, mask)
        h = self.encoder_attn_layer_norm(x)
        scores = self.encoder_attn.scores(h, kv)
        x = x + self.encoder_attn.attend(h, kv, scores)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x)))), scores


class Decoder(nn.Module):
    def __init__(self, c: WhisperTextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.dim)
        self.embed_positions = nn.Embedding(c.max_target_positions, c.dim)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.n_layers))
        self.layer_norm = nn.LayerNorm(c.dim)


class Whisper(nn.Module):
    def __init__(self, config: WhisperConfig):
        super().__init__()
        self.config = config
        self.encoder = AudioTower(config.audio)
        self.decoder = Decoder(config.text)
        self.alignment_heads = default_alignment_heads(config.text)

    def setup_caches(self, max_seq_len: int, dtype: torch.dtype | None = None) -> None:
        t = self.config.text
        if max_seq_len > t.max_target_positions:
            raise ExportError(f"Whisper's decoder has {t.max_target_positions} positions, not {max_seq_len}")
        w = self.decoder.embed_tokens.weight
        for layer in self.decoder.layers:
            layer.self_attn.kv_cache = KVCache(max_seq_len, t.n_heads, t.head_dim, dtype or w.dtype).to(w.device)

    def reset_caches(self) -> None:
        for layer in self.decoder.layers:
            layer.self_attn.kv_cache.k_cache.zero_()
            layer.self_attn.kv_cache.v_cache.zero_()

    def init_weights(self, seed: int) -> Whisper:
        """Deterministic random init, for tests that must not need the model package (models/fused.py)."""
        fused.init_random(self, seed, 0.05)
        return self

    def _sizes(self, key: str, module: str) -> list[int]:
        return [self.config.audio.dim] * 3  # the encoder's fused q/k/v (Voxtral's audio tower); the decoder has none

    def to_hf_layout(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict of ours (or already HF-layout) -> transformers' names (the encoder's q/k/v split)."""
        return fused.to_hf(state, self._sizes)

    def from_hf_layout(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return fused.from_hf(state, self.state_dict().keys(), self._sizes)


# ---------------------------------------------------------------- the exported methods as modules


class EncoderMethod(nn.Module):
    """mel [1, n_mels, 3000] -> cross-attention K/V of every decoder layer [L, 2, H, 1500, D].

    Holds only the K/V projections of the decoder's cross-attention (q/out stay with the decoder), so each
    method's weight file carries exactly the tensors its library uses."""

    def __init__(self, m: Whisper):
        super().__init__()
        self.n_heads = m.config.text.n_heads
        self.encoder = m.encoder
        self.cross_k = nn.ModuleList(layer.encoder_attn.k_proj for layer in m.decoder.layers)
        self.cross_v = nn.ModuleList(layer.encoder_attn.v_proj for layer in m.decoder.layers)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        h = self.encoder(mel)  # [1, 1500, d]
        kv = [
            torch.stack([_heads(k(h), self.n_heads)[0], _heads(v(h), self.n_heads)[0]])
            for k, v in zip(self.cross_k, self.cross_v)
        ]
        return torch.stack(kv)  # [L, 2, H, 1500, D]


class TokenEmbeddingMethod(nn.Module):
    def __init__(self, m: Whisper):
        super().__init__()
        self.embed_tokens = m.decoder.embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)


def _bind_decoder(method: nn.Module, m: Whisper) -> None:
    """The decoder's parts as the method module's own children, under the FQNs the bundle's text_decoder weights
    file names (one file serves every method over the decoder)."""
    d = m.decoder
    method.embed_tokens, method.embed_positions, method.layers, method.layer_norm = (
        d.embed_tokens,
        d.embed_positions,
        d.layers,
        d.layer_norm,
    )


class DecoderMethod(nn.Module):
    """embeds [1, S, d] + cache_position [S] + cross_kv -> logits of the last position [1, vocab] float32 (with
    `every_position`, the eager reference scoring a whole answer in one call: of each position, [S, vocab])."""

    def __init__(self, m: Whisper):
        super().__init__()
        _bind_decoder(self, m)

    def forward(
        self, embeds: torch.Tensor, cache_position: torch.Tensor, cross_kv: torch.Tensor, every_position: bool = False
    ) -> torch.Tensor:
        max_seq = self.layers[0].self_attn.kv_cache.k_cache.shape[2]
        mask = torch.arange(max_seq, device=embeds.device)[None, :] <= cache_position[:, None]  # [S, max_seq]
        x = embeds + self.embed_positions(cache_position)[None]
        for i, layer in enumerate(self.layers):
            x = layer(x, cache_position, mask, cross_kv[i])
        # tied output projection: logits = h @ embed_tokens^T
        return torch.matmul(
            self.layer_norm(x[0] if every_position else x[:, -1, :]), self.embed_tokens.weight.t()
        ).float()


class AlignmentMethod(nn.Module):
    """openai-whisper's forward for word timing (`timing.find_alignment`): a whole token sequence [1, S] decoded
    at once over one window's cross_kv, without the KV cache (causal within the sequence), ->
        scores [A, S, 1500] f32: the cross-attention scores (before the softmax) of the A alignment heads,
        probs  [S] f32:          each id's probability given the ones before it, among the text tokens (ids below
                                 `eot`, as openai-whisper's word probabilities; the first id's: 1).
    The module's parameters are the decoder's (the same FQNs as DecoderMethod): the bundle keeps one copy."""

    def __init__(self, m: Whisper, eot: int):
        super().__init__()
        _bind_decoder(self, m)
        self.heads, self.eot = [tuple(h) for h in m.alignment_heads], eot

    def forward(self, ids: torch.Tensor, cross_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(ids.shape[1], device=ids.device)
        mask = pos[None, :] <= pos[:, None]  # [S, S]: causal
        x = self.embed_tokens(ids) + self.embed_positions(pos)[None]
        picked = []
        for i, layer in enumerate(self.layers):
            x, scores = layer.forward_with_scores(x, None, mask, cross_kv[i])
            picked += [scores[0, h] for layer_index, h in self.heads if layer_index == i]  # each [S, 1500]
        logits = torch.matmul(self.layer_norm(x[0]), self.embed_tokens.weight.t()).float()[:, : self.eot]
        probs = torch.softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None].clamp(max=self.eot - 1))[:, 0]
        return torch.stack(picked), torch.cat([torch.ones_like(probs[:1]), probs])


def default_alignment_heads(c: WhisperTextConfig) -> tuple[tuple[int, int], ...]:
    """openai-whisper's default where a model names none: every head of the decoder's second half of layers."""
    return tuple((layer, h) for layer in range(c.n_layers // 2, c.n_layers) for h in range(c.n_heads))


def methods(m: Whisper, eot: int | None = None) -> Methods:
    """The bundle's methods over `m`; with the tokenizer's `eot`, the word-timing method too."""
    device = m.decoder.embed_tokens.weight.device
    return Methods(
        LogMelSpectrogram(m.config.audio.n_mels).to(device),
        EncoderMethod(m),
        TokenEmbeddingMethod(m),
        DecoderMethod(m),
        AlignmentMethod(m, eot) if eot is not None else None,
    )
