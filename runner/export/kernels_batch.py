"""A Triton kernel for the attention of the batched decode step (`text_decoder_batch`), compiled into its `.so` by
AOTInductor: each row attends to its own slot's valid positions only.

Why hand-written: the written-out attention of runner/models/voxtral_batch.py reads every slot's whole cache and
makes a float32 score per position, valid or not: with many slots of a long context that is the whole slot cache
read per step, where the rows' valid positions are a few hundred each. Here program (row b, KV head j, split s) reads positions [0, pos[b]] of slot b, its s-th slice, with the
query heads of KV head j together (as the decode kernel does); the splits are merged by a few torch ops after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from runner.export.kernels_attention import ATTN_BLOCK_T, attend_positions, attention_splits, split_range


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
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Program (row b, KV head j, split s): row b's REP query heads of KV head j against its s-th slice of slot b's
    positions [0, pos[b]]; the partial softmax (max, sum, weighted values) to m/l/acc. An empty slice leaves
    m = -inf, l = 0, acc = 0, which the merge weighs as nothing. Query rows padded to BLOCK_H (>= 16) for tl.dot."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.program_id(2)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    head = b.to(tl.int64) * H_KV + j
    q = tl.load(q_ptr + (head * REP + tl.minimum(h, REP - 1))[:, None] * D + d[None, :])  # pads repeat row REP-1
    base = head * max_seq * D
    start, end = split_range(pos, s, SPLITS, BLOCK_T)
    m, denom, acc = attend_positions(q, k_ptr + base, v_ptr + base, start, end, BLOCK_H, D, BLOCK_T, SM_SCALE)
    part = (head * SPLITS + s) * BLOCK_H + h
    tl.store(m_ptr + part, m)
    tl.store(l_ptr + part, denom)
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc)


def _launch_batch(q, keys, values, pos, splits=None, block_t=None):
    b, n_kv, rep, d = q.shape
    max_seq = keys.shape[2]
    splits, block_t = splits or attention_splits(max_seq), block_t or ATTN_BLOCK_T
    block_h = max(16, triton.next_power_of_2(rep))
    m = torch.empty(b, n_kv, splits, block_h, dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    acc = torch.empty(b, n_kv, splits, block_h, d, dtype=torch.float32, device=q.device)
    wrap_triton(_batch_attention_kernel)[(b, n_kv, splits)](
        q,
        keys,
        values,
        pos,
        m,
        denom,
        acc,
        max_seq,
        H_KV=n_kv,
        SM_SCALE=d**-0.5,
        REP=rep,
        D=d,
        BLOCK_H=block_h,
        BLOCK_T=block_t,
        SPLITS=splits,
        num_warps=4,
    )
    # the splits merged: split 0 always holds position 0, so the largest max is finite
    w = torch.exp(m - m.amax(dim=2, keepdim=True))  # [B, H_kv, SPLITS, BLOCK_H]; an empty split weighs 0
    y = (acc * w[..., None]).sum(dim=2) / (denom * w).sum(dim=2)[..., None]  # [B, H_kv, BLOCK_H, D]
    return y[:, :, :rep].to(q.dtype)


@triton_op("voxtral::batch_attention", mutates_args={})
def batch_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One decode step's attention for B rows in their slots: q [B, H_kv, rep, D] contiguous (RoPE applied, query
    heads folded), keys/values [B, H_kv, max_seq, D] (slots 0..B-1, this step's key and value already written), pos
    [B] int64 -> [B, H_kv, rep, D] in q's dtype. Row b reads positions [0, pos[b]] of slot b, nothing past them."""
    return _launch_batch(q, keys, values, pos)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """BatchDecoder's hook: this op, as one node in the exported graph."""
    return torch.ops.voxtral.batch_attention(q, keys, values, pos)
