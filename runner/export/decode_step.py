"""The decoder at one position, as its own method (`text_decoder_step`): a static shape for the decode loop.

The dynamic `text_decoder` serves prefill and decode alike, so its matmuls are the general cuBLAS ones. The step
method is the same decoder (the same parameters: the runtime binds one copy of the weights and one KV cache to
both methods) exported for exactly one token. On CUDA it runs the hand-written kernels of `kernels.py`: RMSNorm
folded into the GEMVs, residual adds and SiLU(gate) * up in their epilogues, attention over the valid positions
only with rope and the cache write folded in, and each kernel prefetching part of the next one's weights into L2.
On CPU it is the plain decoder at S = 1.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.export.config import TextConfig
from runner.export.model import LanguageModel, rope


class DecodeStep(nn.Module):
    """embeds [1, 1, dim], cache_position [1] -> logits [1, vocab] float32; writes the KV cache at that position.
    Parameter names are the text_decoder's (`layers.*`, `norm`, `lm_head`), so one weights file serves both."""

    def __init__(self, c: TextConfig, lm: LanguageModel):
        super().__init__()
        from runner.export import kernels  # noqa: F401  (registers torch.ops.voxtral.*; needs Triton)

        self.c = c
        self.layers, self.norm, self.lm_head = lm.model.layers, lm.model.norm, lm.lm_head

    def forward(self, embeds: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        c, d, ops = self.c, self.c.head_dim, torch.ops.voxtral
        x = embeds.reshape(c.dim)
        cos, sin = (t.reshape(d) for t in rope(cache_position, d, c.rope_theta, embeds.dtype))  # all layers
        layers = list(self.layers)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
            after = layers[i + 1].self_attn.qkv_proj.weight if i + 1 < len(layers) else self.lm_head.weight
            o_w, gate_up_w, down_w = attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight
            qkv = ops.rms_gemv(x, norm1.weight, attn.qkv_proj.weight, norm1.eps, False, False, *_prefetch("qkv", o_w))
            kv = attn.kv_cache
            a = ops.decode_attention(
                qkv, cos, sin, kv.k_cache, kv.v_cache, cache_position, *_prefetch("attention", o_w)
            )
            x = ops.gemv_add(a, o_w, x, *_prefetch("o_proj", gate_up_w, parts=2))
            h = ops.rms_gemv(x, norm2.weight, gate_up_w, norm2.eps, True, False, *_prefetch("gate_up", down_w))
            x = ops.gemv_add(h, down_w, x, *_prefetch("down", after))
        head = self.lm_head.weight
        first = layers[0].self_attn.qkv_proj.weight  # the next token's
        return ops.rms_gemv(x, self.norm.weight, head, self.norm.eps, False, True, *_prefetch("lm_head", first)).view(
            1, -1
        )


def _prefetch(kind: str, target: torch.Tensor, parts: int = 1) -> tuple:
    """The prefetch arguments of one kernel: its next weights and how many bytes of them (`PREFETCH_BYTES`)."""
    from runner.export.kernels import PREFETCH_BYTES

    return target, PREFETCH_BYTES[kind], parts
