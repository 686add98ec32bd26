"""Triton kernels for the decode step (one token), compiled into the CUDA `text_decoder_step` by AOTInductor.

Why hand-written: at one token every decoder matmul is a GEMV that streams its weight once. cuBLAS split-K'd
o_proj/down with a separate reduce kernel each, well below the bus rate, and the written-out attention read the
whole cache with three kernels per layer (benchmarks/NOTES.md has the measurements). These kernels:
  - `rms_gemv`: RMSNorm folded into the GEMV (W (g * x) * rstd: the norm's scale is applied after the sum, so
    the input is read once), optionally with SiLU(gate) * up in the epilogue (the fused gate_up weight) or a
    float32 output (lm_head);
  - `gemv_add`: a GEMV with the residual add in its epilogue;
  - `rms_gemv_fp8`, `gemv_add_fp8`: the same over e4m3 codes, each row's sum scaled once.
The step's attention is kernels_attention.py's; both wait on their predecessor alike (`after_predecessor`).

Every op is registered with `torch.library.triton_op`, so torch.export keeps it as one node and AOTInductor
compiles the Triton kernel into the `.so`. Triton is imported only by the kernels modules: CPU exports never load them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# (BLOCK_N, BLOCK_K, num_warps, num_stages) per GEMV kind, by (N, K), for the 3B shapes: tuned inside the whole
# decode step with programmatic edges (`benchmarks/decode_kernels.py --parts tune`), where a kernel starts behind
# another's tail and an isolated sweep picks other tiles (benchmarks/NOTES.md has the sweeps and their figures).
# Other shapes (the tiny model) take the default.
GEMV_CONFIGS: dict[tuple[str, int, int], tuple[int, int, int, int]] = {
    ("rms", 6144, 3072): (16, 512, 4, 3),
    ("add", 3072, 4096): (16, 1024, 4, 1),
    ("rms_glu", 8192, 3072): (2, 4096, 4, 1),
    ("add", 3072, 8192): (8, 1024, 4, 1),
    ("rms_f32", 131072, 3072): (4, 4096, 4, 1),
    # on e4m3 codes (`--parts step,tune --fp8`): where the step's best beat its bf16 kind's tile past the noise
    ("rms_glu_fp8", 8192, 3072): (4, 4096, 4, 1),
    ("rms_f32_fp8", 131072, 3072): (8, 1024, 4, 1),
}
DEFAULT_GEMV = (8, 512, 4, 2)


def gemv_config(kind: str, n: int, k: int) -> tuple[int, int, int, int]:
    """The table's config for a GEMV kind at (N, K); an fp8 kind (`rms_fp8`, ...) not in it takes its bf16 kind's."""
    base = GEMV_CONFIGS.get((kind.removesuffix("_fp8"), n, k), DEFAULT_GEMV)
    block_n, block_k, warps, stages = GEMV_CONFIGS.get((kind, n, k), base)
    return block_n, min(block_k, triton.next_power_of_2(k)), warps, stages


@triton.jit
def after_predecessor(anchor):
    """griddepcontrol.wait (the kernel before this one has finished and its writes are visible), then
    griddepcontrol.launch_dependents (the kernel after may start); returns 0, to be added to the pointers read
    afterwards. Both are no-ops in a kernel launched without programmatic dependent launch (runner/runtime/pdl.py).

    Inline asm marked pure, not Triton's gdc_wait: AOTInductor's mutation analysis (torch 2.11) cannot analyse
    the impure op, assumes every input mutated and gives the exported method an output per input (NOTES.md);
    it skips pure asm. Pure asm may move, so the reads that must follow the wait take their address from its
    result: a data dependence no compiler pass can reorder."""
    return tl.inline_asm_elementwise(
        "griddepcontrol.wait; griddepcontrol.launch_dependents; mov.u32 $0, 0;",  # no escapes: Inductor copies the source
        "=r,r",
        [anchor],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _gemv_weights(w_ptr, rows, kk, N, K: tl.constexpr, row_ok, GLU: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns kk (and the up half's with GLU; else the same tile again)."""
    ok = row_ok[:, None] & (kk < K)[None, :]
    w = tl.load(w_ptr + rows[:, None] * K + kk[None, :], mask=ok, other=0.0)
    wu = w
    if GLU:
        wu = tl.load(w_ptr + (rows[:, None] + N) * K + kk[None, :], mask=ok, other=0.0)
    return w, wu


@triton.jit
def _gemv_accumulate(
    x_ptr, g_ptr, kk, K: tl.constexpr, w, wu, acc, acc_up, sumsq, NORM: tl.constexpr, GLU: tl.constexpr
):
    k_ok = kk < K
    x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    if NORM:
        sumsq += x * x
        x = x * tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    acc += w.to(tl.float32) * x[None, :]
    if GLU:
        acc_up += wu.to(tl.float32) * x[None, :]
    return acc, acc_up, sumsq


