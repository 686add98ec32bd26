"""Triton kernels for the attention of the batched decode step (`text_decoder_batch`), compiled into its `.so` by
AOTInductor: each row attends to its own slot's valid positions only.

Why hand-written: the written-out attention of runner/models/voxtral_batch.py reads every slot's whole cache and
makes a float32 score per position, valid or not: with many slots of a long context that is the whole slot cache
read per step, where the rows' valid positions are a few hundred each. Here program (row b, KV head j, split s) does
for row b what the batch-1 step's attention kernel does (`kernels_attention.attend_step`): RoPE on the query heads
of KV head j and the new key, the new key and value written to slot b at pos[b], and the s-th slice of positions
[0, pos[b]]; a second kernel merges each row's splits. Written as torch ops, the RoPE, the cache writes and the
queries' copy were three Inductor kernels a layer, and the merge four that grew with the batch as fast as the
attention itself (benchmarks/NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from runner.export.kernels_attention import active_splits, attend_step, attention_splits, merge_splits

# Positions per block: shorter than the batch-1 step's, as the slices of a few hundred positions are short
# (benchmarks/NOTES.md has the sweep of splits x block length at the 3B's shapes).
BATCH_BLOCK_T = 64


@triton.jit
def _batch_attention_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    max_seq,
    H: tl.constexpr,
    H_KV: tl.constexpr,
    SM_SCALE: tl.constexpr,
    REP_P2: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Program (row b, KV head j, split s): `attend_step` for row b (its qkv row, cos/sin of pos[b], slot b's
    caches), the partial softmax of its REP_P2 first query rows to m/l/acc. A split past the row's active ones has
    no positions: it writes nothing (split 0, which writes the caches, is always active), and the merge reads
    nothing of it."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.program_id(2)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    if s >= active_splits(pos, SPLITS, BLOCK_T):
        return
    d = tl.arange(0, D)
    cos = tl.load(cos_ptr + b * D + d).to(tl.float32)
    sin = tl.load(sin_ptr + b * D + d).to(tl.float32)
    head = b.to(tl.int64) * H_KV + j
    m, denom, acc = attend_step(
        qkv_ptr + b.to(tl.int64) * (H + 2 * H_KV) * D, cos, sin, k_ptr, v_ptr, head * max_seq * D, pos, s, j,
        H, H_KV, D, BLOCK_H, BLOCK_T, SPLITS, SM_SCALE,
    )  # fmt: skip
    h = tl.arange(0, BLOCK_H)
    part = (head * SPLITS + s) * REP_P2 + h
    kept = h < REP_P2
    tl.store(m_ptr + part, m, mask=kept)
    tl.store(l_ptr + part, denom, mask=kept)
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=kept[:, None])


@triton.jit
def _batch_merge_kernel(
    pos_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    H_KV: tl.constexpr,
    REP: tl.constexpr,
    REP_P2: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Program (row b, KV head j): the active splits' partials of row b's query heads of KV head j merged, its REP
    real query rows written in the output's dtype."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    head = b.to(tl.int64) * H_KV + j
    active = active_splits(pos, SPLITS, BLOCK_T)
    o = merge_splits(m_ptr, l_ptr, acc_ptr, head * SPLITS, REP_P2, active, SPLITS, REP_P2, D, "")
    r = tl.arange(0, REP_P2)
    d = tl.arange(0, D)
    rows = (head * REP + r)[:, None] * D + d[None, :]
    tl.store(out_ptr + rows, o.to(out_ptr.dtype.element_ty), mask=(r < REP)[:, None])


def _launch_batch(qkv, cos, sin, k_cache, v_cache, pos, splits=None, block_t=None):
    b, n_kv, max_seq, d = qkv.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    n_heads = qkv.shape[1] - 2 * n_kv
    rep = n_heads // n_kv
    splits, block_t = splits or attention_splits(max_seq), block_t or BATCH_BLOCK_T
    rep_p2 = triton.next_power_of_2(rep)
    m = torch.empty(b, n_kv, splits, rep_p2, dtype=torch.float32, device=qkv.device)
    denom = torch.empty_like(m)
    acc = torch.empty(b, n_kv, splits, rep_p2, d, dtype=torch.float32, device=qkv.device)
    shape = dict(H_KV=n_kv, REP_P2=rep_p2, D=d, BLOCK_T=block_t, SPLITS=splits)
    wrap_triton(_batch_attention_kernel)[(b, n_kv, splits)](
        qkv, cos, sin, k_cache, v_cache, pos, m, denom, acc, max_seq,
        H=n_heads, SM_SCALE=d**-0.5, BLOCK_H=max(16, rep_p2), num_warps=4, **shape,
    )  # fmt: skip
    out = torch.empty(b, n_kv, rep, d, dtype=qkv.dtype, device=qkv.device)
    wrap_triton(_batch_merge_kernel)[(b, n_kv)](pos, m, denom, acc, out, REP=rep, num_warps=4, **shape)
    return out


@triton_op("voxtral::batch_attention", mutates_args={"k_cache", "v_cache"})
def batch_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
) -> torch.Tensor:
    """One decode step's attention for B rows in their slots: qkv [B, H + 2 H_kv, D] contiguous as the qkv
    projection wrote it (no RoPE yet), cos/sin [B, D] of each row's position, the slot caches [slots, H_kv,
    max_seq, D] (row b's new key and value are written to slot b at pos[b]), pos [B] int64 -> [B, H_kv, rep, D]
    in qkv's dtype. Row b reads positions [0, pos[b]) of slot b, nothing past them, and its new one from registers."""
    return _launch_batch(qkv, cos, sin, k_cache, v_cache, pos)


def attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv, pos: torch.Tensor) -> torch.Tensor:
    """BatchDecoder's hook: this op, as one node in the exported graph, over `kv`'s (a SlotKV's) caches."""
    return torch.ops.voxtral.batch_attention(qkv.contiguous(), cos, sin, kv.k_cache, kv.v_cache, pos)
