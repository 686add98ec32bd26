"""Voxtral Realtime in plain PyTorch, written for torch.export as two streaming steps over a batch of streams.

Parameter names are transformers' `VoxtralRealtimeForConditionalGeneration` names without the leading `model.`
(`audio_tower.*`, `multi_modal_projector.*`, `language_model.*`); the output projection is tied to
`language_model.embed_tokens`. The model runs one text position (80 ms) per step, for B streams at once, each at
its own position:

    encoder_step  mel [B, n_mels, 8] f32, position [B] -> audio embedding [B, 1, dim]
        causal conv1 (k3) / conv2 (k3, stride 2) whose left context is kept in the conv tails (transformers'
        Conv1dPaddingCache), then 4 encoder frames through RMSNorm/RoPE layers with sliding-window (750) causal
        attention over a ring-buffer KV cache, then 4 frames concatenated into the projector.
    decoder_step  token [B, 1], audio embedding [B, 1, dim], position [B], delay [B] f32 -> logits [B, vocab] f32
        token embedding + audio embedding; Llama-style layers (sliding window 8192, ring-buffer KV cache) whose
        MLP input is scaled by 1 + AdaRMSNorm(time embedding of the delay).

All state is buffers written in place (conv tails, K/V rings), one row per stream slot (`EncoderState`,
`DecoderState`, `streams` rows): batch row b reads and writes state row b, so B streams run in rows 0..B-1 and a
stream of any length runs in bounded memory. A ring slot's absolute position is computed from the step's
position (no position state): with `last` the newest position written and R slots, slot i holds
`last - ((last - i) mod R)` (negative: never written). A query at q sees the slots whose position p has
q - window < p <= q, as transformers' sliding-window mask (`kv_idx > q_idx - sliding_window`). So a row's ring
needs no clearing between streams: a stream that starts at position 0 never sees what an earlier one wrote.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runner.audio import HOP_LENGTH, N_FFT
from runner.models import fused
from runner.models.mel import mel_filters
from runner.models.voxtral import RMSNorm, apply_rope, rope, silu_mul
from runner.models.voxtral_realtime_config import ADA_DIM, CONV_STRIDE, RealtimeConfig

# ---------------------------------------------------------------- streaming log-mel

# transformers' VoxtralRealtimeFeatureExtractor clamps at a fixed log-mel maximum, not the audio's own: a frame
# depends only on its 400 samples, so features computed block by block equal the whole file's.
GLOBAL_LOG_MEL_MAX = 1.5


def step_window(mel_frames: int) -> int:
    """Samples one step's mel frames cover: frame k spans [160k - 200, 160k + 200) of the padded audio (STFT
    center=True); 8 frames -> 1520 samples, starting 200 before the step's first sample."""
    return (mel_frames - 1) * HOP_LENGTH + N_FFT


class StreamingLogMel(nn.Module):
    """waveform [B, step_window(8)] f32 -> log-mel [B, n_mels, 8] f32 (a 1-D waveform: [1, n_mels, 8]): Hann 400
    (periodic), hop 160, no centre padding (the caller's window starts 200 samples early), power, Slaney mel,
    log10(clamp 1e-10), max(x, 1.5 - 8), (x + 4) / 4."""

    def __init__(self, n_mels: int) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(N_FFT, periodic=True, dtype=torch.float32))
        self.register_buffer("filters", torch.from_numpy(mel_filters(n_mels)))  # [n_mels, 201]

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(waveform, N_FFT, HOP_LENGTH, window=self.window, center=False, return_complex=True)
        power = torch.view_as_real(spec).pow(2).sum(-1)  # [(B,) 201, frames]; real ops only (Inductor)
        # a linear layer, not `filters @ power`: a batched matmul's trace guards on B != 1 (the batch dim is dynamic)
        log_spec = torch.clamp(F.linear(power.transpose(-1, -2), self.filters).transpose(-1, -2), min=1e-10).log10()
        mel = (torch.clamp(log_spec, min=GLOBAL_LOG_MEL_MAX - 8.0) + 4.0) / 4.0
        return mel if waveform.dim() == 2 else mel[None]


# ---------------------------------------------------------------- ring-buffer attention


