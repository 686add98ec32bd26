"""A linear layer whose weight is stored as 4-bit integers, group-wise along its input dimension (weight-only int4),
in the layout of aten's `_weight_int4pack_mm` (tinygemm's tensor-core int4 matmul, shipped in torch with an
AOTInductor C shim), so the CUDA decode step calls that kernel on the bundle's buffers as they are.

Storage, for a weight W [N, K] in groups of G consecutive input columns (G in 32..256, G | K; N a multiple of 8):
    qweight           int32 [N / 8, K / (T * 16), 32, T / 2]   tinygemm's m16n8k16 "B" layout, T inner k-tiles
    scales_and_zeros  float [K / G, N, 2]                       (the model's dtype: bf16 on the CUDA bundles)
    W[n, k] = (q[n, k] - 8) * scale[k // G, n] + zero[k // G, n]      (asymmetric: min-max over each group)

The layout (`pack` / `unpack`, pure torch, any device): word [n8, kt, lane, j] holds, for the tensor-core lane
`lane` = 4 r + c, row n8 * 8 + r, and the pair of 16-column k-tiles kt * T + 2 j and + 1, eight codes: nibble
4 lo + 2 tile + half is column 16 tile + 8 half + 2 c + lo of that pair. It is what aten's CUDA
`_convert_weight_to_int4pack` writes (tests/cuda compares them bit for bit; tests/export mirrors its loops).

Every prefill (tinygemm is for small M) and the CPU methods dequantise the weight and multiply: in plain torch,
or through `dequantizer` where the export sets one (the CUDA prefill's Triton op, export/kernels_int4.py: Inductor's
kernel for the unpacking gathers each weight's word on its own); the CUDA decode step calls tinygemm.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import BundleError
from runner.models import fp8_linear
from runner.models.fp8_linear import Fp8Linear

LAYOUT = "tinygemm"  # the manifest's quant record names it: older int4 bundles stored another layout
GROUPS = (32, 64, 128, 256)  # what tinygemm's kernels take
N_TILE, K_TILE = 8, 16


def group_for(in_features: int, group_size: int) -> int:
    """The group size a layer of `in_features` inputs gets: `group_size`, or the largest smaller one tinygemm takes
    that divides in_features (the tiny models' 64-wide layers get 64)."""
    for g in sorted((g for g in GROUPS if g <= group_size), reverse=True):
        if in_features % g == 0:
            return g
    raise ValueError(f"int4: {in_features} input features have no group of {'/'.join(map(str, GROUPS))} dividing them")


def inner_k_tiles(in_features: int) -> int:
    """tinygemm's inner k-tiles for K: the most (8: 16-byte loads) whose 16-column tiles divide K."""
    for t in (8, 4, 2):
        if in_features % (t * K_TILE) == 0:
            return t
    raise ValueError(f"int4: {in_features} input features are not a multiple of {2 * K_TILE}")


def check_shape(in_features: int, out_features: int, group_size: int) -> None:
    """Raise ValueError when tinygemm's layout cannot hold a weight of this shape."""
    group_for(in_features, group_size)
    inner_k_tiles(in_features)
    if out_features % N_TILE:
        raise ValueError(f"int4: {out_features} output features are not a multiple of {N_TILE}")


def _tiled(n: int, k: int) -> tuple[int, ...]:
    """[N, K] as (n8, r, kt, j, tile, half, c, lo): row n8 * 8 + r, column kt*T*16 + j*32 + tile*16 + half*8 + 2c + lo."""
    t = inner_k_tiles(k)
    return n // N_TILE, N_TILE, k // (t * K_TILE), t // 2, 2, 2, 4, 2


# nibble 4 lo + 2 tile + half of a word (module docstring); as dims of `_tiled`: (n8, kt, r, c, j, lo, tile, half)
_TO_WORDS = (0, 2, 1, 6, 3, 7, 4, 5)
_FROM_WORDS = (0, 2, 1, 4, 6, 7, 3, 5)


def pack(q: torch.Tensor) -> torch.Tensor:
    """Codes int [N, K] in [0, 15] -> int32 words [N / 8, K / (T * 16), 32, T / 2] (the module docstring)."""
    n, k = q.shape
    nib = q.to(torch.int64).view(_tiled(n, k)).permute(_TO_WORDS)  # (n8, kt, r, c, j, lo, tile, half)
    nib = nib.reshape(n // N_TILE, k // (inner_k_tiles(k) * K_TILE), 32, inner_k_tiles(k) // 2, 8)
    words = (nib << torch.arange(0, 32, 4, device=q.device)).sum(-1)  # disjoint bits: the sum is their OR
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as two's complement


def unpack(qweight: torch.Tensor) -> torch.Tensor:
    """int32 words [N / 8, K / (T * 16), 32, T / 2] -> the codes as int32 [N, K] (pack's inverse)."""
    n8, kt, _, j = qweight.shape
    n, k = n8 * N_TILE, kt * j * 2 * K_TILE
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    nib = (qweight[..., None] >> shifts) & 0xF  # [n8, kt, 32, j, 8]
    t = _tiled(n, k)
    nib = nib.view(t[0], t[2], t[1], t[6], t[3], t[7], t[4], t[5])  # (n8, kt, r, c, j, lo, tile, half)
    return nib.permute(_FROM_WORDS).reshape(n, k)


def dequantize(qweight, scales_and_zeros, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype`: (q - 8) * scale + zero in float32 (one rounding, to dtype, at the end)."""
    groups, n, _ = scales_and_zeros.shape
    q = unpack(qweight).view(n, groups, -1).float() - 8
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, groups, 2]
    return (q * sz[:, :, 0, None] + sz[:, :, 1, None]).reshape(n, -1).to(dtype)


class QuantLinear(nn.Module):
    """nn.Linear's interface over int4 storage (module docstring). The bias, if any, stays in full precision."""

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool, dtype, device=None):
        super().__init__()
        check_shape(in_features, out_features, group_size)
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_for(in_features, group_size)
        t = inner_k_tiles(in_features)
        words = (out_features // N_TILE, in_features // (t * K_TILE), 32, t // 2)
        self.register_buffer("qweight", torch.zeros(words, dtype=torch.int32, device=device))
        sz = (in_features // self.group_size, out_features, 2)
        self.register_buffer("scales_and_zeros", torch.zeros(sz, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        # QuantLinear -> W in the scales' dtype, the same values as `dequantize`; None: plain torch
        self.dequantizer = None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.scales_and_zeros.dtype
        if self.dequantizer is not None and dtype == self.scales_and_zeros.dtype:
            return self.dequantizer(self)
        return dequantize(self.qweight, self.scales_and_zeros, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), self.bias)

    def tinygemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] through tinygemm (small M: the decode step) when x is bf16 on CUDA; otherwise (the
        CPU, through Triton's interpreter in the tests; fp32) the dequantised matmul, which tinygemm computes."""
        if not (x.is_cuda and x.dtype == torch.bfloat16 and self.scales_and_zeros.dtype == torch.bfloat16):
            return self(x)
        # contiguous: tinygemm checks it, and a compiled graph may hand it a view's strides
        y = torch.ops.aten._weight_int4pack_mm(x.contiguous(), self.qweight, self.group_size, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int4 group={self.group_size}"


def few_rows(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """lin(x) where x has a few rows (a decode step: one token per sequence): an int4 layer through tinygemm, which
    reads the codes once, instead of a dequantised copy of the whole weight per call."""
    if isinstance(lin, QuantLinear):
        return lin.tinygemm(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], lin.out_features)
    return lin(x)


def quantized_names(model: nn.Module, patterns: list[str]) -> list[str]:
    """The model's linear modules (nn.Linear, QuantLinear, Fp8Linear) whose names match one of the fnmatch
    `patterns`, in order."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear | QuantLinear | Fp8Linear) and any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]


def swap_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def check_layout(record: dict) -> None:
    """Raise BundleError for a quant record of another layout than this runner reads (int4 bundles exported
    before the codes were stored in tinygemm's layout: the older "planes"; fp8: fp8_linear.check_layout)."""
    if record.get("scheme") == "fp8":
        fp8_linear.check_layout(record)
        return
    if record.get("layout") != LAYOUT:
        raise BundleError(
            f"its int4 codes are in the {record.get('layout', 'planes')!r} layout of an older exporter, not "
            f"{LAYOUT!r}: export the bundle again"
        )


def use_quant_layout(model: nn.Module, record: dict) -> list[str]:
    """Replace the modules the manifest's quant `record` names by empty QuantLinear ones of the same shapes (on the
    same device, meta included), ready for a bundle's state dict: how the eager reference rebuilds an int4 model
    (an fp8 record: Fp8Linear ones, fp8_linear.use_layout). A record of another layout raises BundleError
    (`check_layout`)."""
    if record.get("scheme") == "fp8":
        return fp8_linear.use_layout(model, record)
    check_layout(record)
    names = quantized_names(model, record["modules"])
    for name in names:
        lin = model.get_submodule(name)
        if isinstance(lin, nn.Linear):
            w = lin.weight
            new = QuantLinear(
                lin.in_features, lin.out_features, record["group_size"], lin.bias is not None, w.dtype, w.device
            )
            swap_module(model, name, new)
    return names
