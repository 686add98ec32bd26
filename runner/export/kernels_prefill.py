"""A Triton kernel for the prompt's attention in the CUDA `text_decoder` (prefill): causal flash attention over
the prompt's positions (and, for a prompt in pieces, `--prefill-chunk`, the positions before the piece), compiled
into the `.so` by AOTInductor.

Why hand-written: the written-out attention makes an [S * rep, S] float32 score matrix per KV head, and on
torch 2.11 CUDA only its whole-cache form ([S * rep, max_seq]) exported for a dynamic length: a long prompt spent
most of its prefill and peak memory on scores, and a short prompt cost more in a long bundle than in a short one.
This kernel keeps the
scores in registers (online softmax) and reads keys only up to each query block's last position, so the cost
follows the prompt, not the cache. As a `triton_op` it is one opaque node to torch.export, which therefore has no
score shapes to reason about.

Layout: the query heads of one KV head are folded into one program's rows (row r of KV head j is position
r // rep, query head j * rep + r % rep), so each program reads one KV head's keys once for all of its query heads.
The op reads those rows straight from the qkv projection's output and applies RoPE to them as it loads them, and
writes o_proj's input ([S, H * D]): the queries' RoPE and the two layout copies around the attention, written as
torch ops, were three kernels per layer (Inductor recomputed cos/sin inside each).

`silu_mul`: the MLP's SiLU(gate) * up on the gate_up projection's output, one pass at the bus rate (Inductor's
fused kernel for the same two ops ran well below it).

`add_layer_norm`: the audio encoder's residual add and the LayerNorm after it in one pass that reads each row once.
Inductor fuses the two into a looped reduction that reads its inputs again for the normalisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from runner.models.voxtral import PrefillKernels

LOG2E = 1.4426950408889634


def prefill_config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M query rows, BLOCK_N positions, num_warps, num_stages): for a head of 128, 128-row blocks, the
    fastest in a whole prefill, though 64-row blocks win when one cache is timed alone (its keys still in L2 from
    the call before; each block re-reads the keys below it, and half-size blocks re-read them twice as often).
    Small heads (the tiny model) take small tiles."""
    return (128, 64, 8, 3) if head_dim >= 64 else (32, 16, 4, 2)


