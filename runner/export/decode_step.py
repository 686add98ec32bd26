"""The decoder at one position, as its own method (`text_decoder_step`): a static shape for the decode loop.

The dynamic `text_decoder` serves prefill and decode alike, so its matmuls are the general cuBLAS ones. The step
method is the same decoder (the same parameters: the runtime binds one copy of the weights and one KV cache to
both methods) exported for exactly one token. On CUDA it runs hand-written kernels: `kernels.py`'s GEMVs (RMSNorm
folded in, residual adds and SiLU(gate) * up in their epilogues) and `kernels_attention.py`'s one attention kernel
per layer (RoPE, the cache write, attention over the valid positions only). A linear layer quantised to int4
(`QuantLinear`, `--quant int4`) is aten's `_weight_int4pack_mm` (tinygemm, on the bundle's buffers as stored), its
RMSNorm, residual add and SiLU(gate) * up plain torch around it, which Inductor fuses into one kernel each: our own
int4 GEMVs were instruction-bound, slower than tinygemm (benchmarks/NOTES.md has the measurements). An fp8 layer
(`Fp8Linear`, `--quant fp8`) runs the same GEMV kernels on its e4m3 codes, each row's sum scaled once: the step
reads a byte per weight. On CPU it is the plain decoder at S = 1.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.models.fp8_linear import Fp8Linear
from runner.models.quant_linear import QuantLinear, few_rows
from runner.models.voxtral import LanguageModel, RMSNorm, rope_inv_freq, silu_mul
from runner.models.voxtral_config import TextConfig


class DecodeStep(nn.Module):
    """embeds [1, 1, dim], cache_position [1] -> logits [1, vocab] float32; writes the KV cache at that position.
    Parameter names are the text_decoder's (`layers.*`, `norm`, `lm_head`), so one weights file serves both."""

    def __init__(self, c: TextConfig, lm: LanguageModel, pdl: bool = False):
        """`pdl`: the kernels wait for the kernel before them (programmatic dependent launch; sm_90+)."""
        super().__init__()
        from runner.export import kernels, kernels_attention  # noqa: F401  (register torch.ops.voxtral.*; Triton)

        self.c, self.pdl = c, pdl
        self.layers, self.norm, self.lm_head = lm.model.layers, lm.model.norm, lm.lm_head

    def forward(self, embeds: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        c, d, ops, pdl = self.c, self.c.head_dim, torch.ops.voxtral, self.pdl
        x = embeds.reshape(c.dim)
        # [2, D] cos, sin: one position, all layers
        cos, sin = ops.rope_table(cache_position, rope_inv_freq(d, c.rope_theta, embeds.device), embeds)
        # each layer's attention counts its finished splits in its own slots, a multiple of 16 (every layer's slice
        # is aligned alike, so one compiled kernel serves all); zeroed once per step, one small kernel
        slots = -(-c.n_kv_heads // 16) * 16
        counters = torch.zeros(len(self.layers) * slots, dtype=torch.int32, device=embeds.device)
        for i, layer in enumerate(self.layers):
            attn, mlp, kv = layer.self_attn, layer.mlp, layer.self_attn.kv_cache
            norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
            qkv = self._rms_gemv(x, norm1, attn.qkv_proj)
            # RoPE, this position's cache write and the attention in one kernel
            a = ops.decode_attention(qkv, cos, sin, kv.k_cache, kv.v_cache, cache_position, counters, i * slots, pdl)
            x = self._gemv_add(a, attn.o_proj, x)
            h = self._rms_gemv(x, norm2, mlp.gate_up_proj, glu=True)
            x = self._gemv_add(h, mlp.down_proj, x)
        return self._rms_gemv(x, self.norm, self.lm_head, out_f32=True).view(1, -1)

    def _rms_gemv(self, x, norm: RMSNorm, lin: nn.Module, glu: bool = False, out_f32: bool = False) -> torch.Tensor:
        ops, pdl = torch.ops.voxtral, self.pdl
        if fp8_kernel(lin):
            return ops.rms_gemv_fp8(x, norm.weight, lin.qweight, lin.weight_scale, norm.eps, glu, out_f32, pdl)
        if isinstance(lin, QuantLinear | Fp8Linear):
            y = few_rows(lin, norm(x))
            if glu:
                return silu_mul(y)
            return y.float() if out_f32 else y
        return ops.rms_gemv(x, norm.weight, lin.weight, norm.eps, glu, out_f32, pdl)

    def _gemv_add(self, x, lin: nn.Module, residual: torch.Tensor) -> torch.Tensor:
        ops, pdl = torch.ops.voxtral, self.pdl
        if fp8_kernel(lin):
            return ops.gemv_add_fp8(x, lin.qweight, lin.weight_scale, residual, pdl)
        if isinstance(lin, QuantLinear | Fp8Linear):
            return residual + few_rows(lin, x)
        return ops.gemv_add(x, lin.weight, residual, pdl)


def fp8_kernel(lin: nn.Module) -> bool:
    """Whether the GEMV kernels serve this fp8 layer: they have no bias epilogue (the Voxtral decoder has none)."""
    return isinstance(lin, Fp8Linear) and lin.bias is None
