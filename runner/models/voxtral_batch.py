"""The Voxtral decoder for B sequences at once, one token each (`text_decoder_batch`): continuous batching's step.

Each sequence lives in a slot of its own KV cache, [slots, n_kv, S, head_dim] per layer, separate from the
batch-1 cache the prefill writes (the runtime copies a prefilled prompt's rows into a free slot). Row b of a
batch is slot b, at its own position `cache_position[b]`, attending to positions 0..cache_position[b] of its
slot. The same parameters as text_decoder (`layers.*`, `norm`, `lm_head`): one weights file serves both. An int4
layer runs through tinygemm on CUDA (`quant_linear.few_rows`): B <= 32 rows, where dequantising the whole weight
per step would move several times what tinygemm reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from runner.models.quant_linear import few_rows
from runner.models.voxtral import Attention, LanguageModel, RMSNorm, apply_rope, rope, silu_mul
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


def rms_linear(x: torch.Tensor, norm: RMSNorm, lin: nn.Module, glu: bool = False, out_f32: bool = False):
    """lin(norm(x)) at a few rows (x [B, K]), with `glu` SiLU(gate) * up of its fused output, with `out_f32` float32."""
    y = few_rows(lin, norm(x))
    if glu:
        return silu_mul(y)
    return y.float() if out_f32 else y


def linear_add(x: torch.Tensor, lin: nn.Module, residual: torch.Tensor) -> torch.Tensor:
    return residual + few_rows(lin, x)


@dataclass(frozen=True)
class BatchKernels:
    """Ops the batched step calls instead of their written-out torch form: the CUDA export's Triton ops
    (export/kernels_batch.py, kernels_rows.py). The defaults: written out."""

    # (q [B, H_kv, rep, D], keys, values, pos) -> y of q's shape, after the cache write; None: over the whole slot
    attend: Callable | None = None
    rms_linear: Callable = rms_linear  # (x [B, K], norm, lin, glu, out_f32) -> [B, N]
    linear_add: Callable = linear_add  # (x [B, K], lin, residual [B, N]) -> [B, N]


def slot_attention(
    attn: Attention, qkv: torch.Tensor, cos, sin, pos: torch.Tensor, mask: torch.Tensor, kv: SlotKV, attend=None
) -> torch.Tensor:
    """Attention.forward for one token per row after its qkv projection, over each row's slot: qkv [B, (H + 2
    H_kv) D], cos/sin [B, D], mask [B, S] -> o_proj's input [B, H D]. `attend`: BatchKernels.attend."""
    c = attn.c
    n_kv, rep, d = c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim
    # Split into heads while the projection is contiguous, then into q, k, v, and fold the query heads after the
    # rope (a tensor of its own). Inductor's view of a strided slice with B in it (q, k, v cut first, then each
    # unflattened, or k[:, :, 0]) guards on B > 1 even when compiled size-obliviously; where B is at most 2
    # (--max-batch 2) that leaves B only 2, and the program would take exactly two rows.
    qkv = qkv.unflatten(-1, (c.n_heads + 2 * n_kv, d))  # [B, H + 2 H_kv, D]
    q, k, v = qkv.split([c.n_heads, n_kv, n_kv], dim=1)  # [B, H(_kv), D]
    cos, sin = cos[:, None, :], sin[:, None, :]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys, values = kv.update(pos, k, v)  # [B, H_kv, S, D]
    q = q.unflatten(1, (n_kv, rep))  # [B, H_kv, rep, D]: query heads folded as in Attention
    if attend is not None:
        y = attend(q.contiguous(), keys, values, pos)
    else:
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * d**-0.5  # [B, H_kv, rep, S]
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        y = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [B, H_kv, rep, D]
    return y.flatten(1)  # heads in order j*rep + r: [B, n_heads * D]


class BatchDecoder(nn.Module):
    """embeds [B, 1, dim], cache_position [B] int64 -> logits [B, vocab] float32; writes slot b at its position.
    `state` is the slot cache it reads and writes (another set of slots over the same weights: the exporter
    traces one of `--max-batch` slots, the eager self-check keeps a smaller one); `kernels`, the ops it calls."""

    def __init__(self, c: TextConfig, lm: LanguageModel, state: SlotCaches, kernels: BatchKernels = BatchKernels()):
        super().__init__()
        self.c, self.kernels = c, kernels
        self.layers, self.norm, self.lm_head = lm.model.layers, lm.model.norm, lm.lm_head
        # named `batch`: the slot caches' FQNs are the batch-1 caches' under runner.bundle.BATCH_STATE_PREFIX
        # (batch.layers.i.self_attn.kv_cache.k_cache), by which the runtime pairs them
        self.batch = state

    def forward(self, embeds: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        ops = self.kernels
        max_seq = self.batch.kv(0).k_cache.shape[2]
        mask = torch.arange(max_seq, device=embeds.device)[None, :] <= cache_position[:, None]  # [B, S]
        cos, sin = rope(cache_position, self.c.head_dim, self.c.rope_theta, embeds.dtype)  # [B, D]
        x = embeds[:, 0]  # [B, dim]: one token a row
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = ops.rms_linear(x, layer.input_layernorm, attn.qkv_proj)
            y = slot_attention(attn, qkv, cos, sin, cache_position, mask, self.batch.kv(i), ops.attend)
            x = ops.linear_add(y, attn.o_proj, x)
            h = ops.rms_linear(x, layer.post_attention_layernorm, mlp.gate_up_proj, glu=True)
            x = ops.linear_add(h, mlp.down_proj, x)  # MLP.forward, its linears at a few rows
        return ops.rms_linear(x, self.norm, self.lm_head, out_f32=True)
