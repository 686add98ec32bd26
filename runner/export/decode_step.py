"""The decoder at one position, as its own method (`text_decoder_step`): a static shape for the decode loop.

The dynamic `text_decoder` serves prefill and decode alike, so its matmuls are the general cuBLAS ones. The step
method is the same decoder (the same parameters: the runtime binds one copy of the weights and one KV cache to
both methods) exported for exactly one token. On CUDA it runs the hand-written kernels of `kernels.py`: RMSNorm
folded into the GEMVs, residual adds and SiLU(gate) * up in their epilogues, attention over the valid positions
only with rope and the cache write folded in. On CPU it is the plain decoder at S = 1.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.export.config import TextConfig
from runner.export.model import LanguageModel

_COUNT_STRIDE = 16  # counters per layer; at least the KV heads (asserted below)


class DecodeStep(nn.Module):
    """embeds [1, 1, dim], cache_position [1] -> logits [1, vocab] float32; writes the KV cache at that position.
    Parameter names are the text_decoder's (`layers.*`, `norm`, `lm_head`), so one weights file serves both."""

    def __init__(self, c: TextConfig, lm: LanguageModel):
        super().__init__()
        from runner.export import kernels  # noqa: F401  (registers torch.ops.voxtral.*; needs Triton)

        if c.n_kv_heads > _COUNT_STRIDE:
            raise ValueError(f"{c.n_kv_heads} KV heads: more than the {_COUNT_STRIDE} attention counters per layer")
        self.c = c
        self.layers, self.norm, self.lm_head = lm.model.layers, lm.model.norm, lm.lm_head

    def forward(self, embeds: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        c, ops = self.c, torch.ops.voxtral
        x = embeds.reshape(c.dim)
        rot = ops.rope_table(cache_position, embeds, c.rope_theta, c.head_dim)  # cos/sin, for every layer
        # attention's per-head split counters, every layer's in one buffer: one fill per step. Each layer's start on
        # a 16-int boundary, so every layer passes an offset Triton specialises alike (divisible by 16) and all
        # layers share one compiled kernel: with two variants AOTInductor linked each binary into the .so more
        # than once and the link failed (`h200/3b_export_s12d.log`)
        counts = torch.zeros(c.n_layers * _COUNT_STRIDE, dtype=torch.int32, device=embeds.device)
        for i, layer in enumerate(self.layers):
            attn, mlp, kv = layer.self_attn, layer.mlp, layer.self_attn.kv_cache
            norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
            qkv = ops.rms_gemv(x, norm1.weight, attn.qkv_proj.weight, norm1.eps, False, False)
            a = ops.decode_attention(qkv, rot, kv.k_cache, kv.v_cache, cache_position, counts, i * _COUNT_STRIDE)
            x = ops.gemv_add(a, attn.o_proj.weight, x)
            h = ops.rms_gemv(x, norm2.weight, mlp.gate_up_proj.weight, norm2.eps, True, False)
            x = ops.gemv_add(h, mlp.down_proj.weight, x)
        return ops.rms_gemv(x, self.norm.weight, self.lm_head.weight, self.norm.eps, False, True).view(1, -1)
