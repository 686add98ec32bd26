"""Triton kernels for the decode step (one token), compiled into the CUDA `text_decoder_step` by AOTInductor.

Why hand-written: at one token every decoder matmul is a GEMV that streams its weight once. On the H200 cuBLAS
reached 3.87 TB/s on gate_up but 2.64 TB/s on o_proj/down (split-K, plus a separate reduce kernel each), and
the written-out attention read the whole 1024-slot cache with three kernels per layer
(`benchmarks/NOTES.md`, item 6). These kernels:
  - `rms_gemv`: RMSNorm folded into the GEMV (W (g * x) * rstd: the norm's scale is applied after the sum, so
    the input is read once), optionally with SiLU(gate) * up in the epilogue (the fused gate_up weight) or a
    float32 output (lm_head);
  - `gemv_add`: a GEMV with the residual add in its epilogue;
  - `decode_attention`: flash-decoding over the valid positions only, the query heads of one KV head together.

Every op is registered with `torch.library.triton_op`, so torch.export keeps it as one node and AOTInductor
compiles the Triton kernel into the `.so`. Triton is imported only here: CPU exports never load this module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# (BLOCK_N, BLOCK_K, num_warps, num_stages) per GEMV kind, by (N, K). Session 11 swept each GEMV alone (48 configs,
# `h200/decode_kernels_sweep1.json`; us per call, ours vs cuBLAS: qkv 11.3 vs 14.7, o_proj 8.9 vs 12.7, gate_up 27.2
# vs 27.4, down 14.9 vs 19.1, lm_head 181 vs 198). Session 12 tuned o_proj, gate_up and down inside the whole step,
# where wider K tiles won (more bytes in flight per program): the step 2.288 -> 2.213 ms (`h200/step_sweep_s12b.*`,
# branch s12-fused-attention). Other shapes (the tiny model) take the default.
GEMV_CONFIGS: dict[tuple[str, int, int], tuple[int, int, int, int]] = {
    ("rms", 6144, 3072): (16, 512, 4, 3),
    ("add", 3072, 4096): (2, 2048, 8, 1),
    ("rms_glu", 8192, 3072): (2, 4096, 4, 1),
    ("add", 3072, 8192): (2, 4096, 8, 1),
    ("rms_f32", 131072, 3072): (8, 1024, 4, 3),
}
DEFAULT_GEMV = (8, 512, 4, 2)
# Splits of the positions per KV head, and positions per block: 7.8 us/layer at 512 positions and 9.2 at 1000
# (the written-out attention: 30.4 and 28.7).
ATTN_SPLITS, ATTN_BLOCK_T = 8, 64


def gemv_config(kind: str, n: int, k: int) -> tuple[int, int, int, int]:
    block_n, block_k, warps, stages = GEMV_CONFIGS.get((kind, n, k), DEFAULT_GEMV)
    return block_n, min(block_k, triton.next_power_of_2(k)), warps, stages


@triton.jit
def _gemv_kernel(
    x_ptr,
    g_ptr,
    w_ptr,
    r_ptr,
    out_ptr,
    N,
    K: tl.constexpr,
    EPS: tl.constexpr,
    NORM: tl.constexpr,
    GLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    OUT_F32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[n] = sum_k W[n, k] * x'[k] (+ r[n]) for BLOCK_N rows, with x' = RMSNorm(x) * g when NORM. With GLU, W
    holds 2N rows (gate, then up) and out[n] = silu(gate[n]) * up[n]. Roundings follow the eager bf16 model
    (each linear's output is bf16 before the next elementwise op); the sum is float32."""
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + cols
        k_ok = kk < K
        x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:
            sumsq += x * x
            x = x * tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        ok = row_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + rows[:, None] * K + kk[None, :], mask=ok, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        if GLU:
            wu = tl.load(w_ptr + (rows[:, None] + N) * K + kk[None, :], mask=ok, other=0.0)
            acc_up += wu.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / K + EPS)
        y = y * rstd
    y = y.to(tl.bfloat16).to(tl.float32)
    if GLU:
        up = tl.sum(acc_up, axis=1)
        if NORM:
            up = up * rstd
        up = up.to(tl.bfloat16).to(tl.float32)
        y = (y / (1.0 + tl.exp(-y))).to(tl.bfloat16).to(tl.float32) * up
    if RESIDUAL:
        y = y + tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if OUT_F32:
        tl.store(out_ptr + rows, y, mask=row_ok)
    else:
        tl.store(out_ptr + rows, y.to(tl.bfloat16), mask=row_ok)


