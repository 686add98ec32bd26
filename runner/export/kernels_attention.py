"""The decode step's attention (one token), a Triton kernel compiled into the CUDA `text_decoder_step` by AOTInductor:

  - `decode_attention`: one kernel per layer for everything between the qkv GEMV and o_proj: RoPE, the cache
    write, and flash-decoding over the valid positions only (the query heads of one KV head together), its
    splits merged in the kernel;
  - `rope_table`: cos and sin of the step's position, once per step.

The batched step's attention (kernels_batch.py) runs the same `attend_step` for each row and merges the splits with
the same `merge_splits`. Registered with `torch.library.triton_op`, as kernels.py's GEMVs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from runner.export.kernels import after_predecessor

# Splits of the positions per KV head, and positions per block (benchmarks/NOTES.md has the sweep). A cache of
# LONG_CACHE positions or more (the 10-minute bundle) gets LONG_SPLITS: with few splits a long cache leaves most
# SMs idle, each program streaming thousands of positions; at a short position the extra splits find nothing to do
# (a split is at least BLOCK_T positions) and exit.
ATTN_SPLITS, ATTN_BLOCK_T = 4, 128
LONG_CACHE, LONG_SPLITS = 4096, 16


def attention_splits(max_seq: int) -> int:
    return LONG_SPLITS if max_seq >= LONG_CACHE else ATTN_SPLITS


@triton.jit
def _rope_table_kernel(pos_ptr, inv_freq_ptr, out_ptr, HALF: tl.constexpr):
    """cos and sin of this position's rotation angles, as `model.rope` computes them (float32, then the model's
    dtype): out[0] = cos, out[1] = sin, each [2 * HALF] (the angles repeated for the two halves)."""
    i = tl.arange(0, 2 * HALF)
    f = tl.load(pos_ptr).to(tl.float32) * tl.load(inv_freq_ptr + i % HALF)
    tl.store(out_ptr + i, tl.cos(f).to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + 2 * HALF + i, tl.sin(f).to(out_ptr.dtype.element_ty))


@triton_op("voxtral::rope_table", mutates_args=())
def rope_table(pos: torch.Tensor, inv_freq: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """pos [1], inv_freq [D / 2] float32 -> [2, D] (cos, sin) in like's dtype. An op of its own, computed once per
    step: written as torch ops, Inductor recomputed cos/sin in two kernels per layer, inside each consumer's
    inputs (benchmarks/NOTES.md)."""
    half = inv_freq.shape[0]
    out = torch.empty(2, 2 * half, dtype=like.dtype, device=like.device)
    wrap_triton(_rope_table_kernel)[(1,)](pos, inv_freq, out, HALF=half, num_warps=1)
    return out


@triton.jit
def _rope_rows(x_ptr, rows, d, cos, sin, HALF: tl.constexpr):
    """Rotate-half RoPE of rows `rows` of a row-major [*, 2*HALF] tensor, in float32 and rounded once, as Inductor
    computes it in the compiled text_decoder (eager rounds x * cos and rotate_half(x) * sin first: 1 ulp apart)."""
    x = tl.load(x_ptr + rows[:, None] * (2 * HALF) + d[None, :]).to(tl.float32)
    partner = tl.load(x_ptr + rows[:, None] * (2 * HALF) + ((d + HALF) % (2 * HALF))[None, :]).to(tl.float32)
    rot = tl.where((d < HALF)[None, :], -partner, partner)
    return (x * cos[None, :] + rot * sin[None, :]).to(x_ptr.dtype.element_ty)


@triton.jit
def split_range(pos, s, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Split s's slice [start, end) of positions [0, pos]: SPLITS slices of whole BLOCK_T blocks (the last ones
    may be empty)."""
    per = _split_size(pos + 1, SPLITS, BLOCK_T)
    start = s * per
    return start, tl.minimum(start + per, pos + 1)


@triton.jit
def _split_size(n_valid, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr):
    return tl.cdiv(tl.cdiv(n_valid, SPLITS), BLOCK_T) * BLOCK_T


@triton.jit
def active_splits(pos, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr):
    """How many of split_range's slices of [0, pos] hold a position: the first ones (the rest are empty)."""
    return tl.cdiv(pos + 1, _split_size(pos + 1, SPLITS, BLOCK_T))


