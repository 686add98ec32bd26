"""Voxtral in plain PyTorch, written for torch.export.

Parameter names follow what `VoxtralForConditionalGeneration.save_pretrained` writes (`audio_tower.*`,
`multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.*`), except that the q/k/v and
gate/up projections are fused (`qkv_proj`, `gate_up_proj`): in the decoder one GEMV instead of three and two per
decode step (measured on the H200: 2.78 -> 2.28 ms for the step's matmuls), in the encoder one matmul instead of
three. `models/fused.py` converts between the two layouts. The decoder holds a static KV cache as buffers
(gpt-fast style): the exported text_decoder mutates it in place at `cache_position`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runner.models import fused
from runner.models.mel import LogMelSpectrogram
from runner.models.methods import Methods
from runner.models.quant_linear import few_rows
from runner.models.voxtral_config import PROJECTOR_GROUP, AudioConfig, TextConfig, VoxtralConfig


def _add_norm(x: torch.Tensor, delta: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + delta
    return x, norm(x)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The MLP's activation on its fused projection's output (gate columns, then up) -> silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class PrefillKernels:
    """Ops the prompt's layers (audio encoder, text decoder) call instead of their written-out torch form: the CUDA
    export's Triton ops, export/kernels_prefill.py. The defaults: written out."""

    # (qkv, cos, sin, k_cache, v_cache, cache_position, rep) -> o_proj's input: kernels_prefill.prefill_attention
    attend: Callable | None = None
    silu_mul: Callable = silu_mul  # gate_up -> silu(gate) * up: kernels_prefill.silu_mul
    add_norm: Callable = _add_norm  # (x, delta, LayerNorm) -> (x + delta, its norm): kernels_prefill.add_layer_norm


WRITTEN_OUT = PrefillKernels()


# ---------------------------------------------------------------- audio tower (Whisper encoder)


class EncoderAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        # q, k, v rows in one matmul (N = 3 * dim fills the GPU better than three of dim at 1500 rows); the key
        # rows of the bias stay zero: Whisper's key projection has none (models/fused.py)
        self.qkv_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # x: [chunks, 1500, d]
        q, k, v = self.qkv_proj(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)  # bidirectional: each 30 s chunk attends to itself
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


