"""Int4 weight-only GEMVs for the decode step: `kernels.py`'s `rms_gemv` and `gemv_add` over the int4 storage of
`runner/models/quant_linear.py` (int32 words of eight 4-bit codes, a scale and an offset per group of G columns).

At one token a GEMV streams its weight once: int4 moves a quarter of bf16's bytes (plus 4 bytes of scale and
offset per 64 bytes of codes), so to stay memory-bound the kernel must unpack at four times bf16's element rate.
Per weight it does one LOP3, one FADD and one FFMA (and a MOV of the mask, which ptxas rematerialises):
  - no int->float conversion (I2F runs at 16 per clock per SM, a quarter of the integer and an eighth of the FP32
    rate): the code is masked into the mantissa of 2^23 (`(bits & mask) | 0x4B000000` is the float 2^23 + v,
    exactly) and 2^23 subtracted;
  - no shift per nibble: plane i is masked in place, worth q * 16^i, and x's slice for that plane is scaled by
    16^-i (a power of two: exact). Planes 5..7 would reach the exponent's bits, so they are masked from the word
    shifted right by 12 once (worth q * 16^(i-3));
  - the scale and offset once per word and tile, not per weight: acc += scale * sum_planes(q x) + offset * sum(x);
    the sums over k wait until the end, so the loop stays elementwise in the weight tile's 3D layout (x is loaded
    in that layout too: no layout conversion through shared memory).
The planes layout makes every plane's slice of x contiguous, so nothing is interleaved in registers.

**Measured (H200, benchmarks/NOTES.md): correct, but instruction-bound, not memory-bound.** 0.8-1.3 TB/s of int4
bytes (qkv 10.9 us, o_proj 8.4, gate_up 23.9, down 14.0, lm_head 159 us per call, against the bf16 kernel's 12.0,
10.8, 25.1, 19.9, 212): ncu shows DRAM at 14% of peak, the integer pipe the busiest, ~13 instructions per weight
in a 4-warp config (x's per-column work is repeated by every thread that holds that column). The step is at par
with bf16 (2.19 vs 2.23 ms). Reaching the memory floor needs the dequantisation off the scalar pipes: packed
bf16x2 unpacking in inline PTX, or the codes as a tensor-core operand (Marlin's scheme).

The epilogues, the roundings and the PDL convention are `kernels.py`'s: the first weight tile (codes, scales and
offsets) is loaded before `griddepcontrol.wait`, and x and the residual are read only after it. No split-K: the
3B shapes have N >= 3072 rows, so BLOCK_N of 4..16 rows gives 192..32768 programs, enough to fill 132 SMs.
Registered with `torch.library.triton_op`, so AOTInductor compiles the kernels into `text_decoder_step`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from runner.export.kernels import _after_predecessor

# (BLOCK_N, BLOCK_G, num_warps, stages) per GEMV kind by (N, K), for the 3B shapes at group 128 (BLOCK_G groups of
# 128 columns per tile: 64 bytes of codes per row and group; stages 2: the next tile prefetched into registers);
# other shapes take DEFAULT_INT4. The fastest of 13 configs each, alone over 30 layers' weights in a CUDA graph on
# the H200 (benchmarks/int4_kernels.py, benchmarks/NOTES.md): one warp per program, all its rows in each thread.
INT4_CONFIGS: dict[tuple[str, int, int], tuple[int, int, int, int]] = {
    ("rms", 6144, 3072): (8, 8, 1, 1),
    ("add", 3072, 4096): (4, 8, 1, 2),
    ("rms_glu", 8192, 3072): (8, 4, 1, 1),
    ("add", 3072, 8192): (8, 8, 4, 2),
    ("rms_f32", 131072, 3072): (16, 4, 1, 1),
}
DEFAULT_INT4 = (8, 4, 4, 1)
# The float 2^23, as bits and as a value: its mantissa holds the integers below 2^23 exactly. constexpr: Triton
# refuses other globals in a kernel, and Inductor copies constexpr globals into the source it compiles.
MAGIC = tl.constexpr(0x4B000000)
MAGIC_F = tl.constexpr(8388608.0)


def int4_config(kind: str, n: int, k: int, group: int) -> tuple[int, int, int, int]:
    block_n, block_g, warps, stages = INT4_CONFIGS.get((kind, n, k), DEFAULT_INT4)
    return block_n, min(block_g, triton.next_power_of_2(k // group)), warps, stages


@triton.jit
def _plane(w, hi, PLANE: tl.constexpr):
    """Plane PLANE of the words as float32: q * 16^PLANE below 5, else q * 16^(PLANE-3) (from hi = w >> 12)."""
    if PLANE < 5:
        bits = w & (0xF << (4 * PLANE))
    else:
        bits = hi & (0xF << (4 * (PLANE - 3)))
    return (bits | MAGIC).to(tl.float32, bitcast=True) - MAGIC_F


@triton.jit
def _int4_tile(q_ptr, s_ptr, o_ptr, rows, groups, jj, NG: tl.constexpr, WPG: tl.constexpr, row_ok):
    """Rows' words [BLOCK_N, BLOCK_G, WPG] of groups `groups` (none past NG), and their scales and offsets
    [BLOCK_N, BLOCK_G, 1]: every tensor of the loop in one 3D layout, so nothing is converted between layouts."""
    r3, g3 = rows[:, None, None], groups[None, :, None]
    ok = row_ok[:, None, None] & (g3 < NG)
    w = tl.load(q_ptr + (r3 * NG + g3) * WPG + jj[None, None, :], mask=ok, other=0)
    s = tl.load(s_ptr + r3 * NG + g3, mask=ok, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + r3 * NG + g3, mask=ok, other=0.0).to(tl.float32)
    return w, s, o


@triton.jit
def _int4_x(x_ptr, g_ptr, groups, jj, sumsq, G: tl.constexpr, NG: tl.constexpr, NORM: tl.constexpr):
    """x' = x (* g with NORM) at the tile's columns as its 8 planes [1, BLOCK_G, WPG] in float32, each scaled by
    the power of two its plane's codes carry (see `_plane`); their sum over the planes (for the offsets), and
    sumsq += x^2. Loaded in the weight tile's layout, so nothing is converted between layouts."""
    WPG: tl.constexpr = G // 8
    g3 = groups[None, :, None]
    g_ok = g3 < NG
    xsum = tl.zeros(sumsq.shape, dtype=tl.float32)
    planes = ()
    for i in tl.static_range(8):
        cols = g3 * G + i * WPG + jj[None, None, :]  # plane i's columns: contiguous
        x = tl.load(x_ptr + cols, mask=g_ok, other=0.0).to(tl.float32)
        if NORM:
            sumsq += x * x
            x = x * tl.load(g_ptr + cols, mask=g_ok, other=0.0).to(tl.float32)
        xsum += x
        if i < 5:  # plane i is worth q * 16^i, planes 5..7 q * 16^(i-3): x scaled back by a power of two
            planes = planes + (x * (1.0 / (1 << (4 * i))),)
        else:
            planes = planes + (x * (1.0 / (1 << (4 * (i - 3)))),)
    return planes, xsum, sumsq