@triton.jit
def attend_positions(
    q, k_ptr, v_ptr, start, end, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, SM_SCALE: tl.constexpr
):
    """Online softmax of q [BLOCK_H, D] over cached positions [start, end) of one head's keys and values (k_ptr,
    v_ptr at its position 0, D per position) -> (max, sum, weighted values) [BLOCK_H], [BLOCK_H], [BLOCK_H, D] in
    float32; an empty range gives -inf, 0, 0."""
    d = tl.arange(0, D)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < end
        k = tl.load(k_ptr + t[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * SM_SCALE
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + t[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    return m, denom, acc


@triton.jit
def attend_step(
    qkv_ptr,
    cos,
    sin,
    k_ptr,
    v_ptr,
    base,
    pos,
    s,
    j,
    H: tl.constexpr,
    H_KV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr,
    SM_SCALE: tl.constexpr,
):
    """One token's attention for KV head j over split s's slice of positions [0, pos] -> the partial softmax (max,
    sum, weighted values) of its BLOCK_H query rows (the REP heads of KV head j, padding rows repeating row REP - 1).

    qkv_ptr: the token's q, k, v rows [(H + 2 H_KV), D] as the qkv projection wrote them (no RoPE yet); cos/sin
    [D] float32 of its position; k_ptr/v_ptr + base: KV head j's cache [max_seq, D]. RoPE on the query rows and
    the new key here; the new position comes from registers, not from the cache: every program computes the new
    key and value itself, split 0 writes them to the cache at `pos`, and no program reads that slot, so none
    waits for the write."""
    REP: tl.constexpr = H // H_KV
    HALF: tl.constexpr = D // 2
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    one = tl.arange(0, 1)
    q = _rope_rows(qkv_ptr, j * REP + tl.minimum(h, REP - 1), d, cos, sin, HALF)
    k_new = _rope_rows(qkv_ptr, H + j + one, d, cos, sin, HALF)  # [1, D]
    v_new = tl.load(qkv_ptr + (H + H_KV + j + one)[:, None] * D + d[None, :])
    if s == 0:
        tl.store(k_ptr + base + pos * D + d[None, :], k_new)
        tl.store(v_ptr + base + pos * D + d[None, :], v_new)
    # this split's slice of positions [0, pos]: cached ones [start, min(end, pos)), the new one if end > pos
    start, end = split_range(pos, s, SPLITS, BLOCK_T)
    m, denom, acc = attend_positions(
        q, k_ptr + base, v_ptr + base, start, tl.minimum(end, pos), BLOCK_H, D, BLOCK_T, SM_SCALE
    )
    if (start <= pos) & (pos < end):
        score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * SM_SCALE  # [BLOCK_H]
        m_new = tl.maximum(m, score)
        alpha = tl.exp(m - m_new)
        p = tl.exp(score - m_new)
        denom = denom * alpha + p
        # p rounded as tl.dot's bf16 operand rounds it for the cached positions
        acc = acc * alpha[:, None] + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
        m = m_new
    return m, denom, acc


@triton.jit
def merge_splits(
    m_ptr,
    l_ptr,
    acc_ptr,
    first,
    ROWS: tl.constexpr,
    active,
    SPLITS: tl.constexpr,
    REP_P2: tl.constexpr,
    D: tl.constexpr,
    CACHE: tl.constexpr,
):
    """The partial softmaxes of splits [first, first + active) merged -> [REP_P2, D] float32. Split i's partials
    are rows (first + i) * ROWS + r of m/l [*] and acc [*, D]; the splits past `active` are not read (they wrote
    nothing). CACHE: the loads' cache modifier."""
    sp = tl.arange(0, SPLITS)
    r = tl.arange(0, REP_P2)
    d = tl.arange(0, D)
    parts = (first + sp)[:, None] * ROWS + r[None, :]  # [SPLITS, REP_P2]
    on = (sp < active)[:, None]
    ms = tl.load(m_ptr + parts, mask=on, other=float("-inf"), cache_modifier=CACHE)
    w = tl.exp(ms - tl.max(ms, axis=0)[None, :])  # an empty split (m = -inf) weighs nothing
    total = tl.sum(tl.load(l_ptr + parts, mask=on, other=0.0, cache_modifier=CACHE) * w, axis=0)
    accs = tl.load(acc_ptr + parts[:, :, None] * D + d[None, None, :], mask=on[:, :, None], other=0.0,
                   cache_modifier=CACHE)  # fmt: skip
    return tl.sum(accs * w[:, :, None], axis=0) / total[:, None]


@triton.jit
def _attention_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    count_ptr,
    count_offset,
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    max_seq,
    SM_SCALE: tl.constexpr,
    H: tl.constexpr,
    H_KV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    REP_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (kv head j, split s) of one decode step: `attend_step` (RoPE on the REP query heads of KV head j and
    on its new key, read raw from the qkv GEMV's output, then attention over the s-th of SPLITS slices of [0, pos]).

    - The splits are merged by whichever finishes last (a per-head counter, zero on entry and reset to zero by
      the last): partials go to m/l/acc, a CTA barrier, then an acq_rel atomic; the last reads the partials back
      from L2 (.cg). No combine kernel, so no second launch on attention's latency path.
    - With PDL it waits for the qkv GEMV only before reading qkv (see `_gemv_kernel`)
    Query rows are padded to BLOCK_H (>= 16) for tl.dot."""
    REP: tl.constexpr = H // H_KV
    j = tl.program_id(0)
    s = tl.program_id(1)
    pos = tl.load(pos_ptr).to(tl.int32)
    active = active_splits(pos, SPLITS, BLOCK_T)
    if s >= active:  # no positions here: gone before the PDL wait, the merge counts only the active splits
        return
    h = tl.arange(0, BLOCK_H)
    h_ok = h < REP
    d = tl.arange(0, D)
    cos = tl.load(cos_ptr + d).to(tl.float32)
    sin = tl.load(sin_ptr + d).to(tl.float32)
    if PDL:  # qkv is the kernel before's output; pos, cos/sin and the counters were written before that one ran
        qkv_ptr += tl.multiple_of(after_predecessor(j), 16)
    m, denom, acc = attend_step(
        qkv_ptr, cos, sin, k_ptr, v_ptr, j.to(tl.int64) * max_seq * D, pos, s, j,
        H, H_KV, D, BLOCK_H, BLOCK_T, SPLITS, SM_SCALE,
    )  # fmt: skip

    if active == 1:  # one split holds every position (always so with SPLITS 1): no partials, no merge
        rows = (j * REP + h)[:, None] * D + d[None, :]
        tl.store(out_ptr + rows, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    else:
        part = (j * SPLITS + s) * BLOCK_H + h
        tl.store(m_ptr + part, m)
        tl.store(l_ptr + part, denom)
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc)
        tl.debug_barrier()  # every thread's partials stored before the count says so
        if tl.atomic_add(count_ptr + count_offset + j, 1, sem="acq_rel") == active - 1:
            tl.store(count_ptr + count_offset + j, 0)  # the count back to zero: the buffer is ready for the next step
            r = tl.arange(0, REP_P2)  # the real query rows only (BLOCK_H pads them for tl.dot)
            # partials read back from L2 (.cg): other CTAs wrote them
            o = merge_splits(m_ptr, l_ptr, acc_ptr, j * SPLITS, BLOCK_H, active, SPLITS, REP_P2, D, ".cg")
            out_rows = (j * REP + r)[:, None] * D + d[None, :]
            tl.store(out_ptr + out_rows, o.to(out_ptr.dtype.element_ty), mask=(r < REP)[:, None])


def _launch_attention(
    qkv, cos, sin, k_cache, v_cache, pos, counters, counter_offset, splits=None, block_t=None, launch=None, *, pdl=False
):
    """`launch`: Triton's launch options (num_warps, num_stages) for a sweep; the table's otherwise."""
    n_kv, max_seq, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    n_heads = qkv.shape[0] // d - 2 * n_kv
    splits, block_t = splits or attention_splits(max_seq), block_t or ATTN_BLOCK_T
    rep_p2 = triton.next_power_of_2(n_heads // n_kv)
    block_h = max(16, rep_p2)
    out = torch.empty(n_heads * d, dtype=qkv.dtype, device=qkv.device)
    m = torch.empty(n_kv * splits * block_h, dtype=torch.float32, device=qkv.device)
    denom = torch.empty_like(m)
    acc = torch.empty(n_kv * splits * block_h * d, dtype=torch.float32, device=qkv.device)
    wrap_triton(_attention_kernel)[(n_kv, splits)](
        qkv,
        cos,
        sin,
        k_cache,
        v_cache,
        pos,
        counters,
        counter_offset,
        m,
        denom,
        acc,
        out,
        max_seq,
        SM_SCALE=d**-0.5,
        H=n_heads,
        H_KV=n_kv,
        D=d,
        BLOCK_H=block_h,
        REP_P2=rep_p2,
        BLOCK_T=block_t,
        SPLITS=splits,
        PDL=pdl,
        **(launch or {"num_warps": 4}),
    )
    return out


@triton_op("voxtral::decode_attention", mutates_args={"k_cache", "v_cache", "counters"})
def decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    counters: torch.Tensor,
    counter_offset: int,
    pdl: bool = False,
) -> torch.Tensor:
    """One decode step's attention: qkv [(H + 2 H_kv) * D] as the qkv GEMV wrote it (no RoPE yet), cos/sin [D] of
    this position, caches [1, H_kv, max_seq, D] (this position's key and value are written here), pos [1],
    counters int32, zero in the H_KV slots from counter_offset (a multiple of 16: every layer specialises alike)
    and left zero -> [H * D]."""
    return _launch_attention(qkv, cos, sin, k_cache, v_cache, pos, counters, counter_offset, pdl=pdl)
