"""The int4 prefill's linear layers on CUDA: tinygemm's packed words read by a Triton kernel that AOTInductor
compiles into the `.so` (the prefill cannot call tinygemm: it is for a few rows; a prompt has hundreds).

`int4_dequantize` writes the bf16 weight, then the prompt's bf16 matmul reads it. Through Inductor,
quant_linear.dequantize's unpacking (a permute of eight dims) became a kernel that gathers every output's word on
its own, far slower than the bf16 prefill. Here a program reads its block of words once, in order, unpacks them in
registers, reorders the codes into the weight's [rows, columns] tile and writes whole rows: 0.5 + 2 bytes per
weight moved. A Triton matmul that dequantised inside its K loop instead was measured slower at every size and
tile, and removed.

With bf16 scales (the CUDA bundles') the values are quant_linear.dequantize's bit for bit: (q - 8) * scale is exact
in float32 (a 4-bit integer times an 8-bit significand), so only the add rounds, and the cast once more, as there.
Float32 scales may differ by that one rounding where the GPU fuses the multiply-add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn
from torch.library import triton_op, wrap_triton

from runner.models.quant_linear import QuantLinear

ROWS_PER_PROGRAM = 4  # blocks of 8 rows: a dequantising program writes 32 rows x (32 * T / 2) columns


@triton.jit
def _codes(q_ptr, n8, kt, KT: tl.constexpr, J: tl.constexpr):
    """The codes of tinygemm's words at [n8, kt] for the row blocks n8 [B] -> int32 [8 B, 32 J], row i being the
    weight's row 8 n8[i // 8] + i % 8, its columns in order. Word [n8, kt, lane, j] (quant_linear's docstring),
    lane 4 r + c, nibble 4 lo + 2 tile + half holds column 32 j + 16 tile + 8 half + 2 c + lo of the K block kt,
    row 8 n8 + r."""
    lane = tl.arange(0, 32)[None, :, None, None]
    j = tl.arange(0, J)[None, None, :, None]
    nib = tl.arange(0, 8)[None, None, None, :]
    word = tl.load(q_ptr + ((n8[:, None, None, None] * KT + kt) * 32 + lane) * J + j)  # [B, 32, J, 1]: in order
    code = (word >> (4 * nib)) & 0xF  # [B, 32, J, 8]
    # (b)(r c)(j)(lo tile half) -> (b r)(j tile half c lo): the tile's rows, each row's columns in order
    code = tl.reshape(code, [n8.shape[0], 8, 4, J, 2, 2, 2])
    return tl.reshape(tl.permute(code, (0, 1, 3, 5, 6, 2, 4)), [8 * n8.shape[0], 32 * J])


@triton.jit
def _scales(sz_ptr, kt, cols, rows, N, G: tl.constexpr, BK: tl.constexpr):
    """Scale and zero, float32, for the weight's rows [R] at the K block kt's columns `cols` [BK] (in the block):
    [R, 1] where the block lies in one group (one load per row), else [R, BK]."""
    if G >= BK:
        sz = sz_ptr + ((kt * BK // G) * N + rows[:, None]) * 2
    else:
        sz = sz_ptr + (((kt * BK + cols[None, :]) // G) * N + rows[:, None]) * 2
    return tl.load(sz).to(tl.float32), tl.load(sz + 1).to(tl.float32)


@triton.jit
def _dequant_kernel(
    q_ptr,
    sz_ptr,
    out_ptr,
    N,
    K: tl.constexpr,
    J: tl.constexpr,  # words per lane: tinygemm's inner k-tiles / 2
    G: tl.constexpr,
    R8: tl.constexpr,
):
    """Program (rows block b, k block kt): its R8 blocks of 8 rows -> W[8 R8 b : +8 R8, 32 J kt : +32 J]."""
    b, kt = tl.program_id(0), tl.program_id(1)
    cols = kt * (32 * J) + tl.arange(0, 32 * J)
    for i in tl.static_range(R8):  # a block of 8 rows at a time (the fastest measured)
        n8 = b * R8 + i + tl.arange(0, 1)
        code = _codes(q_ptr, n8, kt, K // (32 * J), J)  # [8, 32 J]
        rows = (b * R8 + i) * 8 + tl.arange(0, 8).to(tl.int64)
        scale, zero = _scales(sz_ptr, kt, tl.arange(0, 32 * J), rows, N, G, 32 * J)
        w = (code.to(tl.float32) - 8.0) * scale + zero
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], w.to(out_ptr.dtype.element_ty))


def _launch(qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    n8, kt, _, j = qweight.shape
    n, k = n8 * 8, kt * j * 32
    out = torch.empty(n, k, dtype=scales_and_zeros.dtype, device=qweight.device)
    r8 = next(r for r in (ROWS_PER_PROGRAM, 2, 1) if n8 % r == 0)
    wrap_triton(_dequant_kernel)[(n8 // r8, kt)](
        qweight, scales_and_zeros, out, n, K=k, J=j, G=group_size, R8=r8, num_warps=4
    )
    return out


@triton_op("voxtral::int4_dequantize", mutates_args={})
def int4_dequantize(qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """qweight int32 [N / 8, K / (T * 16), 32, T / 2] (tinygemm's layout), scales_and_zeros [K / G, N, 2] ->
    W [N, K] in scales_and_zeros' dtype: quant_linear.dequantize's values."""
    return _launch(qweight, scales_and_zeros, group_size)


def dequantize(lin: QuantLinear) -> torch.Tensor:
    """The QuantLinear hook (`QuantLinear.dequantizer`): this op, as one node in the exported graph."""
    return torch.ops.voxtral.int4_dequantize(lin.qweight, lin.scales_and_zeros, lin.group_size)


def export_dequantizing(module: nn.Module, example, dynamic_shapes) -> torch.export.ExportedProgram:
    """torch.export of `module` with its int4 layers dequantised through int4_dequantize, then the matmul. The hook
    is set for the trace alone: the eager model, which the self-check runs, keeps plain torch's (the same values).
    Every row count takes the op (a branch on the dynamic length would specialise it); the lm_head's last row goes
    to tinygemm, not through forward."""
    layers = [m for m in module.modules() if isinstance(m, QuantLinear)]
    for m in layers:
        m.dequantizer = dequantize
    try:
        return torch.export.export(module, example, dynamic_shapes=dynamic_shapes, strict=False)
    finally:
        for m in layers:
            m.dequantizer = None
