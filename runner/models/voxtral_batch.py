"""The Voxtral decoder for B sequences at once, one token each (`text_decoder_batch`): continuous batching's step.

Each sequence lives in a slot of its own KV cache, [slots, n_kv, S, head_dim] per layer, separate from the
batch-1 cache the prefill writes (the runtime copies a prefilled prompt's rows into a free slot). Row b of a
batch is slot b, at its own position `cache_position[b]`, attending to positions 0..cache_position[b] of its
slot. The same parameters as text_decoder (`layers.*`, `norm`, `lm_head`): one weights file serves both. An int4
layer runs through tinygemm on CUDA (`quant_linear.few_rows`): B <= 32 rows, where dequantising the whole weight
per step would move several times what tinygemm reads.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.models.quant_linear import few_rows
from runner.models.voxtral import Attention, LanguageModel, apply_rope, rope, silu_mul
from runner.models.voxtral_config import TextConfig


class SlotKV(nn.Module):
    def __init__(self, slots: int, max_seq_len: int, n_kv_heads: int, head_dim: int, dtype, device=None):
        super().__init__()
        shape = (slots, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B], k/v [B, H_kv, D] written at row b's position -> rows 0..B-1 [B, H_kv, S, D]. One scatter
        into the buffer itself (a written view would not be a mutation of the exported program's state)."""
        b, h = k.shape[:2]
        rows = torch.arange(b, device=pos.device)[:, None]
        heads = torch.arange(h, device=pos.device)[None, :]
        index = (rows, heads, pos[:, None])  # broadcast to [B, H_kv]
        self.k_cache.index_put_(index, k)
        self.v_cache.index_put_(index, v)
        return self.k_cache[:b], self.v_cache[:b]


def _holder(**children: nn.Module) -> nn.Module:
    m = nn.Module()
    for name, child in children.items():
        m.add_module(name, child)
    return m


class SlotCaches(nn.Module):
    """Every layer's SlotKV, nested as the batch-1 caches are (`layers.i.self_attn.kv_cache`)."""

    def __init__(self, c: TextConfig, slots: int, max_seq_len: int, dtype, device=None):
        super().__init__()
        self.layers = nn.ModuleList(
            _holder(self_attn=_holder(kv_cache=SlotKV(slots, max_seq_len, c.n_kv_heads, c.head_dim, dtype, device)))
            for _ in range(c.n_layers)
        )

    def kv(self, i: int) -> SlotKV:
        return self.layers[i].self_attn.kv_cache

    def reset(self) -> None:
        for buf in self.buffers():
            buf.zero_()


def slot_attention(
    attn: Attention, x: torch.Tensor, cos, sin, pos: torch.Tensor, mask: torch.Tensor, kv: SlotKV, attend=None
) -> torch.Tensor:
    """Attention.forward for one token per row, over each row's slot: x [B, 1, dim], cos/sin [B, D], mask [B, S].
    `attend` (qkv [B, H + 2 H_kv, D] before RoPE, cos, sin, kv, pos -> y [B, H_kv, rep, D]): the kernel for all of
    it after the projection, RoPE and the cache writes included (the CUDA export's Triton op,
    export/kernels_batch.py); else written out over the whole slot."""
    c = attn.c
    n_kv, rep, d = c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim
    # Split into heads while the projection is contiguous, then into q, k, v, and fold the query heads after the
    # rope (a tensor of its own). Inductor's view of a strided slice with B in it (q, k, v cut first, then each
    # unflattened, or k[:, :, 0]) guards on B > 1 even when compiled size-obliviously; where B is at most 2
    # (--max-batch 2) that leaves B only 2, and the program would take exactly two rows.
    qkv = few_rows(attn.qkv_proj, x).unflatten(-1, (c.n_heads + 2 * n_kv, d))[:, 0]  # [B, H + 2 H_kv, D]
    if attend is not None:
        y = attend(qkv, cos, sin, kv, pos)
    else:
        q, k, v = qkv.split([c.n_heads, n_kv, n_kv], dim=1)  # [B, H(_kv), D]
        q, k = apply_rope(q, cos[:, None, :], sin[:, None, :]), apply_rope(k, cos[:, None, :], sin[:, None, :])
        keys, values = kv.update(pos, k, v)  # [B, H_kv, S, D]
        q = q.unflatten(1, (n_kv, rep))  # [B, H_kv, rep, D]: query heads folded as in Attention
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * d**-0.5  # [B, H_kv, rep, S]
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        y = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [B, H_kv, rep, D]
    return few_rows(attn.o_proj, y.flatten(1).unsqueeze(1))  # heads in order j*rep + r: [B, 1, n_heads * D]


class BatchDecoder(nn.Module):
    """embeds [B, 1, dim], cache_position [B] int64 -> logits [B, vocab] float32; writes slot b at its position.
    `state` is the slot cache it reads and writes (another set of slots over the same weights: the exporter
    traces one of `--max-batch` slots, the eager self-check keeps a smaller one); `attend`, slot_attention's."""

    def __init__(self, c: TextConfig, lm: LanguageModel, state: SlotCaches, attend=None):
        super().__init__()
        self.c, self.attend = c, attend
        self.layers, self.norm, self.lm_head = lm.model.layers, lm.model.norm, lm.lm_head
        # named `batch`: the slot caches' FQNs are the batch-1 caches' under runner.bundle.BATCH_STATE_PREFIX
        # (batch.layers.i.self_attn.kv_cache.k_cache), by which the runtime pairs them
        self.batch = state

    def forward(self, embeds: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        max_seq = self.batch.kv(0).k_cache.shape[2]
        mask = torch.arange(max_seq, device=embeds.device)[None, :] <= cache_position[:, None]  # [B, S]
        cos, sin = rope(cache_position, self.c.head_dim, self.c.rope_theta, embeds.dtype)  # [B, D]
        x = embeds
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = x + slot_attention(layer.self_attn, h, cos, sin, cache_position, mask, self.batch.kv(i), self.attend)
            gate_up = few_rows(layer.mlp.gate_up_proj, layer.post_attention_layernorm(x))
            x = x + few_rows(layer.mlp.down_proj, silu_mul(gate_up))  # MLP.forward, its linears at a few rows
        return few_rows(self.lm_head, self.norm(x[:, -1, :])).float()
