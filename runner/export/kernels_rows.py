"""Triton kernels for the batched decode step's linears (`text_decoder_batch`): B <= 32 rows, one token each,
compiled into its `.so` by AOTInductor.

Why hand-written: at a few rows each decoder matmul still streams its whole weight once, so the step should cost
what the batch-1 step costs. Inductor's GEMMs at a dynamic B are general tiles made for large M; and the RMSNorms,
residual adds and SiLU(gate) * up around them are kernels of their own. These are kernels.py's GEMVs widened to
a block of rows: a program holds BLOCK_N weight rows' tile and multiplies it with every batch row at once
(`tl.dot`, the rows padded to BLOCK_B >= 16), so the weight is read once for the whole batch; the same folds
(RMSNorm's scale after the sum, SiLU(gate) * up, the residual add, a float32 output) and the same e4m3 path (codes
widened in registers, each output column scaled once).

  - `rms_rows`: out[b] = W (g * x[b]) * rstd[b], with `glu` SiLU(gate) * up, with `out_f32` float32 (lm_head);
  - `rows_add`: out[b] = W x[b] + r[b];
  - `rms_rows_fp8`, `rows_add_fp8`: the same over e4m3 codes with a float32 scale per output row of W.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn
from torch.library import triton_op, wrap_triton

from runner.export.decode_step import fp8_kernel
from runner.export.kernels import _gemv_weights, after_predecessor
from runner.models import voxtral_batch
from runner.models.fp8_linear import Fp8Linear
from runner.models.quant_linear import QuantLinear

MIN_BLOCK_B = 16  # tl.dot's smallest tile side

# (BLOCK_N, BLOCK_K, num_warps, num_stages) per kind, by (N, K, BLOCK_B), for the 3B shapes at the batch blocks the
# bundle compiles (benchmarks/decode_kernels.py --parts rows); other shapes take the default.
ROWS_CONFIGS: dict[tuple[str, int, int, int], tuple[int, int, int, int]] = {}
DEFAULT_ROWS = (16, 256, 4, 2)


def block_rows(max_rows: int) -> int:
    """The padded row block a bundle of `max_rows` batch rows compiles: one block holds them all."""
    return max(MIN_BLOCK_B, triton.next_power_of_2(max_rows))


def rows_config(kind: str, n: int, k: int, block_b: int) -> tuple[int, int, int, int]:
    """The table's config for a kind at (N, K, BLOCK_B); an fp8 kind not in it takes its bf16 kind's."""
    base = ROWS_CONFIGS.get((kind.removesuffix("_fp8"), n, k, block_b), DEFAULT_ROWS)
    block_n, block_k, warps, stages = ROWS_CONFIGS.get((kind, n, k, block_b), base)
    return block_n, min(block_k, max(16, triton.next_power_of_2(k))), warps, stages


@triton.jit
def _rows_accumulate(
    x_ptr, g_ptr, b, b_ok, kk, K: tl.constexpr, w, wu, acc, acc_up, sumsq, NORM: tl.constexpr, GLU: tl.constexpr
):
    """acc [BLOCK_B, BLOCK_N] += x'[:, kk] @ w.T (and acc_up with wu), x' = x * g with NORM, its sum of squares per
    row added to sumsq. The dot's inputs are x's dtype (e4m3 codes widen exactly); its sum is float32."""
    k_ok = kk < K
    raw = tl.load(x_ptr + b[:, None] * K + kk[None, :], mask=b_ok[:, None] & k_ok[None, :], other=0.0)
    if NORM:
        x = raw.to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
        xd = (x * tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(raw.dtype)
    else:
        xd = raw
    acc += tl.dot(xd, tl.trans(w.to(raw.dtype)))
    if GLU:
        acc_up += tl.dot(xd, tl.trans(wu.to(raw.dtype)))
    return acc, acc_up, sumsq


@triton.jit
def _rows_kernel(
    x_ptr,
    g_ptr,
    w_ptr,
    s_ptr,
    r_ptr,
    out_ptr,
    B,
    N,
    K: tl.constexpr,
    EPS: tl.constexpr,
    NORM: tl.constexpr,
    GLU: tl.constexpr,
    SCALED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    OUT_F32: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[b, n] = sum_k W[n, k] * x'[b, k] (+ r[b, n]) for BLOCK_N columns n and every row b < B: kernels.py's
    `_gemv_kernel` (its NORM, GLU, SCALED, RESIDUAL, OUT_F32 and PDL mean the same) with the rows as the dot's M.
    Roundings as there: each linear's output is bf16 before the next elementwise op; the norm's input is rounded
    to x's dtype after g (the eager model rounds after rstd too)."""
    cols = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_ok = cols < N
    b = tl.arange(0, BLOCK_B).to(tl.int64)
    b_ok = b < B
    kk = tl.arange(0, BLOCK_K)
    w, wu = _gemv_weights(w_ptr, cols, kk, N, K, col_ok, GLU)  # before the wait: in flight while it waits
    if PDL:
        ready = tl.multiple_of(after_predecessor(tl.program_id(0)), 16)
        x_ptr += ready
        r_ptr += ready
    acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc, acc_up, sumsq = _rows_accumulate(x_ptr, g_ptr, b, b_ok, kk, K, w, wu, acc, acc_up, sumsq, NORM, GLU)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w, wu = _gemv_weights(w_ptr, cols, k0 + kk, N, K, col_ok, GLU)
        acc, acc_up, sumsq = _rows_accumulate(x_ptr, g_ptr, b, b_ok, k0 + kk, K, w, wu, acc, acc_up, sumsq, NORM, GLU)
    y = acc
    if SCALED:
        y = y * tl.load(s_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if NORM:
        rstd = 1.0 / tl.sqrt(sumsq / K + EPS)
        y = y * rstd[:, None]
    y = y.to(tl.bfloat16).to(tl.float32)
    if GLU:
        up = acc_up
        if SCALED:
            up = up * tl.load(s_ptr + cols + N, mask=col_ok, other=0.0)[None, :]
        if NORM:
            up = up * rstd[:, None]
        up = up.to(tl.bfloat16).to(tl.float32)
        y = (y / (1.0 + tl.exp(-y))).to(tl.bfloat16).to(tl.float32) * up
    at = b[:, None] * N + cols[None, :]
    ok = b_ok[:, None] & col_ok[None, :]
    if RESIDUAL:
        y = y + tl.load(r_ptr + at, mask=ok, other=0.0).to(tl.float32)
    if OUT_F32:
        tl.store(out_ptr + at, y, mask=ok)
    else:
        tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=ok)