@triton.jit
def _gemv_kernel(
    x_ptr,
    g_ptr,
    w_ptr,
    s_ptr,
    r_ptr,
    out_ptr,
    N,
    K: tl.constexpr,
    EPS: tl.constexpr,
    NORM: tl.constexpr,
    GLU: tl.constexpr,
    SCALED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    OUT_F32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[n] = sum_k W[n, k] * x'[k] (+ r[n]) for BLOCK_N rows, with x' = RMSNorm(x) * g when NORM. With GLU, W
    holds 2N rows (gate, then up) and out[n] = silu(gate[n]) * up[n]. Roundings follow the eager bf16 model
    (each linear's output is bf16 before the next elementwise op); the sum is float32.

    SCALED: W holds e4m3 codes and s [N] (2N with GLU) a float32 scale per row, W[n, k] = codes[n, k] * s[n]
    (`--quant fp8`): the codes are widened in registers and each row's sum scaled once, so the weight streams at
    one byte an element. The eager model rounds the dequantised weight to bf16 first; here it is not rounded.

    The first weight tile is loaded before anything the kernel before this one wrote: with PDL (programmatic
    dependent launch, `runner/pdl.py`) this kernel starts while that one finishes, its weights already on the
    way, and waits (griddepcontrol.wait) only before reading x and r. Launched plainly the wait is a no-op."""
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w, wu = _gemv_weights(w_ptr, rows, cols, N, K, row_ok, GLU)
    if PDL:
        ready = tl.multiple_of(after_predecessor(tl.program_id(0)), 16)
        x_ptr += ready
        r_ptr += ready
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    acc, acc_up, sumsq = _gemv_accumulate(x_ptr, g_ptr, cols, K, w, wu, acc, acc_up, sumsq, NORM, GLU)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + cols
        w, wu = _gemv_weights(w_ptr, rows, kk, N, K, row_ok, GLU)
        acc, acc_up, sumsq = _gemv_accumulate(x_ptr, g_ptr, kk, K, w, wu, acc, acc_up, sumsq, NORM, GLU)
    y = tl.sum(acc, axis=1)
    if SCALED:
        y = y * tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / K + EPS)
        y = y * rstd
    y = y.to(tl.bfloat16).to(tl.float32)
    if GLU:
        up = tl.sum(acc_up, axis=1)
        if SCALED:
            up = up * tl.load(s_ptr + rows + N, mask=row_ok, other=0.0)
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


def pdl_supported(t: torch.Tensor) -> bool:
    """Whether kernels launched on t's device can carry the grid-dependency instructions: sm_90 or later. The
    exporter compiles them in only where this holds and its options ask for it (the manifest's `pdl`: without
    it the runtime keeps every graph edge plain). Triton's interpreter has no griddepcontrol: it runs on CPU
    tensors, for which this is False."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (9, 0)


def _launch_gemv(x, w, *, g=None, scale=None, residual=None, eps=0.0, glu=False, out_f32=False, pdl=False, config=None):
    """Launch `_gemv_kernel`; `scale`: w is e4m3 codes with a float32 scale per row; `config` (BLOCK_N, BLOCK_K,
    num_warps, num_stages) overrides the table (sweeps)."""
    n = w.shape[0] // 2 if glu else w.shape[0]
    k = w.shape[1]
    kind = "add" if residual is not None else "rms_glu" if glu else "rms_f32" if out_f32 else "rms"
    block_n, block_k, warps, stages = config or gemv_config(kind + ("_fp8" if scale is not None else ""), n, k)
    out = torch.empty(n, dtype=torch.float32 if out_f32 else x.dtype, device=x.device)
    wrap_triton(_gemv_kernel)[(triton.cdiv(n, block_n),)](
        x,
        g if g is not None else x,  # unused pointers: any tensor
        w,
        scale if scale is not None else x,
        residual if residual is not None else x,
        out,
        n,
        k,
        EPS=eps,
        NORM=g is not None,
        GLU=glu,
        SCALED=scale is not None,
        RESIDUAL=residual is not None,
        OUT_F32=out_f32,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=pdl,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton_op("voxtral::rms_gemv", mutates_args=())
def rms_gemv(
    x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, eps: float, glu: bool, out_f32: bool, pdl: bool = False
) -> torch.Tensor:
    """x [K] bf16, g [K] (RMSNorm weight), w [N, K] (or [2N, K] with glu) -> [N]. `pdl`: wait for the kernel before
    (griddepcontrol) after loading the first weight tile; only where pdl_supported()."""
    return _launch_gemv(x, w, g=g, eps=eps, glu=glu, out_f32=out_f32, pdl=pdl)


@triton_op("voxtral::gemv_add", mutates_args=())
def gemv_add(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x [K], w [N, K], residual [N] -> residual + w @ x, bf16."""
    return _launch_gemv(x, w, residual=residual, pdl=pdl)


@triton_op("voxtral::rms_gemv_fp8", mutates_args=())
def rms_gemv_fp8(
    x: torch.Tensor,
    g: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    glu: bool,
    out_f32: bool,
    pdl: bool = False,
) -> torch.Tensor:
    """rms_gemv over an fp8 layer: codes [N, K] float8_e4m3fn (or [2N, K] with glu), scale [N] (2N) float32."""
    return _launch_gemv(x, codes, g=g, scale=scale, eps=eps, glu=glu, out_f32=out_f32, pdl=pdl)


@triton_op("voxtral::gemv_add_fp8", mutates_args=())
def gemv_add_fp8(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor, pdl: bool = False
) -> torch.Tensor:
    """gemv_add over an fp8 layer: residual + (codes * scale[:, None]) @ x, bf16."""
    return _launch_gemv(x, codes, scale=scale, residual=residual, pdl=pdl)
