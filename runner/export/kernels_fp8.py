"""The fp8 prefill's linear layers on CUDA without rounding the activations: a Triton GEMM that reads the e4m3 codes
as they are stored, widens them to bf16 in registers and scales each output channel's float32 sum once.

Why: `_scaled_mm` (fp8_linear.scaled_mm) rounds the prompt's activations to e4m3, and a deep random-init decoder
amplifies that rounding past the self-check's tolerance (benchmarks/NOTES.md); the dequantised prefill passes it
but writes and reads a bf16 copy of every weight per prompt. Here the weight moves once, as codes, and the sums are
the dequantised matmul's but for the weight's rounding to bf16 (a code times its scale, exact here), so it is held
to bf16's tolerance. The weight tile is tl.dot's first operand: on Hopper that operand may come from registers,
where the widening happens, and the activations from shared memory (the product is computed transposed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from runner.models import fp8_linear

# (BLOCK_N, BLOCK_M, BLOCK_K, warps, stages): a prompt's hundreds of rows, and one row (the last position's head)
TILES = {"prompt": (128, 64, 64, 4, 4), "row": (64, 16, 128, 4, 4)}


@triton.jit
def _fp8_mm_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (n block, m block): out[m, n] = scale[n] * sum_k x[m, k] * codes[n, k], computed as its transpose
    [BLOCK_N, BLOCK_M] (the codes the dot's first operand). x [M, K] and out [M, N] row-major in the compute dtype,
    codes [N, K] e4m3 row-major, scale [N] float32."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    n_ok, m_ok = n < N, m < M
    w_rows = w_ptr + n[:, None].to(tl.int64) * K  # [BLOCK_N, 1]
    x_rows = x_ptr + m[:, None].to(tl.int64) * K  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + k < K)[None, :]
        w = tl.load(w_rows + k0 + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
        x = tl.load(x_rows + k0 + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)  # [BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M]
    scale = tl.load(scale_ptr + n, mask=n_ok, other=0.0)
    y = (acc * scale[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + m[None, :].to(tl.int64) * N + n[:, None], y, mask=n_ok[:, None] & m_ok[None, :])


def tile_for(rows) -> tuple[int, int, int, int, int]:
    """The row tile for a few rows known when traced (the head's last position); a traced prompt's length is a
    symbol, and choosing by its value would guard the exported program on it: the prompt tile."""
    return TILES["row" if isinstance(rows, int) and rows <= 16 else "prompt"]


def _launch(x2: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, tile=None) -> torch.Tensor:
    (m, k), n = x2.shape, codes.shape[0]
    block_n, block_m, block_k, warps, stages = tile or tile_for(m)
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    wrap_triton(_fp8_mm_kernel)[grid](
        x2, codes, scale, out, m, N=n, K=k, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@triton_op("voxtral::fp8_mm", mutates_args=())
def fp8_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] contiguous (bf16), codes [N, K] float8_e4m3fn, scale [N] float32 -> x @ (codes * scale)^T [M, N] in
    x's dtype, the codes widened in registers and each channel's float32 sum scaled once."""
    return _launch(x, codes, scale)


def widened(lin: fp8_linear.Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """Fp8Linear's `matmul` hook: x [..., K] -> [..., N] through the op (one node in the exported graph)."""
    y = torch.ops.voxtral.fp8_mm(x.reshape(-1, x.shape[-1]).contiguous(), lin.qweight, lin.weight_scale)
    y = y if lin.bias is None else y + lin.bias
    return y.reshape(*x.shape[:-1], lin.out_features)
