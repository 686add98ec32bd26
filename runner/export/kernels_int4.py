"""The int4 prefill's linear layers on CUDA: tinygemm's packed words read by Triton kernels that AOTInductor compiles
into the `.so` (the prefill cannot call tinygemm: it is for a few rows; a prompt has hundreds).

`int4_dequantize` writes the bf16 weight, then the prompt's bf16 matmul reads it. Through Inductor,
quant_linear.dequantize's unpacking (a permute of eight dims) became a kernel that gathers every output's word on
its own: the 3B int4 prefill took 17.4 ms against bf16's 6.67 (benchmarks/NOTES.md 48). Here a program reads its
block of words once, in order, unpacks them in registers, reorders the codes into the weight's [rows, columns] tile
and writes whole rows: 0.5 + 2 bytes per weight moved (2.64 ms for the 3B's 30 layers, NOTES 55).

`int4_linear` skips that copy: a matmul that dequantises each [N tile, K block] of words inside its K loop and
tl.dot's it with the rows' x tile (0.5 bytes per weight read; the dequantisation repeated once per M tile).

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

ROWS_PER_PROGRAM = 4  # blocks of 8 rows: a dequantising program writes 32 rows x (32 * T / 2) columns


@triton.jit
def _codes(q_ptr, n8, kt, KT: tl.constexpr, J: tl.constexpr, WEIGHT_ORDER: tl.constexpr):
    """The codes of tinygemm's words at [n8, kt] for the row blocks n8 [B] -> int32 [8 B, 32 J], row i being the
    weight's row 8 n8[i // 8] + i % 8. Word [n8, kt, lane, j] (quant_linear's docstring), lane 4 r + c, nibble
    4 lo + 2 tile + half holds column 32 j + 16 tile + 8 half + 2 c + lo of the K block kt, row 8 n8 + r.
    WEIGHT_ORDER: the columns in order (a permute: codes move between threads); else in the words' order, column
    `_word_order_columns(J)[i]` at i, each thread's codes where it loaded them (a reshape: no data moves)."""
    lane = tl.arange(0, 32)[None, :, None, None]
    j = tl.arange(0, J)[None, None, :, None]
    nib = tl.arange(0, 8)[None, None, None, :]
    word = tl.load(q_ptr + ((n8[:, None, None, None] * KT + kt) * 32 + lane) * J + j)  # [B, 32, J, 1]: in order
    if WEIGHT_ORDER:
        code = (word >> (4 * nib)) & 0xF  # [B, 32, J, 8]
        # (b)(r c)(j)(lo tile half) -> (b r)(j tile half c lo): the tile's rows, each row's columns in order
        code = tl.reshape(code, [n8.shape[0], 8, 4, J, 2, 2, 2])
        return tl.reshape(tl.permute(code, (0, 1, 3, 5, 6, 2, 4)), [8 * n8.shape[0], 32 * J])
    # nibble i of the last dim = 4 tile + 2 half + lo: its columns come in pairs (x's loads 4 bytes, not 2)
    code = (word >> (4 * (4 * (nib % 2) + nib // 2))) & 0xF
    return tl.reshape(code, [8 * n8.shape[0], 32 * J])


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
def _word_order_columns(J: tl.constexpr):
    """The K block's column at each position of `_codes(..., WEIGHT_ORDER=False)`: (c)(j)(tile half lo)."""
    i = tl.arange(0, 32 * J)
    c, j, nib = i // (8 * J), (i // 8) % J, i % 8
    # pairs of columns (lo): 4-byte loads of x, where Triton's analysis of the arithmetic would see 2-byte ones
    return tl.max_contiguous(tl.multiple_of(32 * j + 8 * (nib // 2) + 2 * c + nib % 2, 2), 2)


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
    for i in tl.static_range(R8):  # a block of 8 rows at a time, as measured (NOTES 55)
        n8 = b * R8 + i + tl.arange(0, 1)
        code = _codes(q_ptr, n8, kt, K // (32 * J), J, True)  # [8, 32 J]
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


def linear_config(n: int, k: int) -> tuple[int, int, int, int, bool]:
    """(BLOCK_M rows, BLOCK_N output features, num_warps, num_stages, weight_order) for a weight [N, K]; the K block
    is one of tinygemm's (32 T / 2 columns: 128 for the 3B). By the weight's shape alone: the row count is dynamic
    in the exported prefill. Each M tile dequantises its N tile's words again on the CUDA cores (≈ 7 instructions
    a weight, compiled for sm_90), so tall tiles: at 128 x 128 x 128 that issue is about half the tensor cores'
    time per K step, and 8 warps hold it without spilling. weight_order=False gathers x's columns in the words'
    order instead of reordering the codes (`_codes`). Unmeasured on a GPU: `benchmarks/int4_kernels.py
    --int4-tiles` sweeps the alternatives."""
    return 128, min(128, max(16, triton.next_power_of_2(n))), 8, 3, True


@triton.jit
def _linear_kernel(
    x_ptr,
    q_ptr,
    sz_ptr,
    out_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    J: tl.constexpr,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    R8: tl.constexpr,  # BLOCK_N / 8: tinygemm's blocks of 8 rows per tile
    WEIGHT_ORDER: tl.constexpr,
    EXACT: tl.constexpr,  # float32 x: the products in float32, not TF32
):
    """out[M, N] = x[M, K] @ W[N, K]^T, W dequantised per [8 R8, 32 J] block as `_dequant_kernel` writes it, in
    x's dtype. Programs in M-fastest order: the M tiles of one N tile run side by side and share its words in L2."""
    BK: tl.constexpr = 32 * J
    tiles_m = tl.cdiv(M, BLOCK_M)
    pm, pn = tl.program_id(0) % tiles_m, tl.program_id(0) // tiles_m
    # tails clamped, not masked (unmasked loads stay vectorised): the extra rows and features are dropped at the store
    n8 = tl.minimum(pn * R8 + tl.arange(0, R8), N // 8 - 1)
    feats = tl.reshape(n8[:, None] * 8 + tl.arange(0, 8)[None, :], [8 * R8])  # the codes' rows (_codes)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    x_rows = x_ptr + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * K
    cols = tl.arange(0, BK) if WEIGHT_ORDER else _word_order_columns(J)
    acc = tl.zeros([BLOCK_M, 8 * R8], dtype=tl.float32)
    for kt in range(K // BK):
        x = tl.load(x_rows + kt * BK + cols[None, :])
        code = _codes(q_ptr, n8, kt, K // BK, J, WEIGHT_ORDER)
        scale, zero = _scales(sz_ptr, kt, cols, feats, N, G, BK)
        # q - 8 without an int -> float conversion (a quarter-rate instruction): 2^23 + q is q's bits under 2^23's
        q8 = (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        w = (q8 * scale + zero).to(x_ptr.dtype.element_ty)  # dequantize's values, rounded to x's dtype
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee" if EXACT else None)
    out_cols = pn * (8 * R8) + tl.arange(0, 8 * R8)
    mask = (rows[:, None] < M) & (out_cols[None, :] < N)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + out_cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_linear(x, qweight, scales_and_zeros, group_size: int, config=None) -> torch.Tensor:
    n8, kt, _, j = qweight.shape
    n, k = n8 * 8, kt * j * 32
    block_m, block_n, warps, stages, weight_order = config or linear_config(n, k)
    x = x.contiguous()
    out = x.new_empty(x.shape[0], n)
    grid = (triton.cdiv(x.shape[0], block_m) * triton.cdiv(n, block_n),)
    wrap_triton(_linear_kernel)[grid](
        x,
        qweight,
        scales_and_zeros,
        out,
        x.shape[0],
        N=n,
        K=k,
        J=j,
        G=group_size,
        BLOCK_M=block_m,
        R8=block_n // 8,
        WEIGHT_ORDER=weight_order,
        EXACT=x.dtype == torch.float32,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton_op("voxtral::int4_linear", mutates_args={})
def int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] (bf16 or float32) @ W^T -> [M, N] in x's dtype, W [N, K] int4 in tinygemm's layout (int4_dequantize):
    F.linear(x, quant_linear.dequantize(qweight, scales_and_zeros, x.dtype)) up to float32 accumulation order."""
    return _launch_linear(x, qweight, scales_and_zeros, group_size)


def linear(lin: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The QuantLinear hook (`QuantLinear.matmul`): x [..., K] -> [..., N] through int4_linear, the bias after."""
    y = torch.ops.voxtral.int4_linear(x.reshape(-1, lin.in_features), lin.qweight, lin.scales_and_zeros, lin.group_size)
    y = y.reshape(*x.shape[:-1], lin.out_features)
    return y if lin.bias is None else y + lin.bias


def export_dequantizing(
    module: nn.Module, example, dynamic_shapes, fused: bool = False
) -> torch.export.ExportedProgram:
    """torch.export of `module` with its int4 layers through these ops: `fused`, int4_linear; else int4_dequantize
    then the matmul. The hooks are set for the trace alone: the eager model, which the self-check runs, keeps plain
    torch's (the same values). Every row count takes the op (a branch on the dynamic length would specialise it);
    the lm_head's last row goes to tinygemm, not through forward."""
    layers = [m for m in module.modules() if isinstance(m, QuantLinear)]
    for m in layers:
        m.matmul, m.dequantizer = (linear, None) if fused else (None, dequantize)
    try:
        return torch.export.export(module, example, dynamic_shapes=dynamic_shapes, strict=False)
    finally:
        for m in layers:
            m.matmul = m.dequantizer = None
