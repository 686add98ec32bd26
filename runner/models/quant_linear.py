"""A linear layer whose weight is stored as 4-bit integers, group-wise along its input dimension (weight-only int4).

Storage, for a weight W [N, K] in groups of G consecutive input columns (G a power of two, 8 <= G, G | K):
    qweight  int32 [N, K / 8]   eight 4-bit codes q in [0, 15] per word
    scales   float [N, K / G]   (the model's dtype: bf16 on the CUDA bundles, fp32 on CPU)
    offsets  float [N, K / G]
    W[n, k] = q[n, k] * scales[n, k // G] + offsets[n, k // G]       (asymmetric: min-max over each group)

Word order ("planes"): the G / 8 words of group g hold its G columns as 8 planes of G / 8 columns each; nibble i
(bits 4i..4i+3) of word j holds column g*G + i*(G/8) + j. A GEMV then multiplies each plane by a contiguous
slice of x, and a GEMM by a contiguous slice of X's columns, without interleaving nibbles
(runner/export/kernels_int4.py). `runner/export/quant.py` quantises and packs; this module only unpacks.

Here the weight is dequantised in plain torch (the CPU methods and the CUDA prefill, where Inductor fuses the
unpacking into one kernel ahead of the matmul); the CUDA decode step calls the int4 GEMV kernels on these buffers.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn.functional as F
from torch import nn

NIBBLES = 8  # 4-bit codes per int32 word


def group_for(in_features: int, group_size: int) -> int:
    """The group size a layer of `in_features` inputs gets: `group_size`, or the largest power of two below it
    that divides in_features (at least 8, one word per plane) — the tiny models' 64-wide layers get 64."""
    g = group_size
    while g >= NIBBLES and in_features % g:
        g //= 2
    if g < NIBBLES:
        raise ValueError(f"int4: {in_features} input features have no power-of-two group of at least {NIBBLES}")
    return g


def unpack(qweight: torch.Tensor, group: int) -> torch.Tensor:
    """int32 [N, K / 8] -> the 4-bit codes as int32 [N, K], in column order (the planes' inverse)."""
    n, words = qweight.shape
    wpg = group // NIBBLES
    w = qweight.view(n, words // wpg, 1, wpg)  # [N, groups, 1, words per group]
    shifts = torch.arange(0, 4 * NIBBLES, 4, dtype=torch.int32, device=qweight.device).view(1, 1, NIBBLES, 1)
    return ((w >> shifts) & 0xF).reshape(n, words * NIBBLES)  # [N, groups, plane, word] -> columns


def dequantize(qweight, scales, offsets, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype`: q * scale + offset computed in float32 (one rounding, to dtype, at the end)."""
    n, groups = scales.shape
    q = unpack(qweight, qweight.shape[1] * NIBBLES // groups).view(n, groups, -1).float()
    w = q * scales.float()[:, :, None] + offsets.float()[:, :, None]
    return w.reshape(n, -1).to(dtype)


class QuantLinear(nn.Module):
    """nn.Linear's interface over int4 storage (module docstring). The bias, if any, stays in full precision."""

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool, dtype, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_for(in_features, group_size)
        groups = in_features // self.group_size
        self.register_buffer(
            "qweight", torch.zeros(out_features, in_features // NIBBLES, dtype=torch.int32, device=device)
        )
        self.register_buffer("scales", torch.zeros(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("offsets", torch.zeros(out_features, groups, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.offsets, dtype or self.scales.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int4 group={self.group_size}"


def quantized_names(model: nn.Module, patterns: list[str]) -> list[str]:
    """The model's nn.Linear / QuantLinear modules whose names match one of the fnmatch `patterns`, in order."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear | QuantLinear) and any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]


def swap_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def use_quant_layout(model: nn.Module, patterns: list[str], group_size: int) -> list[str]:
    """Replace the matching nn.Linear modules by empty QuantLinear ones of the same shapes (on the same device,
    meta included), ready for a bundle's state dict: how the eager reference rebuilds an int4 model."""
    names = quantized_names(model, patterns)
    for name in names:
        lin = model.get_submodule(name)
        if isinstance(lin, nn.Linear):
            w = lin.weight
            new = QuantLinear(lin.in_features, lin.out_features, group_size, lin.bias is not None, w.dtype, w.device)
            swap_module(model, name, new)
    return names
