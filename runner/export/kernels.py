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
    with rope and the cache write of the new position folded in, and the splits merged by the last one to finish
    (one kernel per layer where there were four: rope, cache write, attention, combine).

Every op is registered with `torch.library.triton_op`, so torch.export keeps it as one node and AOTInductor
compiles the Triton kernel into the `.so`. Triton is imported only here: CPU exports never load this module.
"""

from __future__ import annotations

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
    ("add", 3072, 4096): (2, 2048, 8, 1),
    ("rms_glu", 8192, 3072): (2, 4096, 4, 1),
    ("add", 3072, 8192): (2, 4096, 8, 1),
    ("rms_f32", 131072, 3072): (8, 1024, 4, 3),
}
DEFAULT_GEMV = (8, 512, 4, 2)
# Splits of the positions per KV head, and positions per block: 7.8 us/layer at 512 positions and 9.2 at 1000
# (the written-out attention: 30.4 and 28.7).
ATTN_SPLITS, ATTN_BLOCK_T = 4, 128


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
def _rope_table_kernel(pos_ptr, out_ptr, THETA: tl.constexpr, D: tl.constexpr):
    """out = [cos, sin] at pos, as the model's `rope` computes them: inv_freq = 1 / theta^(2i/D) and pos * inv_freq
    in float32, cos/sin rounded to the output dtype. pow, the division and cos/sin run in float64 and are rounded
    once, so they land on torch's correctly rounded float32 values (theta is taken as a float32 constant)."""
    d = tl.arange(0, D)
    i2 = (2 * (d % (D // 2))).to(tl.float64)
    p32 = tl.exp2(i2 / D * tl.log2(tl.full([D], THETA, tl.float64))).to(tl.float32)
    freq = (tl.load(pos_ptr).to(tl.float32) * (1.0 / p32.to(tl.float64)).to(tl.float32)).to(tl.float64)
    tl.store(out_ptr + d, tl.cos(freq).to(tl.float32).to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + D + d, tl.sin(freq).to(tl.float32).to(out_ptr.dtype.element_ty))


@triton_op("voxtral::rope_table", mutates_args=())
def rope_table(pos: torch.Tensor, like: torch.Tensor, theta: float, head_dim: int) -> torch.Tensor:
    """pos [1] -> [cos, sin] [2 * head_dim] in like's dtype, once per step for every layer's attention. One kernel
    of its own: computed inside attention (float64, on its latency path) it cost 3.5 us per layer, and as torch
    ops Inductor recomputed it in two kernels per layer (session 12's sweeps, `h200/step_sweep_s12*`)."""
    out = torch.empty(2 * head_dim, dtype=like.dtype, device=like.device)
    wrap_triton(_rope_table_kernel)[(1,)](pos, out, THETA=float(theta), D=head_dim, num_warps=4)
    return out


@triton.jit
def _attention_kernel(
    qkv_ptr,
    rot_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    count_ptr,
    count_off,
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    max_seq,
    SM_SCALE: tl.constexpr,
    N_KV: tl.constexpr,
    REP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Program (kv head j, split s): rope on the REP query heads of KV head j and on its new key, then attention
    against positions [0, pos) of the cache, s-th of SPLITS contiguous slices, plus (split 0) the new position
    from registers. Split 0 writes the new key and value into the cache: no program reads that slot, so none
    waits for the write. Each split leaves its partial (max, sum, weighted V) in m/l/acc and counts itself in
    count[count_off + j] (zero at the start); the split that counts last merges them. Query rows are padded to BLOCK_H
    (>= 16) for tl.dot."""
    pid = tl.program_id(0)
    j = pid // SPLITS
    s = pid % SPLITS
    pos = tl.load(pos_ptr).to(tl.int32)
    per = tl.cdiv(tl.cdiv(pos, SPLITS), BLOCK_T) * BLOCK_T
    start = s * per
    end = tl.minimum(start + per, pos)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    # rope (rotate-half): x[d] cos[d] + x[partner] sin[d] * (-1 in the first half, +1 in the second), in fp32
    # and rounded once, as Inductor compiles the model's apply_rope; cos/sin from `rope_table`
    partner = (d + D // 2) % D
    cos = tl.load(rot_ptr + d).to(tl.float32)
    sin = tl.load(rot_ptr + D + d).to(tl.float32) * tl.where(d < D // 2, -1.0, 1.0)
    h_ok = (h < REP)[:, None]
    q_row = (j * REP + h)[:, None] * D
    q = tl.load(qkv_ptr + q_row + d[None, :], mask=h_ok, other=0.0).to(tl.float32) * cos[None, :]
    q += tl.load(qkv_ptr + q_row + partner[None, :], mask=h_ok, other=0.0).to(tl.float32) * sin[None, :]
    q = q.to(k_ptr.dtype.element_ty)
    k_row = (N_KV * REP + j) * D
    k_new = tl.load(qkv_ptr + k_row + d).to(tl.float32) * cos + tl.load(qkv_ptr + k_row + partner).to(tl.float32) * sin
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
        tl.store(out_ptr + q_row + d[None, :], (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=h_ok)
    else:
        part = (j * SPLITS + s) * BLOCK_H + h
        tl.store(m_ptr + part, m)
        tl.store(l_ptr + part, denom)
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc)
        # Every thread's partial is stored (the barrier) before the count, whose release publishes them to the
        # split that counts last; that split's acquire, and loads from L2 (.cg), then see all of them. This
        # merge replaces a combine kernel per layer.
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + count_off + j, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            mx = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
            for r in tl.static_range(SPLITS):
                mx = tl.maximum(mx, tl.load(m_ptr + (j * SPLITS + r) * BLOCK_H + h, cache_modifier=".cg"))
            total = tl.zeros([BLOCK_H], dtype=tl.float32)
            o = tl.zeros([BLOCK_H, D], dtype=tl.float32)
            for r in tl.static_range(SPLITS):
                other = (j * SPLITS + r) * BLOCK_H + h
                w = tl.exp(tl.load(m_ptr + other, cache_modifier=".cg") - mx)  # splits with nothing: m = -inf, w = 0
                total += tl.load(l_ptr + other, cache_modifier=".cg") * w
                o += tl.load(acc_ptr + other[:, None] * D + d[None, :], cache_modifier=".cg") * w[:, None]
            tl.store(out_ptr + q_row + d[None, :], (o / total[:, None]).to(out_ptr.dtype.element_ty), mask=h_ok)


def _launch_attention(qkv, rot, k_cache, v_cache, pos, counts, count_off=0, splits=None, block_t=None):
    n_kv, max_seq, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    rep = qkv.numel() // d // n_kv - 2
    splits, block_t = splits or ATTN_SPLITS, block_t or ATTN_BLOCK_T
    block_h = max(16, triton.next_power_of_2(rep))
    out = torch.empty(rep * n_kv * d, dtype=qkv.dtype, device=qkv.device)
    m = torch.empty(n_kv * splits * block_h, dtype=torch.float32, device=qkv.device)
    denom = torch.empty_like(m)
    acc = torch.empty(n_kv * splits * block_h * d, dtype=torch.float32, device=qkv.device)
    wrap_triton(_attention_kernel)[(n_kv * splits,)](
        qkv, rot, k_cache, v_cache, pos, counts, count_off, m, denom, acc, out, max_seq,
        SM_SCALE=d**-0.5, N_KV=n_kv, REP=rep, D=d, BLOCK_H=block_h, BLOCK_T=block_t, SPLITS=splits, num_warps=4,
    )  # fmt: skip
    return out


@triton_op("voxtral::decode_attention", mutates_args={"k_cache", "v_cache", "counts"})
def decode_attention(
    qkv: torch.Tensor,
    rot: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    counts: torch.Tensor,
    count_off: int,
) -> torch.Tensor:
    """qkv [(H + 2 H_kv) * D] (the qkv projection, before rope), rot [2 D] (`rope_table` at pos), caches [1, H_kv, max_seq, D]
    holding positions [0, pos), pos [1], counts int32 with zeros at [count_off, count_off + H_kv) (one buffer for
    the whole step: one fill, not one per layer; each layer's are left at the split count) -> attention output
    [H * D]; writes the roped key and the value at pos."""
    return _launch_attention(qkv, rot, k_cache, v_cache, pos, counts, count_off)
