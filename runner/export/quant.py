"""Weight-only quantisation at export: int4 (`--quant int4`: round-to-nearest, group-wise, asymmetric, below) and
fp8 (`--quant fp8`: e4m3 with a float32 scale per output channel, runner/models/fp8_linear.py; an FP8 checkpoint's
layers are stored as the checkpoint holds them, the others quantised here). The same layers either way.

- **Groups of 128 input columns** (`GROUP_SIZE`; a layer whose width 128 does not divide takes the largest of
  tinygemm's 32, 64 that does, `quant_linear.group_for`): a scale and a zero per 128 weights cost 4 bytes per 64
  bytes of codes in bf16 (6%), and 128 is what int4 LLM checkpoints commonly use.
- **Asymmetric (min-max), not symmetric:** each group's [min, max] maps onto all 16 codes, W = (q - 8) * scale +
  zero (tinygemm's form: the zero is the group's middle). Symmetric codes waste part of the range whenever a
  group's min and max differ in magnitude, for no saving in the kernel; the zero adds 2 bytes per group.
- **Scales and zeros in the model's dtype** (bf16 on CUDA, fp32 on CPU); the codes are chosen against the
  rounded scale and zero, so the stored values are exactly what the dequantised reference multiplies.
- **What is quantised:** the decoder's linear layers, which the decode step streams once per token (Voxtral's
  qkv/o/gate_up/down and lm_head: 3.6 of its 3.8 GB per token in bf16). What is not: the token embedding (a
  gather of one row per token), the audio encoder and projector (run once per 30 s, compute-bound; int4 saves
  them nothing and costs accuracy), norms, Whisper's tied output projection (the embedding itself) and its
  cross-attention K/V projections (run in the audio encoder).

The layout (tinygemm's, so the CUDA decode step calls aten's `_weight_int4pack_mm` on it) is in
`runner/models/quant_linear.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.errors import ExportError
from runner.export.registry import ExportFamily
from runner.models import fp8_linear
from runner.models.fp8_linear import Fp8Linear
from runner.models.quant_linear import LAYOUT, QuantLinear, check_shape, pack, quantized_names, swap_module

GROUP_SIZE = 128
LEVELS = 15  # codes 0..15


def quantize(w: torch.Tensor, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (codes int32 [N, K], scales_and_zeros [K / group, N, 2] in dtype); min-max per group."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)
    scales = ((hi - lo) / LEVELS).clamp_min(torch.finfo(torch.float32).tiny).to(dtype)  # a constant group: any scale
    zeros = (lo + 8 * scales.float()).to(dtype)  # code 0 is lo: (0 - 8) * scale + zero
    s, z = scales.float()[:, :, None], zeros.float()[:, :, None]
    q = torch.round((wg - z) / s + 8).clamp_(0, LEVELS).to(torch.int32)
    return q.reshape(n, k), torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()


def quantize_linear(lin: nn.Linear, group_size: int = GROUP_SIZE) -> QuantLinear:
    """An nn.Linear -> its QuantLinear (same device; scales in the weight's dtype), bias kept as it is."""
    w = lin.weight.detach()
    out = QuantLinear(lin.in_features, lin.out_features, group_size, lin.bias is not None, w.dtype, w.device)
    q, sz = quantize(w, out.group_size, w.dtype)
    with torch.no_grad():
        out.qweight.copy_(pack(q))
        out.scales_and_zeros.copy_(sz)
        if lin.bias is not None:
            out.bias.copy_(lin.bias)
    return out


def apply_quant(
    model: nn.Module, family: ExportFamily, quant: str, group_size: int = GROUP_SIZE, stored: dict | None = None
) -> dict | None:
    """Quantise the family's decoder linears (its `quant_modules`) in place (`quant` "int4" or "fp8"; "none" leaves
    the model as it is) and return the manifest's `quant` record, which the eager reference rebuilds the layout
    from. `stored`: an FP8 checkpoint's (codes, scales) by module name, which fp8 keeps as they are."""
    if quant == "none":
        return None
    if quant not in ("int4", "fp8"):
        raise ExportError(f"--quant {quant}: choose from none, int4, fp8")
    patterns = list(family.quant_modules)
    names = quantized_names(model, patterns)
    if not names:
        raise ExportError(f"--quant {quant}: no linear layer of the {family.name} model matches {patterns}")
    if quant == "fp8":
        return apply_fp8(model, names, patterns, stored or {})
    for name in names:
        lin = model.get_submodule(name)
        if isinstance(lin, nn.Linear):
            try:
                check_shape(lin.in_features, lin.out_features, group_size)
            except ValueError as e:
                raise ExportError(f"--quant int4: {name}: {e}") from None
            swap_module(model, name, quantize_linear(lin, group_size))
    return {
        "scheme": "int4",
        "group_size": group_size,
        "symmetric": False,
        "layout": LAYOUT,
        "scale_dtype": str(next(model.get_submodule(n) for n in names).scales_and_zeros.dtype).removeprefix("torch."),
        "modules": patterns,
        "n_linear": len(names),
    }


def apply_fp8(model: nn.Module, names: list[str], patterns: list[str], stored: dict) -> dict:
    """The linears `names` as Fp8Linear: a stored (checkpoint's) layer as it is, the others quantised per channel."""
    kept = 0
    for name in names:
        lin = model.get_submodule(name)
        if isinstance(lin, nn.Linear):
            try:
                swap_module(model, name, Fp8Linear.from_linear(lin, stored.get(name)))
            except ValueError as e:  # a stored layer of another shape than the model's: the loader's to prevent
                raise ExportError(f"--quant fp8: {name}: {e}") from None
            kept += name in stored
    return {
        "scheme": "fp8",
        "format": str(fp8_linear.FP8).removeprefix("torch."),
        "symmetric": True,
        "layout": fp8_linear.LAYOUT,
        "scale_dtype": "float32",
        "modules": patterns,
        "n_linear": len(names),
        "from_checkpoint": kept,  # layers whose codes and scales are the checkpoint's, as it stores them
    }