class EncoderLayer(nn.Module):
    def __init__(self, c: AudioConfig):
        super().__init__()
        self.self_attn = EncoderAttention(c.dim, c.n_heads)
        self.self_attn_layer_norm = nn.LayerNorm(c.dim)
        self.fc1 = nn.Linear(c.dim, c.ffn_dim)
        self.fc2 = nn.Linear(c.ffn_dim, c.dim)
        self.final_layer_norm = nn.LayerNorm(c.dim)

    def forward(self, x, h, next_norm: nn.Module, add_norm=_add_norm) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream, h: its self_attn_layer_norm (the layer before computed it with its own residual
        add: one pass, `add_norm`) -> the stream after this layer and its `next_norm`."""
        x, h = add_norm(x, self.self_attn(h), self.final_layer_norm)
        return add_norm(x, self.fc2(F.gelu(self.fc1(h))), next_norm)


class AudioTower(nn.Module):
    def __init__(self, c: AudioConfig):
        super().__init__()
        self.conv1 = nn.Conv1d(c.n_mels, c.dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c.dim, c.dim, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(c.max_source_positions, c.dim)
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.n_layers))
        self.layer_norm = nn.LayerNorm(c.dim)

    def forward(self, mel: torch.Tensor, kernels: PrefillKernels = WRITTEN_OUT) -> torch.Tensor:
        x = F.gelu(self.conv1(mel))  # mel: [chunks, n_mels, 3000]
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [chunks, 1500, d]
        x = x + self.embed_positions.weight.to(x.dtype)
        h = self.layers[0].self_attn_layer_norm(x)
        next_norms = [layer.self_attn_layer_norm for layer in self.layers[1:]] + [self.layer_norm]
        for layer, next_norm in zip(self.layers, next_norms):
            x, h = layer(x, h, next_norm, kernels.add_norm)
        return h


class Projector(nn.Module):
    def __init__(self, c: VoxtralConfig):
        super().__init__()
        self.linear_1 = nn.Linear(c.audio.ffn_dim, c.text.dim, bias=False)
        self.linear_2 = nn.Linear(c.text.dim, c.text.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


# ---------------------------------------------------------------- text decoder (Llama)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    """RoPE's rotation frequencies [head_dim / 2], float32 (as HF's Llama computes them)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [seq, head_dim] for the given positions, computed in float32 (as HF's Llama does)."""
    freqs = positions.float()[:, None] * rope_inv_freq(head_dim, theta, positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class KVCache(nn.Module):
    def __init__(self, max_seq_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        shape = (1, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # input_pos: [S], k/v: [1, H_kv, S, D]; written in place so the exported program mutates our buffer
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.c = c
        self.qkv_proj = nn.Linear(c.dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, bias=False)  # q, k, v rows
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x, cos, sin, input_pos, mask, attend=None):
        c, (b, s, _) = self.c, x.shape  # x: [b, S, dim], mask: [S, max_seq], or None: a prompt from position 0
        kv, rep, d = c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim
        # GQA without copying K/V: query heads j*rep..j*rep+rep-1 share KV head j, so they are folded into
        # KV head j's rows ([b, H_kv, S*rep, D]); repeat_interleave would write rep copies of the cache.
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([c.n_heads * d, kv * d, kv * d], dim=-1)
        k = apply_rope(k.view(b, s, kv, d).transpose(1, 2), cos, sin)  # [b, H_kv, S, D]
        v = v.view(b, s, kv, d).transpose(1, 2)
        cached_k, cached_v = self.kv_cache.update(input_pos, k, v)  # [1, H_kv, max_seq, D]
        if mask is None and attend is not None:
            # a prompt through the given kernel (the CUDA export's Triton flash attention, export/kernels_prefill.py):
            # it applies RoPE to the queries as it reads them from qkv and writes o_proj's input; it reads keys from
            # the cache, positions [0, input_pos[-1]]: a prompt in pieces attends to those before
            return self.o_proj(attend(qkv, cos, sin, cached_k, cached_v, input_pos, rep))
        q = q.view(b, s, kv, rep, d).permute(0, 2, 1, 3, 4)  # [b, H_kv, S, rep, D]
        q = apply_rope(q, cos[:, None, :], sin[:, None, :]).reshape(b, kv, s * rep, d)
        if mask is None:
            # A prompt into an empty cache attends only to itself (causal over its positions), so the cost
            # follows the prompt, not the cache's length: [S, S] scores, not [S, max_seq].
            mask = input_pos[None, :] <= input_pos[:, None]  # [S, S]
        else:
            k, v = cached_k, cached_v
        # Written out rather than SDPA with a mask: torch 2.11 could not export SDPA's masked CUDA path for a
        # dynamic length (an unprovable guard). Softmax in float32, as HF's Llama does.
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * d**-0.5  # [b, H_kv, S*rep, S or max_seq]
        scores = scores.masked_fill(~mask.repeat_interleave(rep, dim=0), float("-inf"))
        y = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)  # [b, H_kv, S*rep, D]
        y = y.view(b, kv, s, rep, d).permute(0, 2, 1, 3, 4).reshape(b, s, c.n_heads * d)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(c.dim, 2 * c.ffn_dim, bias=False)  # gate rows, then up rows
        self.down_proj = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x, act=silu_mul):
        return self.down_proj(act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.post_attention_layernorm = RMSNorm(c.dim, c.norm_eps)

    def forward(self, x, cos, sin, input_pos, mask, kernels: PrefillKernels = WRITTEN_OUT):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, input_pos, mask, kernels.attend)
        return x + self.mlp(self.post_attention_layernorm(x), kernels.silu_mul)


class TextModel(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)


class LanguageModel(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.model = TextModel(c)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)


class TextDecoder(nn.Module):
    """The decoder body without the embedding table: any positions, attending to the cache (decode steps, the
    eager reference). With `prefill`, what the exported text_decoder method holds: a prompt from position 0 into
    an empty cache (the runtime prefills a whole prompt in one call, always from an empty cache): it attends to the
    prompt alone, through `kernels` where given, else written out."""

    def __init__(self, c: TextConfig, lm: LanguageModel, prefill: bool = False, kernels: PrefillKernels = WRITTEN_OUT):
        super().__init__()
        self.c, self.prefill, self.kernels = c, prefill, kernels
        self.layers, self.norm, self.lm_head = lm.model.layers, lm.model.norm, lm.lm_head

    def forward(self, embeds: torch.Tensor, cache_position: torch.Tensor, every_position: bool = False) -> torch.Tensor:
        # embeds: [1, S, dim], cache_position: [S] -> logits of the last position [1, vocab] float32, or with
        # every_position (the eager reference scoring a whole answer in one call) of each position [S, vocab]
        max_seq = self.layers[0].self_attn.kv_cache.k_cache.shape[2]
        mask = None
        if not self.prefill:
            mask = torch.arange(max_seq, device=embeds.device)[None, :] <= cache_position[:, None]  # [S, max_seq]
        cos, sin = rope(cache_position, self.c.head_dim, self.c.rope_theta, embeds.dtype)
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, cache_position, mask, self.kernels)
        if every_position:
            return self.lm_head(self.norm(x[0])).float()
        # one row: an int4 lm_head through tinygemm, not its 0.8 GB (3B) dequantised for one position
        return few_rows(self.lm_head, self.norm(x[:, -1, :])).float()


