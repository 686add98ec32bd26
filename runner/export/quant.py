"""Weight-only int4 quantisation at export (`--quant int4`): round-to-nearest, group-wise, asymmetric.

- **Groups of 128 input columns** (`GROUP_SIZE`; a layer whose width 128 does not divide takes the largest power of
  two that does, `quant_linear.group_for`): a scale and an offset per 128 weights cost 4 bytes per 64 bytes of
  codes in bf16 (6%), and 128 is what int4 LLM checkpoints commonly use.
- **Asymmetric (min-max), not symmetric:** each group's [min, max] maps onto all 16 codes, W = q * scale + offset.
  Symmetric codes waste part of the range whenever a group's min and max differ in magnitude, for no saving: the
  GEMV applies an offset per group as one multiply-add with the sum of x over the group, shared by the program's
  rows, so the inner loop is the same as symmetric's; the offset adds 2 bytes per group.
- **Scales and offsets in the model's dtype** (bf16 on CUDA, fp32 on CPU); the codes are chosen against the
  rounded scale and offset, so the stored values are exactly what the dequantised reference multiplies.
- **What is quantised:** the decoder's linear layers, which the decode step streams once per token (Voxtral's
  qkv/o/gate_up/down and lm_head: 3.6 of its 3.8 GB per token in bf16). What is not: the token embedding (a
  gather of one row per token), the audio encoder and projector (run once per 30 s, compute-bound; int4 saves
  them nothing and costs accuracy), norms, Whisper's tied output projection (the embedding itself) and its
  cross-attention K/V projections (run in the audio encoder).

The layout (planes of nibbles, int32 words) is in `runner/models/quant_linear.py`; the kernels that read it in
`runner/export/kernels_int4.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.errors import ExportError
from runner.models.quant_linear import NIBBLES, QuantLinear, group_for, quantized_names, swap_module, unpack

GROUP_SIZE = 128
LEVELS = 15  # codes 0..15
# Per family, the modules `--quant int4` replaces (fnmatch patterns over the model's module names).
PATTERNS = {
    "voxtral": ["language_model.model.layers.*", "language_model.lm_head"],
    "whisper": [
        "decoder.layers.*.self_attn.*",
        "decoder.layers.*.encoder_attn.q_proj",
        "decoder.layers.*.encoder_attn.out_proj",
        "decoder.layers.*.fc1",
        "decoder.layers.*.fc2",
    ],
}


def pack(q: torch.Tensor, group: int) -> torch.Tensor:
    """Codes int [N, K] in [0, 15] -> int32 [N, K / 8] in the planes layout (quant_linear's docstring)."""
    n, k = q.shape
    planes = q.to(torch.int64).view(n, k // group, NIBBLES, group // NIBBLES)  # [N, groups, plane, word]
    shifts = torch.arange(0, 4 * NIBBLES, 4, device=q.device).view(1, 1, NIBBLES, 1)
    words = (planes << shifts).sum(dim=2)  # the nibbles are disjoint bits: the sum is their OR
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).reshape(n, -1)  # as two's complement


def quantize(w: torch.Tensor, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> (codes int32 [N, K], scales, offsets [N, K / group] in dtype); min-max per group."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)
    scales = ((hi - lo) / LEVELS).clamp_min(torch.finfo(torch.float32).tiny).to(dtype)  # a constant group: any scale
    offsets = lo.to(dtype)
    s, o = scales.float()[:, :, None], offsets.float()[:, :, None]
    q = torch.round((wg - o) / s).clamp_(0, LEVELS).to(torch.int32)
    return q.reshape(n, k), scales, offsets


def quantize_linear(lin: nn.Linear, group_size: int = GROUP_SIZE) -> QuantLinear:
    """An nn.Linear -> its QuantLinear (same device; scales in the weight's dtype), bias kept as it is."""
    w = lin.weight.detach()
    out = QuantLinear(lin.in_features, lin.out_features, group_size, lin.bias is not None, w.dtype, w.device)
    q, scales, offsets = quantize(w, out.group_size, w.dtype)
    with torch.no_grad():
        out.qweight.copy_(pack(q, out.group_size))
        out.scales.copy_(scales)
        out.offsets.copy_(offsets)
        if lin.bias is not None:
            out.bias.copy_(lin.bias)
    return out


def tinygemm_operands(lin: QuantLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """A QuantLinear as aten's int4pack matmuls take it (`_weight_int4pack_mm`: tinygemm's tensor-core kernels on
    CUDA; `..._for_cpu` its CPU twin): the codes int32 [N, K] in column order, and scales_and_zeros
    [K / G, N, 2] in the scales' dtype. Those kernels dequantise (q - 8) * scale + zero, so zero = offset + 8 *
    scale, rounded once to the scales' dtype (in bf16 that rounding is the format's only loss against ours).
    The packing is the caller's: `_convert_weight_to_int4pack` takes the codes two to a byte on CUDA,
    `..._for_cpu` as they are."""
    s, o = lin.scales.float(), lin.offsets.float()
    zeros = o + 8 * s
    sz = torch.stack([s, zeros], dim=-1).transpose(0, 1).contiguous().to(lin.scales.dtype)
    return unpack(lin.qweight, lin.group_size), sz


def apply_quant(model: nn.Module, family: str, quant: str, group_size: int = GROUP_SIZE) -> dict | None:
    """Quantise the family's decoder linears in place (`quant` "int4"; "none" leaves the model as it is) and
    return the manifest's `quant` record, which the eager reference rebuilds the layout from."""
    if quant == "none":
        return None
    if quant != "int4":
        raise ExportError(f"--quant {quant}: choose from none, int4")
    patterns = PATTERNS[family]
    names = quantized_names(model, patterns)
    if not names:
        raise ExportError(f"--quant int4: no linear layer of the {family} model matches {patterns}")
    for name in names:
        lin = model.get_submodule(name)
        if isinstance(lin, nn.Linear):
            try:
                group_for(lin.in_features, group_size)
            except ValueError as e:
                raise ExportError(f"--quant int4: {name}: {e}") from None
            swap_module(model, name, quantize_linear(lin, group_size))
    return {
        "scheme": "int4",
        "group_size": group_size,
        "symmetric": False,
        "scale_dtype": str(next(model.get_submodule(n) for n in names).scales.dtype).removeprefix("torch."),
        "modules": patterns,
        "n_linear": len(names),
    }