@triton.jit
def _int4_accumulate(w, s, o, planes, xsum, acc):
    """acc [BLOCK_N, BLOCK_G, WPG] += scale * sum over the planes of q * x' + offset * x' (the sums over k are
    left to the end, so every step stays elementwise in one layout)."""
    hi = w >> 12
    dots = tl.zeros(w.shape, dtype=tl.float32)
    for i in tl.static_range(8):
        dots += _plane(w, hi, i) * planes[i]
    return acc + dots * s + o * xsum


# Named with `_gemv_kernel` first: the runtime makes a captured graph's edges into kernels whose names start so
# programmatic (runner/runtime/pdl.py, WAITING_KERNELS); this kernel waits before reading x as that one does.
@triton.jit
def _gemv_kernel_int4(
    x_ptr,
    g_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    r_ptr,
    out_ptr,
    N,
    K: tl.constexpr,
    G: tl.constexpr,
    EPS: tl.constexpr,
    NORM: tl.constexpr,
    GLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    OUT_F32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """`kernels._gemv_kernel` with the weight in int4: out[n] = sum_k W[n, k] x'[k] (+ r[n]) for BLOCK_N rows, the
    tile BLOCK_G groups of G columns; with GLU the rows [N, 2N) are the up half, out = silu(gate) * up. With
    PREFETCH each tile's loads are issued before the tile before it is computed (two tiles in registers)."""
    WPG: tl.constexpr = G // 8
    NG: tl.constexpr = K // G
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    gg = tl.arange(0, BLOCK_G)
    jj = tl.arange(0, WPG)
    w, s, o = _int4_tile(q_ptr, s_ptr, o_ptr, rows, gg, jj, NG, WPG, row_ok)
    wu, su, ou = w, s, o
    if GLU:
        wu, su, ou = _int4_tile(q_ptr, s_ptr, o_ptr, rows + N, gg, jj, NG, WPG, row_ok)
    if PDL:  # the first tile is on its way; x and r are the kernel before's outputs
        ready = tl.multiple_of(_after_predecessor(tl.program_id(0)), 16)
        x_ptr += ready
        r_ptr += ready
    acc = tl.zeros([BLOCK_N, BLOCK_G, WPG], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_G, WPG], dtype=tl.float32)
    sumsq = tl.zeros([1, BLOCK_G, WPG], dtype=tl.float32)
    planes, xsum, sumsq = _int4_x(x_ptr, g_ptr, gg, jj, sumsq, G, NG, NORM)
    for g0 in range(0, NG, BLOCK_G):
        groups = g0 + gg
        if PREFETCH:  # the next tile's weights and x in flight while this one is computed (masked past the last)
            w_next, s_next, o_next = _int4_tile(q_ptr, s_ptr, o_ptr, rows, groups + BLOCK_G, jj, NG, WPG, row_ok)
            wu_next, su_next, ou_next = w_next, s_next, o_next
            if GLU:
                wu_next, su_next, ou_next = _int4_tile(
                    q_ptr, s_ptr, o_ptr, rows + N, groups + BLOCK_G, jj, NG, WPG, row_ok
                )
            planes_next, xsum_next, sumsq = _int4_x(x_ptr, g_ptr, groups + BLOCK_G, jj, sumsq, G, NG, NORM)
        elif g0 > 0:
            w, s, o = _int4_tile(q_ptr, s_ptr, o_ptr, rows, groups, jj, NG, WPG, row_ok)
            if GLU:
                wu, su, ou = _int4_tile(q_ptr, s_ptr, o_ptr, rows + N, groups, jj, NG, WPG, row_ok)
            else:
                wu, su, ou = w, s, o
            planes, xsum, sumsq = _int4_x(x_ptr, g_ptr, groups, jj, sumsq, G, NG, NORM)
        acc = _int4_accumulate(w, s, o, planes, xsum, acc)
        if GLU:
            acc_up = _int4_accumulate(wu, su, ou, planes, xsum, acc_up)
        if PREFETCH:
            w, s, o, wu, su, ou = w_next, s_next, o_next, wu_next, su_next, ou_next
            planes, xsum = planes_next, xsum_next
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(tl.sum(sumsq, axis=2), axis=1), axis=0) / K + EPS)
        y = y * rstd
    y = y.to(tl.bfloat16).to(tl.float32)
    if GLU:
        up = tl.sum(tl.sum(acc_up, axis=2), axis=1)
        if NORM:
            up = up * rstd
        up = up.to(tl.bfloat16).to(tl.float32)
        y = (y / (1.0 + tl.exp(-y))).to(tl.bfloat16).to(tl.float32) * up
    if RESIDUAL:
        y = y + tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if OUT_F32:
        tl.store(out_ptr + rows, y, mask=row_ok)
    else:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def _launch_int4_gemv(
    x, qweight, scales, offsets, *, g=None, residual=None, eps=0.0, glu=False, out_f32=False, pdl=False, config=None
):
    """Launch `_gemv_kernel_int4`; `config` (BLOCK_N, BLOCK_G, num_warps, stages) overrides the table (sweeps).
    stages 2: the loop prefetches the next tile into registers (`PREFETCH`)."""
    rows, groups = scales.shape
    n = rows // 2 if glu else rows
    k = qweight.shape[1] * 8
    group = k // groups
    kind = "add" if residual is not None else "rms_glu" if glu else "rms_f32" if out_f32 else "rms"
    block_n, block_g, warps, stages = config or int4_config(kind, n, k, group)
    out = torch.empty(n, dtype=torch.float32 if out_f32 else x.dtype, device=x.device)
    wrap_triton(_gemv_kernel_int4)[(triton.cdiv(n, block_n),)](
        x,
        g if g is not None else x,  # unused pointers: any tensor
        qweight,
        scales,
        offsets,
        residual if residual is not None else x,
        out,
        n,
        k,
        group,
        EPS=eps,
        NORM=g is not None,
        GLU=glu,
        RESIDUAL=residual is not None,
        OUT_F32=out_f32,
        BLOCK_N=block_n,
        BLOCK_G=block_g,
        PREFETCH=stages > 1,
        PDL=pdl,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton_op("voxtral::int4_rms_gemv", mutates_args=())
def int4_rms_gemv(
    x: torch.Tensor,
    g: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    eps: float,
    glu: bool,
    out_f32: bool,
    pdl: bool = False,
) -> torch.Tensor:
    """`kernels.rms_gemv` over an int4 weight: x [K], g [K], qweight int32 [N, K / 8] (2N rows with glu), scales
    and offsets [N, K / G] -> [N] (float32 with out_f32, else x's dtype)."""
    return _launch_int4_gemv(x, qweight, scales, offsets, g=g, eps=eps, glu=glu, out_f32=out_f32, pdl=pdl)


@triton_op("voxtral::int4_gemv_add", mutates_args=())
def int4_gemv_add(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    residual: torch.Tensor,
    pdl: bool = False,
) -> torch.Tensor:
    """`kernels.gemv_add` over an int4 weight: residual + W x, in x's dtype."""
    return _launch_int4_gemv(x, qweight, scales, offsets, residual=residual, pdl=pdl)