def _launch_rows(
    x, w, *, g=None, scale=None, residual=None, eps=0.0, glu=False, out_f32=False, pdl=False, max_rows=0, config=None
):
    """Launch `_rows_kernel` on x [B, K]; `max_rows` (>= B) sizes the row block, so a dynamic B compiles one
    kernel; `scale`: w is e4m3 codes with a float32 scale per row; `config` overrides the table (sweeps)."""
    rows, k = x.shape
    n = w.shape[0] // 2 if glu else w.shape[0]
    block_b = block_rows(max_rows or rows)
    kind = "add" if residual is not None else "rms_glu" if glu else "rms_f32" if out_f32 else "rms"
    block_n, block_k, warps, stages = config or rows_config(kind + ("_fp8" if scale is not None else ""), n, k, block_b)
    out = torch.empty(rows, n, dtype=torch.float32 if out_f32 else x.dtype, device=x.device)
    wrap_triton(_rows_kernel)[(triton.cdiv(n, block_n),)](
        x,
        g if g is not None else x,  # unused pointers: any tensor
        w,
        scale if scale is not None else x,
        residual if residual is not None else x,
        out,
        rows,
        n,
        k,
        EPS=eps,
        NORM=g is not None,
        GLU=glu,
        SCALED=scale is not None,
        RESIDUAL=residual is not None,
        OUT_F32=out_f32,
        BLOCK_B=block_b,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=pdl,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton_op("voxtral::rms_rows", mutates_args=())
def rms_rows(
    x: torch.Tensor,
    g: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    glu: bool,
    out_f32: bool,
    max_rows: int,
    pdl: bool = False,
) -> torch.Tensor:
    """x [B, K] (B <= max_rows), g [K] (RMSNorm weight), w [N, K] (or [2N, K] with glu) -> [B, N]."""
    return _launch_rows(x, w, g=g, eps=eps, glu=glu, out_f32=out_f32, pdl=pdl, max_rows=max_rows)


@triton_op("voxtral::rows_add", mutates_args=())
def rows_add(
    x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, max_rows: int, pdl: bool = False
) -> torch.Tensor:
    """x [B, K], w [N, K], residual [B, N] -> residual + x @ w.T."""
    return _launch_rows(x, w, residual=residual, pdl=pdl, max_rows=max_rows)


@triton_op("voxtral::rms_rows_fp8", mutates_args=())
def rms_rows_fp8(
    x: torch.Tensor,
    g: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    glu: bool,
    out_f32: bool,
    max_rows: int,
    pdl: bool = False,
) -> torch.Tensor:
    """rms_rows over an fp8 layer: codes [N, K] float8_e4m3fn (or [2N, K] with glu), scale [N] (2N) float32."""
    return _launch_rows(x, codes, g=g, scale=scale, eps=eps, glu=glu, out_f32=out_f32, pdl=pdl, max_rows=max_rows)


@triton_op("voxtral::rows_add_fp8", mutates_args=())
def rows_add_fp8(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor, max_rows: int, pdl: bool = False
) -> torch.Tensor:
    """rows_add over an fp8 layer: residual + x @ (codes * scale[:, None]).T."""
    return _launch_rows(x, codes, scale=scale, residual=residual, pdl=pdl, max_rows=max_rows)


@dataclass(frozen=True)
class RowLinears:
    """voxtral_batch.BatchKernels' `rms_linear` and `linear_add` through these ops, for a bundle of `max_rows` batch
    rows: bf16 and fp8 layers; int4 layers (tinygemm) and fp8 ones with a bias as written out."""

    max_rows: int
    pdl: bool = False

    def rms_linear(self, x, norm: nn.Module, lin: nn.Module, glu: bool = False, out_f32: bool = False):
        ops, n, pdl = torch.ops.voxtral, self.max_rows, self.pdl
        if fp8_kernel(lin):
            return ops.rms_rows_fp8(x, norm.weight, lin.qweight, lin.weight_scale, norm.eps, glu, out_f32, n, pdl)
        if isinstance(lin, QuantLinear | Fp8Linear):
            return voxtral_batch.rms_linear(x, norm, lin, glu, out_f32)
        return ops.rms_rows(x, norm.weight, lin.weight, norm.eps, glu, out_f32, n, pdl)

    def linear_add(self, x, lin: nn.Module, residual):
        ops, n, pdl = torch.ops.voxtral, self.max_rows, self.pdl
        if fp8_kernel(lin):
            return ops.rows_add_fp8(x, lin.qweight, lin.weight_scale, residual, n, pdl)
        if isinstance(lin, QuantLinear | Fp8Linear):
            return voxtral_batch.linear_add(x, lin, residual)
        return ops.rows_add(x, lin.weight, residual, n, pdl)