# ---------------------------------------------------------------- the whole model


class Voxtral(nn.Module):
    def __init__(self, config: VoxtralConfig):
        super().__init__()
        self.config = config
        self.audio_tower = AudioTower(config.audio)
        self.multi_modal_projector = Projector(config)
        self.language_model = LanguageModel(config.text)

    def setup_caches(self, max_seq_len: int, dtype: torch.dtype | None = None) -> None:
        t = self.config.text
        w = self.language_model.model.embed_tokens.weight  # never quantised (lm_head may be: QuantLinear)
        dtype, device = dtype or w.dtype, w.device
        for layer in self.language_model.model.layers:
            layer.self_attn.kv_cache = KVCache(max_seq_len, t.n_kv_heads, t.head_dim, dtype).to(device)

    def reset_caches(self) -> None:
        for layer in self.language_model.model.layers:
            layer.self_attn.kv_cache.k_cache.zero_()
            layer.self_attn.kv_cache.v_cache.zero_()

    def _sizes(self, key: str, module: str) -> list[int]:
        """The rows of each part of a fused parameter (models/fused.py)."""
        if key.startswith("audio_tower."):
            return [self.config.audio.dim] * 3
        t = self.config.text
        if module.endswith("qkv_proj"):
            return [t.n_heads * t.head_dim, t.n_kv_heads * t.head_dim, t.n_kv_heads * t.head_dim]
        return [t.ffn_dim, t.ffn_dim]

    def to_hf_layout(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict of ours (or already HF-layout) -> the layout save_pretrained writes."""
        return fused.to_hf(state, self._sizes)

    def from_hf_layout(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return fused.from_hf(state, self.state_dict().keys(), self._sizes)

    def decoder(self) -> TextDecoder:
        return TextDecoder(self.config.text, self.language_model)

    def prefiller(self, kernels: PrefillKernels = WRITTEN_OUT) -> TextDecoder:
        """The decoder for a prompt into an empty cache (the exported text_decoder): it attends to the prompt alone,
        so the cost follows the prompt, not the cache. `kernels`: the CUDA export's Triton ops (torch 2.11 CUDA
        could not export the written-out attention for a dynamic length)."""
        return TextDecoder(self.config.text, self.language_model, prefill=True, kernels=kernels)

    def init_weights(self, seed: int) -> Voxtral:
        """Deterministic random init (models/fused.py: normal(0, initializer_range), norms at one, biases zero)."""
        fused.init_random(self, seed, self.config.initializer_range)
        return self


# ---------------------------------------------------------------- the exported methods as modules


class AudioEncoderMethod(nn.Module):
    """mel [chunks, n_mels, 3000] -> audio embeddings [1, chunks * 375, dim]; weights `audio_tower.*`,
    `multi_modal_projector.*`. `kernels`: the CUDA export's (the residual adds and LayerNorms as one op)."""

    def __init__(self, m: Voxtral, kernels: PrefillKernels = WRITTEN_OUT):
        super().__init__()
        self.audio_tower, self.multi_modal_projector = m.audio_tower, m.multi_modal_projector
        self.group, self.kernels = PROJECTOR_GROUP * m.config.audio.dim, kernels

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        h = self.audio_tower(mel, self.kernels)  # [chunks, 1500, d]
        return self.multi_modal_projector(h.reshape(1, -1, self.group))  # group 4 consecutive frames


class TokenEmbeddingMethod(nn.Module):
    def __init__(self, m: Voxtral):
        super().__init__()
        self.embed_tokens = m.language_model.model.embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)


def methods(m: Voxtral) -> Methods:
    device = m.language_model.model.embed_tokens.weight.device
    return Methods(
        LogMelSpectrogram(m.config.audio.n_mels).to(device), AudioEncoderMethod(m), TokenEmbeddingMethod(m), m.decoder()
    )