@triton.jit
def _attend_tile(
    q,
    k_ptr,
    v_ptr,
    t0,
    end,
    q_pos,
    m,
    denom,
    acc,
    QK_SCALE,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One BLOCK_N tile of positions from t0 into the online softmax (m, denom, acc). MASKED: the tile may hold
    positions past a row's own or past `end`; unmasked tiles lie wholly below every row's position."""
    t = t0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    if MASKED:
        t_ok = t < end
        k = tl.load(k_ptr + t[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * QK_SCALE
        s = tl.where((t[None, :] <= q_pos[:, None]) & t_ok[None, :], s, float("-inf"))
    else:
        k = tl.load(k_ptr + t[:, None] * D + d[None, :])
        s = tl.dot(q, tl.trans(k)) * QK_SCALE
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(v_ptr + t[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0)
    else:
        v = tl.load(v_ptr + t[:, None] * D + d[None, :])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, denom, acc


@triton.jit
def _prefill_attention_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    out_ptr,
    n_rows,
    kv_stride_h,
    QK_SCALE: tl.constexpr,  # head_dim ** -0.5 * log2(e): the softmax in base 2
    REP: tl.constexpr,
    H_KV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (KV head j, query block i): rows [i * BLOCK_M, +BLOCK_M) of head j's folded queries, at positions
    p0 + row // REP (p0 = pos_ptr[0]: the prompt's first position, 0 unless it comes in pieces), against positions
    [0, the block's last position]; each row masked to positions <= its own.

    The blocks run last-first: a block's work grows with its position (causal), so the longest start first and
    the grid's tail is short ones. Tiles below the block's first position are visible to all its rows and skip
    the masks; only the one or two tiles on the diagonal are masked."""
    HALF: tl.constexpr = D // 2
    j = tl.program_id(0)
    i = tl.num_programs(1) - 1 - tl.program_id(1)
    rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    p0 = tl.load(pos_ptr)
    s_idx = rows // REP  # the row's position in this call
    q_pos = p0 + s_idx
    head = j * REP + rows % REP
    d = tl.arange(0, D)
    # RoPE as the compiled torch ops compute it (float32, rounded once): x * cos + rotate_half(x) * sin
    q_row = qkv_ptr + s_idx[:, None].to(tl.int64) * ((REP + 2) * H_KV * D) + head[:, None] * D
    x = tl.load(q_row + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    x_rot = tl.load(q_row + ((d + HALF) % D)[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    cs = s_idx[:, None] * D + d[None, :]
    cos = tl.load(cos_ptr + cs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + cs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q = (x * cos + tl.where((d < HALF)[None, :], -x_rot, x_rot) * sin).to(k_ptr.dtype.element_ty)
    kv_base = j.to(tl.int64) * kv_stride_h
    # positions this block needs: up to its last real row's (rows past n_rows are padding and never stored)
    end = p0 + (tl.minimum(i * BLOCK_M + BLOCK_M, n_rows) - 1) // REP + 1
    lo = (p0 + i * BLOCK_M // REP) // BLOCK_N * BLOCK_N  # below the block's first position: no row masks anything
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for t0 in range(0, lo, BLOCK_N):
        m, denom, acc = _attend_tile(
            q, k_ptr + kv_base, v_ptr + kv_base, t0, end, q_pos, m, denom, acc, QK_SCALE, D, BLOCK_N, False
        )
    for t0 in range(lo, end, BLOCK_N):
        m, denom, acc = _attend_tile(
            q, k_ptr + kv_base, v_ptr + kv_base, t0, end, q_pos, m, denom, acc, QK_SCALE, D, BLOCK_N, True
        )
    # every real row sees position 0, so its denominator is >= 1; padding rows may see none and are not stored
    out = acc / tl.maximum(denom, 1e-30)[:, None]
    o_row = out_ptr + s_idx[:, None].to(tl.int64) * (REP * H_KV * D) + head[:, None] * D  # [S, H * D]: o_proj's input
    tl.store(o_row + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _launch_prefill(qkv, cos, sin, k_cache, v_cache, cache_position, rep, config=None):
    _, n_kv, _, d = k_cache.shape
    b, s, _ = qkv.shape
    block_m, block_n, warps, stages = config or prefill_config(d)
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()  # no copies: as the model makes them
    out = qkv.new_empty(b, s, n_kv * rep * d)
    wrap_triton(_prefill_attention_kernel)[(n_kv, triton.cdiv(s * rep, block_m))](
        qkv,
        cos,
        sin,
        k_cache,
        v_cache,
        cache_position,
        out,
        s * rep,
        k_cache.stride(1),
        QK_SCALE=d**-0.5 * LOG2E,
        REP=rep,
        H_KV=n_kv,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton_op("voxtral::prefill_attention", mutates_args={})
def prefill_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_position: torch.Tensor,
    rep: int,
) -> torch.Tensor:
    """A prompt's causal attention: qkv [1, S, (H + 2 H_kv) * D] as the qkv projection wrote it (queries first, no
    RoPE yet), cos/sin [S, D] of positions cache_position = [p0, p0 + S) (p0 = 0 but for a prompt in pieces),
    k_cache/v_cache [1, H_kv, max_seq, D] holding keys (RoPE applied) and values at [0, p0 + S), rep = H / H_kv
    -> [1, S, H * D] in qkv's dtype (o_proj's input). Nothing past position p0 + S - 1 is read."""
    return _launch_prefill(qkv, cos, sin, k_cache, v_cache, cache_position, rep)


def attend(qkv, cos, sin, k_cache, v_cache, cache_position, rep: int) -> torch.Tensor:
    """The model's hook (PrefillKernels.attend): this op, as one node in the exported graph."""
    return torch.ops.voxtral.prefill_attention(qkv, cos, sin, k_cache, v_cache, cache_position, rep)


# (BLOCK_R rows, BLOCK_C columns, num_warps): each thread moves 16-byte vectors; see benchmarks/prefill_attention.py
SILU_MUL_CONFIG = (2, 1024, 4)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_rows, FFN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (row block, column block): out[r, c] = silu(gate[r, c]) * up[r, c], gate = gu[r, :FFN], up = gu[r,
    FFN:]. Rounded as the eager model rounds: SiLU in float32 to the dtype, then the product in float32 to it."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (rows < n_rows)[:, None] & (cols < FFN)[None, :]
    gate_at = gu_ptr + rows[:, None].to(tl.int64) * (2 * FFN) + cols[None, :]
    gate = tl.load(gate_at, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_at + FFN, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    out_at = out_ptr + rows[:, None].to(tl.int64) * FFN + cols[None, :]
    tl.store(out_at, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def _launch_silu_mul(gate_up: torch.Tensor, config=None) -> torch.Tensor:
    block_r, block_c, warps = config or SILU_MUL_CONFIG
    gate_up = gate_up.contiguous()  # no copy: as the projection writes it
    ffn = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], ffn)
    rows = gate_up.numel() // (2 * ffn)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(ffn, block_c))  # rows first: grid dim 0 has no 65535 cap
    wrap_triton(_silu_mul_kernel)[grid](gate_up, out, rows, FFN=ffn, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


@triton_op("voxtral::silu_mul", mutates_args={})
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * F] (gate columns, then up: the fused projection's output) -> silu(gate) * up [..., F]."""
    return _launch_silu_mul(gate_up)


@triton.jit
def _add_layer_norm_kernel(
    x_ptr, delta_ptr, w_ptr, b_ptr, sum_ptr, out_ptr, EPS: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Program r: sum = x[r] + delta[r], rounded to the dtype (the eager model's residual stream), then
    LayerNorm(sum) in float32 over its N columns -> both rows, each read and written once."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_N)
    ok = c < N
    x = tl.load(x_ptr + r * N + c, mask=ok, other=0.0)
    total = (x.to(tl.float32) + tl.load(delta_ptr + r * N + c, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
    tl.store(sum_ptr + r * N + c, total, mask=ok)
    h = total.to(tl.float32)
    mean = tl.sum(h, axis=0) / N
    centred = tl.where(ok, h - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / N + EPS)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * N + c, (centred * rstd * w + b).to(out_ptr.dtype.element_ty), mask=ok)


def _launch_add_layer_norm(x, delta, weight, bias, eps: float):
    x, delta = x.contiguous(), delta.contiguous()  # no copies: the residual stream and a GEMM's output
    n = x.shape[-1]
    total, out = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // n
    block = triton.next_power_of_2(n)
    # eps a constant: as a float argument Inductor passes it as a float64
    wrap_triton(_add_layer_norm_kernel)[(rows,)](
        x, delta, weight, bias, total, out, EPS=eps, N=n, BLOCK_N=block, num_warps=4
    )
    return total, out


@triton_op("voxtral::add_layer_norm", mutates_args={})
def add_layer_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., N] (the residual stream and what a block adds to it) -> (x + delta, LayerNorm(x + delta)
    with weight, bias [N] and eps), in x's dtype."""
    return _launch_add_layer_norm(x, delta, weight, bias, eps)


def add_norm(x: torch.Tensor, delta: torch.Tensor, norm: torch.nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's hook (PrefillKernels.add_norm): the op, as one node in the exported graph."""
    return torch.ops.voxtral.add_layer_norm(x, delta, norm.weight, norm.bias, norm.eps)


def activate(gate_up: torch.Tensor) -> torch.Tensor:
    """The model's hook (PrefillKernels.silu_mul): the op, as one node in the exported graph."""
    return torch.ops.voxtral.silu_mul(gate_up)


# what the CUDA audio_encoder and text_decoder run a prompt through
KERNELS = PrefillKernels(attend=attend, silu_mul=activate, add_norm=add_norm)
