"""The int4 prefill's dequantisation on CUDA: tinygemm's packed words -> the bf16 weight, one Triton op that
AOTInductor compiles into the `.so` ahead of the prompt's bf16 matmul.

Why hand-written: the prefill cannot call tinygemm (it is for a few rows; a prompt has hundreds), so it dequantises
each linear per call. Through Inductor, quant_linear.dequantize's unpacking (a permute of eight dims) became a
kernel that gathers every output's word on its own: the 3B int4 prefill took 17.4 ms against bf16's 6.67
(benchmarks/NOTES.md 48). Here a program reads its block of words once, in order, unpacks them in registers,
reorders the codes into the weight's [rows, columns] tile and writes whole rows: 0.5 + 2 bytes per weight moved.

With bf16 scales (the CUDA bundles') the values are quant_linear.dequantize's bit for bit: (q - 8) * scale is exact
in float32 (a 4-bit integer times an 8-bit significand), so only the add rounds, fused or not, and the cast once
more, as there. Float32 scales may differ by that one rounding where the GPU fuses the multiply-add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn
from torch.library import triton_op, wrap_triton

from runner.models.quant_linear import QuantLinear

ROWS_PER_PROGRAM = 4  # blocks of 8 rows: a program writes 32 rows x (32 * T / 2) columns


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
    """Program (rows block b, k block kt): for each of its R8 blocks of 8 rows, the 32 x J words of tinygemm's
    layout at [n8, kt] (quant_linear's docstring: lane 4 r + c, nibble 4 lo + 2 tile + half holds column
    32 j + 16 tile + 8 half + 2 c + lo of row 8 n8 + r) -> W[8 n8 : +8, 32 J kt : +32 J]."""
    b, kt = tl.program_id(0), tl.program_id(1)
    lane = tl.arange(0, 32)[:, None, None]
    j = tl.arange(0, J)[None, :, None]
    nib = tl.arange(0, 8)[None, None, :]
    r = tl.arange(0, 8)
    cols = kt * (32 * J) + tl.arange(0, 32 * J)
    for i in tl.static_range(R8):
        n8 = b * R8 + i
        word = tl.load(q_ptr + ((n8 * (K // (32 * J)) + kt) * 32 + lane) * J + j)  # [32, J, 1], in memory order
        code = (word >> (4 * nib)) & 0xF  # [32, J, 8]
        # (r c)(j)(lo tile half) -> (r)(j tile half c lo): the tile's rows, each row's columns in order
        code = tl.reshape(code, [8, 4, J, 2, 2, 2])
        code = tl.reshape(tl.permute(code, (0, 2, 4, 5, 1, 3)), [8, 32 * J])
        rows = (n8 * 8 + r).to(tl.int64)
        if G >= 32 * J:  # one group per row in this tile: its scale and zero broadcast
            sz = sz_ptr + ((kt * (32 * J) // G) * N + rows) * 2
            scale, zero = tl.load(sz)[:, None].to(tl.float32), tl.load(sz + 1)[:, None].to(tl.float32)
        else:
            sz = sz_ptr + ((cols[None, :] // G) * N + rows[:, None]) * 2
            scale, zero = tl.load(sz).to(tl.float32), tl.load(sz + 1).to(tl.float32)
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
    """torch.export of `module` with its int4 layers dequantising through this op (their hook set for the trace
    alone: the eager model, which the self-check runs, keeps plain torch's, the same values)."""
    layers = [m for m in module.modules() if isinstance(m, QuantLinear)]
    for m in layers:
        m.dequantizer = dequantize
    try:
        return torch.export.export(module, example, dynamic_shapes=dynamic_shapes, strict=False)
    finally:
        for m in layers:
            m.dequantizer = None