class RingKV(nn.Module):
    """K/V of the last `slots` positions of each stream slot, [streams, kv_heads, slots, head_dim] each; a
    position's ring slot is position mod slots."""

    def __init__(self, streams: int, slots: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device=None):
        super().__init__()
        shape = (streams, n_kv_heads, slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, S], k/v [B, H_kv, S, D] written into rows 0..B-1 -> those rows' rings [B, H_kv, R, D]. One
        scatter into the buffer itself (no view of it is written: the exported program mutates it in place)."""
        b, h = k.shape[:2]
        rows = torch.arange(b, device=pos.device)[:, None, None]
        heads = torch.arange(h, device=pos.device)[None, :, None]
        index = (rows, heads, (pos % self.k.shape[2])[:, None, :])  # broadcast to [B, H_kv, S]
        self.k.index_put_(index, k)
        self.v.index_put_(index, v)
        return self.k[:b], self.v[:b]


def ring_mask(pos: torch.Tensor, slots: int, window: int) -> torch.Tensor:
    """[B, S, slots] bool: which ring slots each query position attends to (pos [B, S] ascending per row, written
    this step)."""
    last = pos[:, -1:]  # [B, 1]
    i = torch.arange(slots, device=pos.device)
    held = (last - torch.remainder(last - i, slots))[:, None, :]  # [B, 1, R]: absolute position in slot i
    q = pos[:, :, None]  # [B, S, 1]
    return (held >= 0) & (held <= q) & (held > q - window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, S, D], k/v [B, H_kv, R, D], mask [B, S, R] -> [B, S, H*D]. Grouped query heads are folded into
    their KV head's rows (no copy of the cache); softmax in float32, as transformers' eager attention."""
    b, h, s, d = q.shape
    kv = k.shape[1]
    rep = h // kv
    q = q.reshape(b, kv, rep * s, d)  # heads j*rep .. j*rep+rep-1 share KV head j: rows (rep, S)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * d**-0.5  # [B, kv, rep*S, R]
    scores = scores.masked_fill(~mask.repeat(1, rep, 1)[:, None], float("-inf"))
    y = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)  # [B, kv, rep*S, D]
    return y.reshape(b, h, s, d).transpose(1, 2).reshape(b, s, h * d)


class Attention(nn.Module):
    """q, k and v projected by one matmul (`qkv_proj`: q rows, then k, then v; transformers' separate q_proj,
    k_proj, v_proj on the way in and out). With biases, k's rows stay zero: Whisper-style, never a key bias."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, theta: float, bias: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.theta = n_heads, n_kv_heads, head_dim, theta
        self.heads = [n_heads, n_kv_heads, n_kv_heads]  # q, k, v
        self.qkv_proj = nn.Linear(dim, sum(self.heads) * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, ring: RingKV) -> torch.Tensor:
        b, s, d = x.shape[0], x.shape[1], self.head_dim  # x: [B, S, dim], pos: [B, S]
        # Split into heads while the projection is contiguous, then into q, k, v. Inductor's view of a strided slice
        # (each of q, k, v cut first) guards on B != 1 even when compiled size-obliviously; where B is at most 2
        # (--max-streams 2) that leaves B only 2, and the program would take exactly two rows.
        qkv = self.qkv_proj(x).unflatten(-1, (sum(self.heads), d))  # [B, S, H + 2 H_kv, D]
        q, k, v = (t.transpose(1, 2) for t in qkv.split(self.heads, dim=2))  # [B, H(_kv), S, D]
        cos, sin = (t.view(b, 1, s, d) for t in rope(pos.reshape(-1), d, self.theta, x.dtype))
        k, v = ring.update(pos, apply_rope(k, cos, sin), v)
        return self.o_proj(attend(apply_rope(q, cos, sin), k, v, mask))


class MLP(nn.Module):
    """gate and up projected by one matmul (`gate_up_proj`: gate rows, then up)."""

    def __init__(self, dim: int, ffn_dim: int, down_bias: bool):
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=down_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


# ---------------------------------------------------------------- the state: one row per stream slot


class EncoderState(nn.Module):
    """encoder_step's state: the convolutions' left context (2 mel frames, 1 conv1 frame; zeros at the start of a
    stream, as transformers' causal padding) and each layer's ring (its window plus one step's frames, written
    before they attend)."""

    def __init__(self, c: RealtimeConfig, streams: int, dtype: torch.dtype, device=None):
        super().__init__()
        a, slots = c.audio, c.audio.sliding_window - 1 + c.downsample_factor
        self.register_buffer("conv1", torch.zeros(streams, a.n_mels, 2, dtype=dtype, device=device), persistent=False)
        self.register_buffer(
            "conv2", torch.zeros(streams, a.dim, 3 - CONV_STRIDE, dtype=dtype, device=device), persistent=False
        )
        self.layers = nn.ModuleList(
            RingKV(streams, slots, a.n_heads, a.head_dim, dtype, device) for _ in range(a.n_layers)
        )


class DecoderState(nn.Module):
    """decoder_step's state: each layer's ring over its window (one position per step)."""

    def __init__(self, c: RealtimeConfig, streams: int, dtype: torch.dtype, device=None):
        super().__init__()
        t = c.text
        self.layers = nn.ModuleList(
            RingKV(streams, t.sliding_window, t.n_kv_heads, t.head_dim, dtype, device) for _ in range(t.n_layers)
        )


def zero_rows(state: nn.Module, rows: list[int] | None = None) -> None:
    """Zero every buffer of a state module (a new stream in each of `rows`; None: every row)."""
    with torch.no_grad():
        for buf in state.buffers():
            if rows is None:
                buf.zero_()
            else:
                buf[rows] = 0


# ---------------------------------------------------------------- audio encoder


class EncoderLayer(nn.Module):
    def __init__(self, c: RealtimeConfig):
        a = c.audio
        super().__init__()
        self.self_attn = Attention(a.dim, a.n_heads, a.n_heads, a.head_dim, a.rope_theta, bias=True)
        self.self_attn_layer_norm = RMSNorm(a.dim, a.norm_eps)
        self.mlp = MLP(a.dim, a.ffn_dim, down_bias=True)
        self.final_layer_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x, pos, mask, ring):
        x = x + self.self_attn(self.self_attn_layer_norm(x), pos, mask, ring)
        return x + self.mlp(self.final_layer_norm(x))


class Embedder(nn.Module):
    """The two causal convolutions; their left padding is the previous step's tail, kept in the state."""

    def __init__(self, c: RealtimeConfig):
        super().__init__()
        a = c.audio
        self.conv1 = nn.Conv1d(a.n_mels, a.dim, kernel_size=3)
        self.conv2 = nn.Conv1d(a.dim, a.dim, kernel_size=3, stride=CONV_STRIDE)

    def forward(self, mel: torch.Tensor, state: EncoderState) -> torch.Tensor:
        b = mel.shape[0]  # mel: [B, n_mels, 8]
        rows = torch.arange(b, device=mel.device)
        x = torch.cat([state.conv1[:b], mel], dim=-1)
        state.conv1.index_copy_(0, rows, x[:, :, -state.conv1.shape[2] :])
        x = torch.cat([state.conv2[:b], F.gelu(self.conv1(x))], dim=-1)
        state.conv2.index_copy_(0, rows, x[:, :, -state.conv2.shape[2] :])
        return F.gelu(self.conv2(x)).transpose(1, 2)  # [B, 4, dim]


class AudioTower(nn.Module):
    def __init__(self, c: RealtimeConfig):
        super().__init__()
        self.window = c.audio.sliding_window
        self.embedder = Embedder(c)
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.audio.n_layers))
        self.norm = RMSNorm(c.audio.dim, c.audio.norm_eps)

    def forward(self, mel: torch.Tensor, frame_pos: torch.Tensor, state: EncoderState) -> torch.Tensor:
        x = self.embedder(mel, state)
        mask = ring_mask(frame_pos, state.layers[0].k.shape[2], self.window)
        for layer, ring in zip(self.layers, state.layers):
            x = layer(x, frame_pos, mask, ring)
        return self.norm(x)