def _launch_gemv(x, w, *, g=None, residual=None, eps=0.0, glu=False, out_f32=False, config=None):
    """Launch `_gemv_kernel`; `config` (BLOCK_N, BLOCK_K, num_warps, num_stages) overrides the table (sweeps)."""
    n = w.shape[0] // 2 if glu else w.shape[0]
    k = w.shape[1]
    kind = "add" if residual is not None else "rms_glu" if glu else "rms_f32" if out_f32 else "rms"
    block_n, block_k, warps, stages = config or gemv_config(kind, n, k)
    out = torch.empty(n, dtype=torch.float32 if out_f32 else x.dtype, device=x.device)
    wrap_triton(_gemv_kernel)[(triton.cdiv(n, block_n),)](
        x,
        g if g is not None else x,  # unused pointers: any tensor
        w,
        residual if residual is not None else x,
        out,
        n,
        k,
        EPS=eps,
        NORM=g is not None,
        GLU=glu,
        RESIDUAL=residual is not None,
        OUT_F32=out_f32,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton_op("voxtral::rms_gemv", mutates_args=())
def rms_gemv(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, eps: float, glu: bool, out_f32: bool) -> torch.Tensor:
    """x [K] bf16, g [K] (RMSNorm weight), w [N, K] (or [2N, K] with glu) -> [N]."""
    return _launch_gemv(x, w, g=g, eps=eps, glu=glu, out_f32=out_f32)


@triton_op("voxtral::gemv_add", mutates_args=())
def gemv_add(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """x [K], w [N, K], residual [N] -> residual + w @ x, bf16."""
    return _launch_gemv(x, w, residual=residual)


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    max_seq,
    SM_SCALE: tl.constexpr,
    REP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Program (kv head j, split s): the REP query heads of KV head j against positions [0, pos] of the cache,
    s-th of SPLITS contiguous slices. Partial (max, sum, weighted V) go to m/l/acc; with one split the
    normalised output is written directly. Query rows are padded to BLOCK_H (>= 16) for tl.dot."""
    j = tl.program_id(0)
    s = tl.program_id(1)
    n_valid = tl.load(pos_ptr).to(tl.int32) + 1
    per = tl.cdiv(tl.cdiv(n_valid, SPLITS), BLOCK_T) * BLOCK_T
    start = s * per
    end = tl.minimum(start + per, n_valid)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (j * REP + h)[:, None] * D + d[None, :], mask=(h < REP)[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    base = j.to(tl.int64) * max_seq * D
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < end
        k = tl.load(k_ptr + base + t[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * SM_SCALE
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + base + t[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if SPLITS == 1:
        o = acc / denom[:, None]
        tl.store(
            out_ptr + (j * REP + h)[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=(h < REP)[:, None]
        )
    else:
        part = (j * SPLITS + s) * BLOCK_H + h
        tl.store(m_ptr + part, m)
        tl.store(l_ptr + part, denom)
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc)


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, REP: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, SPLITS: tl.constexpr
):
    """Program j: merge KV head j's SPLITS partials (splits past the last position hold m = -inf, l = 0)."""
    j = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    for r in tl.static_range(REP):
        part = (j * SPLITS + s) * BLOCK_H + r
        m = tl.load(m_ptr + part)
        w = tl.exp(m - tl.max(m, axis=0))
        denom = tl.sum(tl.load(l_ptr + part) * w, axis=0)
        acc = tl.load(acc_ptr + part[:, None] * D + d[None, :])
        o = tl.sum(acc * w[:, None], axis=0) / denom
        tl.store(out_ptr + (j * REP + r) * D + d, o.to(out_ptr.dtype.element_ty))


def _launch_attention(q, k_cache, v_cache, pos, splits=None, block_t=None):
    n_heads, d = q.shape
    n_kv, max_seq = k_cache.shape[1], k_cache.shape[2]
    rep = n_heads // n_kv
    splits, block_t = splits or ATTN_SPLITS, block_t or ATTN_BLOCK_T
    block_h = max(16, triton.next_power_of_2(rep))
    out = torch.empty(n_heads * d, dtype=q.dtype, device=q.device)
    m = torch.empty(n_kv * splits * block_h, dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    acc = torch.empty(n_kv * splits * block_h * d, dtype=torch.float32, device=q.device)
    wrap_triton(_attention_kernel)[(n_kv, splits)](
        q, k_cache, v_cache, pos, m, denom, acc, out, max_seq, d**-0.5, rep, d, block_h, block_t, splits, num_warps=4
    )
    if splits > 1:
        wrap_triton(_combine_kernel)[(n_kv,)](m, denom, acc, out, rep, d, block_h, splits, num_warps=4)
    return out


@triton_op("voxtral::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """q [H, D] (roped), caches [1, H_kv, max_seq, D] already holding this position, pos [1] -> [H * D]."""
    return _launch_attention(q, k_cache, v_cache, pos)
