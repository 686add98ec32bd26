"""Triton kernels for the decode step (one token), compiled into the CUDA `text_decoder_step` by AOTInductor.

Why hand-written: at one token every decoder matmul is a GEMV that streams its weight once. On the H200 cuBLAS
reached 3.87 TB/s on gate_up but 2.64 TB/s on o_proj/down (split-K, plus a separate reduce kernel each), and
the written-out attention read the whole 1024-slot cache with three kernels per layer
(`benchmarks/NOTES.md`, item 6). These kernels:
  - `rms_gemv`: RMSNorm folded into the GEMV (W (g * x) * rstd: the norm's scale is applied after the sum, so
    the input is read once), optionally with SiLU(gate) * up in the epilogue (the fused gate_up weight) or a
    float32 output (lm_head);
  - `gemv_add`: a GEMV with the residual add in its epilogue;
  - `decode_attention`: flash-decoding over the valid positions only, the query heads of one KV head together,
    with rope and the cache write of the new position folded in (two Inductor kernels per layer fewer);
  - an L2 prefetch of the next kernel's weights: extra programs at the end of a grid, which the GPU schedules as
    the last wave drains, issue bulk L2 prefetches (Hopper's `cp.async.bulk.prefetch.L2`), so the memory bus
    stays busy through each kernel's tail and the next one starts on cached weights. The weights stream once
    either way; the prefetch only moves part of the traffic into time the bus would otherwise sit idle.

Every op is registered with `torch.library.triton_op`, so torch.export keeps it as one node and AOTInductor
compiles the Triton kernel into the `.so`. Triton is imported only here: CPU exports never load this module.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# (BLOCK_N, BLOCK_K, num_warps, num_stages) per GEMV kind, by (N, K): the best of 48 in the sweep of
# `benchmarks/decode_kernels.py` on the H200 (`h200/decode_kernels_sweep1.json`; us per call, ours vs cuBLAS: qkv 11.3 vs
# 14.7, o_proj 8.9 vs 12.7, gate_up 27.2 vs 27.4, down 14.9 vs 19.1, lm_head 181 vs 198). Other shapes (the tiny
# model) take the default.
GEMV_CONFIGS: dict[tuple[str, int, int], tuple[int, int, int, int]] = {
    ("rms", 6144, 3072): (16, 512, 4, 3),
    ("add", 3072, 4096): (2, 1024, 8, 1),
    ("rms_glu", 8192, 3072): (16, 256, 4, 1),
    ("add", 3072, 8192): (2, 1024, 4, 3),
    ("rms_f32", 131072, 3072): (8, 1024, 4, 3),
}
DEFAULT_GEMV = (8, 512, 4, 2)
# Splits of the positions per KV head, and positions per block: 7.8 us/layer at 512 positions and 9.2 at 1000
# (the written-out attention: 30.4 and 28.7).
ATTN_SPLITS, ATTN_BLOCK_T = 8, 64
# Bytes of the next kernel's weights that each kernel of the step prefetches into L2, by the issuing kernel
# (`DecodeStep` names the targets: attention and qkv -> o_proj, o_proj -> gate_up, gate_up -> down, down -> the
# next layer's qkv or lm_head, lm_head -> layer 0's qkv). H200's L2 holds 50 MB.
PREFETCH_BYTES: dict[str, int] = {
    "qkv": 0,
    "attention": 24 << 20,
    "o_proj": 8 << 20,
    "gate_up": 8 << 20,
    "down": 8 << 20,
    "lm_head": 0,
}
# 1: one `cp.async.bulk.prefetch.L2` of PF_CHUNK bytes per lane (Hopper); 2: `prefetch.global.L2` per 128-byte
# line (any sm_80+ GPU), kept for comparison and as the fallback should the bulk form not compile.
PF_MODE, PF_CHUNK = 1, 4096


def gemv_config(kind: str, n: int, k: int) -> tuple[int, int, int, int]:
    block_n, block_k, warps, stages = GEMV_CONFIGS.get((kind, n, k), DEFAULT_GEMV)
    return block_n, min(block_k, triton.next_power_of_2(k)), warps, stages


def _prefetch_plan(pf: torch.Tensor | None, nbytes: int, parts: int, warps: int) -> dict:
    """Kernel arguments to prefetch the first nbytes of `pf`, spread over `parts` equal parts of it (the gate and
    up halves of gate_up), and how many programs that takes. Off (no programs) for CPU tensors (the interpreter),
    pre-Hopper GPUs in bulk mode, or no target."""
    mode = PF_MODE
    chunk = PF_CHUNK if mode == 1 else 128
    lanes = 32 * warps * (1 if mode == 1 else 16)
    on = pf is not None and nbytes > 0 and pf.is_cuda
    if on:
        on = torch.cuda.get_device_capability(pf.device) >= ((9, 0) if mode == 1 else (8, 0))
    stride = pf.numel() * pf.element_size() // parts if on else 0
    per_part = min(nbytes // parts, stride) // chunk if on else 0
    return {
        "programs": triton.cdiv(per_part * parts, lanes) if per_part else 0,
        "args": (per_part, per_part * parts, stride),
        "constexprs": {"PREFETCH": per_part > 0, "PF_LANES": lanes, "PF_CHUNK": chunk, "PF_MODE": mode},
    }


@triton.jit
def _prefetch_l2(
    pf_ptr, p, pf_chunks, pf_total, pf_stride, out_ptr, LANES: tl.constexpr, CHUNK: tl.constexpr, MODE: tl.constexpr
):
    """Prefetch program p: LANES chunks of CHUNK bytes into L2, chunk c at part (c // pf_chunks) * pf_stride."""
    c = p * LANES + tl.arange(0, LANES)
    part = c // pf_chunks
    off = part.to(tl.int64) * pf_stride + (c - part * pf_chunks).to(tl.int64) * CHUNK
    addr = pf_ptr.to(tl.int64) + tl.where(c < pf_total, off, 0)  # lanes past the end fetch chunk 0 again
    if MODE == 1:
        r = tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
            "=r,l,r",
            [addr, tl.full([LANES], CHUNK, tl.int32)],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        r = tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32, is_pure=True, pack=1
        )
    # The asm is declared pure so PyTorch's mutation analysis sees no write to the weights (else it would copy them
    # every call); a pure result nobody reads would be deleted, so it feeds a store that never happens (r is 0).
    tl.store(out_ptr + c * 0, r.to(out_ptr.dtype.element_ty), mask=r != 0)


