"""Triton kernels for the attention of the batched decode step (`text_decoder_batch`), compiled into its `.so` by
AOTInductor: each row attends to its own slot's valid positions only.

Why hand-written: the written-out attention of runner/models/voxtral_batch.py reads every slot's whole cache and
makes a float32 score per position, valid or not: with many slots of a long context that is the whole slot cache
read per step, where the rows' valid positions are a few hundred each. Here program (row b, KV head j, split s)
reads positions [0, pos[b]] of slot b, its s-th slice, with the query heads of KV head j together (as the decode
kernel does), and a second kernel merges each row's splits. Written as torch ops, the merge was four Inductor
kernels that grew with the batch as fast as the attention itself (benchmarks/NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from runner.export.kernels_attention import active_splits, attend_positions, attention_splits, merge_splits, split_range

# Positions per block: shorter than the batch-1 step's, as the slices of a few hundred positions are short
# (benchmarks/NOTES.md has the sweep of splits x block length at the 3B's shapes).
BATCH_BLOCK_T = 64


@triton.jit
def _batch_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    max_seq,
    H_KV: tl.constexpr,
    SM_SCALE: tl.constexpr,
    REP: tl.constexpr,
    REP_P2: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Program (row b, KV head j, split s): row b's REP query heads of KV head j against its s-th slice of slot b's
    positions [0, pos[b]]; the partial softmax (max, sum, weighted values) of its REP_P2 first query rows to
    m/l/acc. A split past the row's active ones has no positions: it writes nothing, and the merge reads nothing
    of it. Query rows padded to BLOCK_H (>= 16) for tl.dot, the padding repeating row REP - 1."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.program_id(2)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    if s >= active_splits(pos, SPLITS, BLOCK_T):
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    head = b.to(tl.int64) * H_KV + j
    q = tl.load(q_ptr + (head * REP + tl.minimum(h, REP - 1))[:, None] * D + d[None, :])
    base = head * max_seq * D
    start, end = split_range(pos, s, SPLITS, BLOCK_T)
    m, denom, acc = attend_positions(q, k_ptr + base, v_ptr + base, start, end, BLOCK_H, D, BLOCK_T, SM_SCALE)
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


def _launch_batch(q, keys, values, pos, splits=None, block_t=None):
    b, n_kv, rep, d = q.shape
    max_seq = keys.shape[2]
    splits, block_t = splits or attention_splits(max_seq), block_t or BATCH_BLOCK_T
    rep_p2 = triton.next_power_of_2(rep)
    block_h = max(16, rep_p2)
    m = torch.empty(b, n_kv, splits, rep_p2, dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    acc = torch.empty(b, n_kv, splits, rep_p2, d, dtype=torch.float32, device=q.device)
    shape = dict(H_KV=n_kv, REP=rep, REP_P2=rep_p2, D=d, BLOCK_T=block_t, SPLITS=splits)
    wrap_triton(_batch_attention_kernel)[(b, n_kv, splits)](
        q, keys, values, pos, m, denom, acc, max_seq, SM_SCALE=d**-0.5, BLOCK_H=block_h, num_warps=4, **shape
    )
    out = torch.empty_like(q)
    wrap_triton(_batch_merge_kernel)[(b, n_kv)](pos, m, denom, acc, out, num_warps=4, **shape)
    return out


@triton_op("voxtral::batch_attention", mutates_args={})
def batch_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One decode step's attention for B rows in their slots: q [B, H_kv, rep, D] contiguous (RoPE applied, query
    heads folded), keys/values [B, H_kv, max_seq, D] (slots 0..B-1, this step's key and value already written), pos
    [B] int64 -> [B, H_kv, rep, D] in q's dtype. Row b reads positions [0, pos[b]] of slot b, nothing past them."""
    return _launch_batch(q, keys, values, pos)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """BatchDecoder's hook: this op, as one node in the exported graph."""
    return torch.ops.voxtral.batch_attention(q, keys, values, pos)