class Projector(nn.Module):
    def __init__(self, c: RealtimeConfig):
        super().__init__()
        self.linear_1 = nn.Linear(c.audio.dim * c.downsample_factor, c.text.dim, bias=False)
        self.linear_2 = nn.Linear(c.text.dim, c.text.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


# ---------------------------------------------------------------- text decoder


def time_embedding(t: torch.Tensor, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of the delay (in tokens): t [B] -> [B, dim], cos then sin (transformers'
    VoxtralRealtimeTimeEmbedding)."""
    half = dim // 2
    inv_freq = torch.exp(-math.log(theta) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    emb = t.float()[:, None] * inv_freq[None, :]
    return torch.cat((emb.cos(), emb.sin()), dim=-1)


class AdaRMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear1 = nn.Linear(dim, ADA_DIM, bias=False)
        self.linear2 = nn.Linear(ADA_DIM, dim, bias=False)

    def forward(self, t_cond: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.gelu(self.linear1(t_cond)))


class DecoderLayer(nn.Module):
    def __init__(self, c: RealtimeConfig):
        t = c.text
        super().__init__()
        self.self_attn = Attention(t.dim, t.n_heads, t.n_kv_heads, t.head_dim, t.rope_theta, bias=False)
        self.mlp = MLP(t.dim, t.ffn_dim, down_bias=False)
        self.input_layernorm = RMSNorm(t.dim, t.norm_eps)
        self.post_attention_layernorm = RMSNorm(t.dim, t.norm_eps)
        self.ada_rms_norm = AdaRMSNorm(t.dim)

    def forward(self, x, pos, mask, t_cond, ring):
        x = x + self.self_attn(self.input_layernorm(x), pos, mask, ring)
        return x + self.mlp(self.post_attention_layernorm(x) * (1 + self.ada_rms_norm(t_cond)))


class LanguageModel(nn.Module):
    def __init__(self, c: RealtimeConfig):
        super().__init__()
        self.window = c.text.sliding_window
        self.embed_tokens = nn.Embedding(c.text.vocab_size, c.text.dim)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.text.n_layers))
        self.norm = RMSNorm(c.text.dim, c.text.norm_eps)


# ---------------------------------------------------------------- the whole model and its two steps


class VoxtralRealtime(nn.Module):
    def __init__(self, config: RealtimeConfig):
        super().__init__()
        self.config = config
        self.audio_tower = AudioTower(config)
        self.multi_modal_projector = Projector(config)
        self.language_model = LanguageModel(config)
        self.encoder_state: EncoderState | None = None
        self.decoder_state: DecoderState | None = None

    def setup_caches(self, max_seq_len: int | None = None, dtype: torch.dtype | None = None, streams: int = 1) -> None:
        """The state of `streams` stream slots. `max_seq_len` is unused: a stream has no end (ring buffers)."""
        w = self.language_model.embed_tokens.weight
        dtype = dtype or w.dtype
        self.encoder_state = EncoderState(self.config, streams, dtype, w.device)
        self.decoder_state = DecoderState(self.config, streams, dtype, w.device)

    @property
    def streams(self) -> int:
        return self.decoder_state.layers[0].k.shape[0]

    def reset_caches(self, rows: list[int] | None = None) -> None:
        for state in (self.encoder_state, self.decoder_state):
            zero_rows(state, rows)

    def state_names(self) -> dict[str, list[str]]:
        """Each step's state buffers, named as in its method module (what the runtime allocates and binds)."""
        return {
            "encoder_step": [f"state.{n}" for n, _ in self.encoder_state.named_buffers()],
            "decoder_step": [f"state.{n}" for n, _ in self.decoder_state.named_buffers()],
        }

    def init_weights(self, seed: int) -> VoxtralRealtime:
        """Deterministic random init (models/fused.py: normal(0, initializer_range), norms at one, biases zero)."""
        fused.init_random(self, seed, self.config.initializer_range)
        return self

    def _sizes(self, key: str, module: str) -> list[int]:
        """The rows of each part of a fused parameter (models/fused.py)."""
        c = self.config.audio if key.startswith("audio_tower.") else self.config.text
        kv = c.n_heads if key.startswith("audio_tower.") else c.n_kv_heads
        if module.endswith("qkv_proj"):
            return [c.n_heads * c.head_dim, kv * c.head_dim, kv * c.head_dim]
        return [c.ffn_dim, c.ffn_dim]

    def to_hf_layout(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict of ours (or already HF-layout) -> transformers' layout, in the same order."""
        return fused.to_hf(state, self._sizes)

    def from_hf_layout(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return fused.from_hf(state, self.state_dict().keys(), self._sizes)


class EncoderStep(nn.Module):
    """mel [B, n_mels, 8] f32 + each stream's text position [B] -> audio embeddings [B, 1, text dim]. `state`:
    another set of stream slots over the same weights (default: the model's)."""

    def __init__(self, m: VoxtralRealtime, state: EncoderState | None = None):
        super().__init__()
        self.audio_tower, self.multi_modal_projector = m.audio_tower, m.multi_modal_projector
        self.state = state if state is not None else m.encoder_state
        self.frames = m.config.downsample_factor

    def forward(self, mel: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        frame_pos = position[:, None] * self.frames + torch.arange(self.frames, device=mel.device)  # [B, 4]
        h = self.audio_tower(mel.to(dtype), frame_pos, self.state)  # [B, 4, audio dim]
        return self.multi_modal_projector(h.reshape(h.shape[0], 1, -1))


class DecoderStep(nn.Module):
    """token [B, 1] int64 + audio embedding [B, 1, dim] + position [B] + delay [B] f32 -> logits [B, vocab] f32."""

    def __init__(self, m: VoxtralRealtime, state: DecoderState | None = None):
        super().__init__()
        self.language_model = m.language_model
        self.state = state if state is not None else m.decoder_state

    def forward(
        self, token: torch.Tensor, audio: torch.Tensor, position: torch.Tensor, delay: torch.Tensor
    ) -> torch.Tensor:
        lm = self.language_model
        x = lm.embed_tokens(token) + audio  # [B, 1, dim]
        t_cond = time_embedding(delay, x.shape[-1]).to(x.dtype)[:, None, :]  # [B, 1, dim]
        pos = position[:, None]  # [B, 1]
        mask = ring_mask(pos, self.state.layers[0].k.shape[2], lm.window)
        for layer, ring in zip(lm.layers, self.state.layers):
            x = layer(x, pos, mask, t_cond, ring)
        return torch.matmul(lm.norm(x[:, -1, :]), lm.embed_tokens.weight.t()).float()  # tied output projection