@triton.jit
def _gemv_kernel(
    x_ptr,
    g_ptr,
    w_ptr,
    r_ptr,
    out_ptr,
    pf_ptr,
    pf_chunks,
    pf_total,
    pf_stride,
    N,
    K: tl.constexpr,
    EPS: tl.constexpr,
    NORM: tl.constexpr,
    GLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    OUT_F32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    PF_LANES: tl.constexpr,
    PF_CHUNK: tl.constexpr,
    PF_MODE: tl.constexpr,
):
    """out[n] = sum_k W[n, k] * x'[k] (+ r[n]) for BLOCK_N rows, with x' = RMSNorm(x) * g when NORM. With GLU, W
    holds 2N rows (gate, then up) and out[n] = silu(gate[n]) * up[n]. Roundings follow the eager bf16 model
    (each linear's output is bf16 before the next elementwise op); the sum is float32. Programs past the rows
    prefetch (`_prefetch_l2`)."""
    pid = tl.program_id(0)
    if pid >= tl.cdiv(N, BLOCK_N):
        if PREFETCH:
            _prefetch_l2(
                pf_ptr, pid - tl.cdiv(N, BLOCK_N), pf_chunks, pf_total, pf_stride, out_ptr, PF_LANES, PF_CHUNK, PF_MODE
            )
    else:
        rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
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


def _launch_gemv(
    x, w, *, g=None, residual=None, eps=0.0, glu=False, out_f32=False, config=None, pf=None, pf_bytes=0, pf_parts=1
):
    """Launch `_gemv_kernel`; `config` (BLOCK_N, BLOCK_K, num_warps, num_stages) overrides the table (sweeps);
    `pf`: the tensor whose first `pf_bytes` (over `pf_parts` parts) the programs after the rows prefetch."""
    n = w.shape[0] // 2 if glu else w.shape[0]
    k = w.shape[1]
    kind = "add" if residual is not None else "rms_glu" if glu else "rms_f32" if out_f32 else "rms"
    block_n, block_k, warps, stages = config or gemv_config(kind, n, k)
    out = torch.empty(n, dtype=torch.float32 if out_f32 else x.dtype, device=x.device)
    plan = _prefetch_plan(pf, pf_bytes, pf_parts, warps)
    wrap_triton(_gemv_kernel)[(triton.cdiv(n, block_n) + plan["programs"],)](
        x,
        g if g is not None else x,  # unused pointers: any tensor
        w,
        residual if residual is not None else x,
        out,
        pf if plan["programs"] else x,
        *plan["args"],
        n,
        k,
        EPS=eps,
        NORM=g is not None,
        GLU=glu,
        RESIDUAL=residual is not None,
        OUT_F32=out_f32,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **plan["constexprs"],
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton_op("voxtral::rms_gemv", mutates_args=())
def rms_gemv(
    x: torch.Tensor,
    g: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    glu: bool,
    out_f32: bool,
    pf: Optional[torch.Tensor] = None,  # noqa: UP045 (torch.library reads the annotation; the H200's torch is older)
    pf_bytes: int = 0,
    pf_parts: int = 1,
) -> torch.Tensor:
    """x [K] bf16, g [K] (RMSNorm weight), w [N, K] (or [2N, K] with glu) -> [N]; prefetches pf (see above)."""
    return _launch_gemv(x, w, g=g, eps=eps, glu=glu, out_f32=out_f32, pf=pf, pf_bytes=pf_bytes, pf_parts=pf_parts)


@triton_op("voxtral::gemv_add", mutates_args=())
def gemv_add(
    x: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor,
    pf: Optional[torch.Tensor] = None,  # noqa: UP045 (torch.library reads the annotation; the H200's torch is older)
    pf_bytes: int = 0,
    pf_parts: int = 1,
) -> torch.Tensor:
    """x [K], w [N, K], residual [N] -> residual + w @ x, bf16; prefetches pf."""
    return _launch_gemv(x, w, residual=residual, pf=pf, pf_bytes=pf_bytes, pf_parts=pf_parts)


@triton.jit
def _attention_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    pf_ptr,
    pf_chunks,
    pf_total,
    pf_stride,
    max_seq,
    SM_SCALE: tl.constexpr,
    N_KV: tl.constexpr,
    REP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr,
    PREFETCH: tl.constexpr,
    PF_LANES: tl.constexpr,
    PF_CHUNK: tl.constexpr,
    PF_MODE: tl.constexpr,
):
    """Program (kv head j, split s): rope on the REP query heads of KV head j and on its new key, then attention
    against positions [0, pos) of the cache, s-th of SPLITS contiguous slices, plus (split 0) the new position
    from registers. Split 0 writes the new key and value into the cache: no program reads that slot, so no other
    program waits for the write. Partial (max, sum, weighted V) go to m/l/acc; with one split the normalised
    output is written directly. Query rows are padded to BLOCK_H (>= 16) for tl.dot. Programs past the
    N_KV * SPLITS prefetch."""
    pid = tl.program_id(0)
    if pid >= N_KV * SPLITS:
        if PREFETCH:
            _prefetch_l2(
                pf_ptr, pid - N_KV * SPLITS, pf_chunks, pf_total, pf_stride, out_ptr, PF_LANES, PF_CHUNK, PF_MODE
            )
    else:
        j = pid // SPLITS
        s = pid % SPLITS
        pos = tl.load(pos_ptr).to(tl.int32)
        per = tl.cdiv(tl.cdiv(pos, SPLITS), BLOCK_T) * BLOCK_T
        start = s * per
        end = tl.minimum(start + per, pos)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, D)
        # rope (rotate-half): x[d] cos[d] + x[partner] sin[d] * (-1 in the first half, +1 in the second), in fp32
        # and rounded once, as Inductor compiles the model's apply_rope
        partner = (d + D // 2) % D
        cos = tl.load(cos_ptr + d).to(tl.float32)
        sin = tl.load(sin_ptr + d).to(tl.float32) * tl.where(d < D // 2, -1.0, 1.0)
        h_ok = (h < REP)[:, None]
        q_row = (j * REP + h)[:, None] * D
        q = tl.load(qkv_ptr + q_row + d[None, :], mask=h_ok, other=0.0).to(tl.float32) * cos[None, :]
        q += tl.load(qkv_ptr + q_row + partner[None, :], mask=h_ok, other=0.0).to(tl.float32) * sin[None, :]
        q = q.to(k_ptr.dtype.element_ty)
        k_row = (N_KV * REP + j) * D
        k_new = (
            tl.load(qkv_ptr + k_row + d).to(tl.float32) * cos + tl.load(qkv_ptr + k_row + partner).to(tl.float32) * sin
        )
        k_new = k_new.to(k_ptr.dtype.element_ty)
        v_new = tl.load(qkv_ptr + (N_KV * REP + N_KV + j) * D + d)
        base = j.to(tl.int64) * max_seq * D
        first = d + s * D < D  # split 0's lanes
        tl.store(k_ptr + base + pos * D + d, k_new, mask=first)
        tl.store(v_ptr + base + pos * D + d, v_new.to(v_ptr.dtype.element_ty), mask=first)
        # split 0 starts from the new position (its probability is exp(0) = 1), the others from nothing
        mine = tl.where(s == 0, 1.0, 0.0)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * SM_SCALE
        m = tl.where(s == 0, s_new, float("-inf"))
        denom = tl.zeros([BLOCK_H], dtype=tl.float32) + mine
        acc = tl.zeros([BLOCK_H, D], dtype=tl.float32) + mine * v_new.to(tl.float32)[None, :]
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
            tl.store(out_ptr + (j * REP + h)[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=h_ok)
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


def _launch_attention(
    qkv, cos, sin, k_cache, v_cache, pos, splits=None, block_t=None, *, pf=None, pf_bytes=0, pf_parts=1
):
    n_kv, max_seq, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    rep = qkv.numel() // d // n_kv - 2
    splits, block_t = splits or ATTN_SPLITS, block_t or ATTN_BLOCK_T
    block_h = max(16, triton.next_power_of_2(rep))
    out = torch.empty(rep * n_kv * d, dtype=qkv.dtype, device=qkv.device)
    m = torch.empty(n_kv * splits * block_h, dtype=torch.float32, device=qkv.device)
    denom = torch.empty_like(m)
    acc = torch.empty(n_kv * splits * block_h * d, dtype=torch.float32, device=qkv.device)
    plan = _prefetch_plan(pf, pf_bytes, pf_parts, 4)
    wrap_triton(_attention_kernel)[(n_kv * splits + plan["programs"],)](
        qkv,
        cos,
        sin,
        k_cache,
        v_cache,
        pos,
        m,
        denom,
        acc,
        out,
        pf if plan["programs"] else qkv,
        *plan["args"],
        max_seq,
        SM_SCALE=d**-0.5,
        N_KV=n_kv,
        REP=rep,
        D=d,
        BLOCK_H=block_h,
        BLOCK_T=block_t,
        SPLITS=splits,
        **plan["constexprs"],
        num_warps=4,
    )
    if splits > 1:
        wrap_triton(_combine_kernel)[(n_kv,)](m, denom, acc, out, rep, d, block_h, splits, num_warps=4)
    return out


@triton_op("voxtral::decode_attention", mutates_args={"k_cache", "v_cache"})
def decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    pf: Optional[torch.Tensor] = None,  # noqa: UP045 (torch.library reads the annotation; the H200's torch is older)
    pf_bytes: int = 0,
    pf_parts: int = 1,
) -> torch.Tensor:
    """qkv [(H + 2 H_kv) * D] (the qkv projection, before rope), cos/sin [D] at pos, caches [1, H_kv, max_seq, D]
    holding positions [0, pos), pos [1] -> attention output [H * D]; writes the roped key and the value at pos."""
    return _launch_attention(qkv, cos, sin, k_cache, v_cache, pos, pf=pf, pf_bytes=pf_bytes, pf_parts=pf_parts)
