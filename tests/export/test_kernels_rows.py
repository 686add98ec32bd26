"""The batched step's linears (runner/export/kernels_rows.py) against torch in float64: every kind (norm folded,
SiLU(gate) * up, residual, float32 logits), bf16 weights and e4m3 codes with a scale per row, ragged sizes, a row
count below the compiled row block (the rows past B neither read nor written), and the tiny model's batched step
through them against the written-out step. On a GPU the kernels are compiled; without one, Triton's interpreter
runs them (float16: it computes tl.dot on bfloat16 wrongly)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_env import DEV, DOT_DTYPE, on_h200_target  # before the kernels: on a CPU machine they are interpreted

pytest.importorskip("triton")

from runner.export import kernels_batch as KB  # noqa: E402
from runner.export import kernels_rows as KR  # noqa: E402
from runner.export.quant import apply_quant  # noqa: E402
from runner.export.voxtral import EXPORT as VOXTRAL_EXPORT  # noqa: E402
from runner.models.fp8_linear import quantize as quantize_fp8  # noqa: E402
from runner.models.voxtral import Voxtral  # noqa: E402
from runner.models.voxtral_batch import BatchDecoder, BatchKernels, SlotCaches  # noqa: E402
from runner.models.voxtral_config import preset  # noqa: E402

EPS = 1e-5


def rms64(x, g):
    h = x.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * g.double()


def rel(got, want) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).abs().max() / want.abs().max()).item()


def inputs(rows, n, k, w_rows, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(DEV, DOT_DTYPE)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(DEV, DOT_DTYPE)
    w = (torch.randn(w_rows * n, k, generator=g) * 0.05) * torch.linspace(0.2, 3.0, w_rows * n)[:, None]
    r = torch.randn(rows, n, generator=g).to(DEV, DOT_DTYPE)
    return x, norm, w.to(DEV, DOT_DTYPE), r


def launch(kind, x, norm, w, r, scale=None, max_rows=0, config=None):
    glu = kind == "rms_glu"
    if kind == "add":
        return KR._launch_rows(x, w, scale=scale, residual=r, max_rows=max_rows, config=config)
    return KR._launch_rows(
        x, w, g=norm, scale=scale, eps=EPS, glu=glu, out_f32=kind == "rms_f32", max_rows=max_rows, config=config
    )


def want(kind, x, norm, wd, r, n):
    """float64 over the weight the kernel stands for (bf16/fp16 values, or codes * scale)."""
    xs = x.double().cpu() if kind == "add" else rms64(x.cpu(), norm.cpu())
    y = xs @ wd.T
    if kind == "add":
        return r.double().cpu() + y
    return F.silu(y[:, :n]) * y[:, n:] if kind == "rms_glu" else y


# ragged sizes (masks on columns and K) and exact multiples; configs smaller and larger than the matrix
SHAPES = [(48, 64), (37, 100), (96, 128)]
CONFIGS = [(16, 32, 4, 1), (32, 64, 4, 2), (64, 256, 4, 1)]


@pytest.mark.parametrize("kind", ["rms", "rms_glu", "rms_f32", "add"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows,max_rows", [(1, 32), (3, 16), (8, 8), (19, 32)])
def test_rows_match_float64(kind, n, k, rows, max_rows):
    """A bf16 (fp16 in the interpreter) weight: within a few roundings of the dtype (the norm's input is rounded
    before the dot, each output once or twice). A row's norm taken over another row, or the up half's rows
    mistaken, is off by tens of percent."""
    x, norm, w, r = inputs(rows, n, k, 2 if kind == "rms_glu" else 1, seed=rows * 7 + n)
    got = launch(kind, x, norm, w, r, max_rows=max_rows, config=CONFIGS[rows % 3])
    assert got.shape == (rows, n) and got.dtype == (torch.float32 if kind == "rms_f32" else x.dtype)
    assert rel(got, want(kind, x, norm, w.double().cpu(), r, n)) < 2e-2


@pytest.mark.parametrize("kind", ["rms", "rms_glu", "rms_f32", "add"])
@pytest.mark.parametrize("n,k", SHAPES[1:])
def test_fp8_rows_match_float64_over_the_same_codes(kind, n, k):
    """e4m3 codes with a distinct scale per weight row (the up half's included): against float64 over codes *
    scale. A scale left out or applied to the wrong column is off by the rows' spread of scales."""
    x, norm, w, r = inputs(5, n, k, 2 if kind == "rms_glu" else 1, seed=n)
    codes, scale = quantize_fp8(w.cpu().float())
    wd = codes.double() * scale.double()[:, None]
    got = launch(kind, x, norm, codes.to(DEV), r, scale=scale.to(DEV), max_rows=8)
    assert got.shape == (5, n)
    assert rel(got, want(kind, x, norm, wd, r, n)) < 2e-2


def test_rows_past_the_batch_are_neither_read_nor_written():
    """B = 3 rows in a block of 32: x's rows past B hold NaN (a slot's garbage) and must not reach the output; the
    output is exactly [B, N]."""
    x, norm, w, r = inputs(8, 48, 64, 1, seed=9)
    x[3:] = float("nan")
    got = launch("rms", x[:3], norm, w, r[:3], max_rows=32)
    assert got.shape == (3, 48) and torch.isfinite(got).all()
    alone = launch("rms", x[:3].clone(), norm, w, r[:3], max_rows=16)
    assert torch.equal(got, alone)  # the row block's size changes nothing but the padding


def test_row_blocks_and_table():
    assert [KR.block_rows(b) for b in (1, 8, 16, 17, 32)] == [16, 16, 16, 32, 32]
    assert KR.rows_config("rms_fp8", 10, 20, 16) == KR.rows_config("rms", 10, 20, 16)
    assert KR.rows_config("rms", 10, 20, 16)[1] == 32  # BLOCK_K no wider than K's power of two (>= 16 for tl.dot)


@pytest.mark.parametrize("quant", ["none", "fp8"])
@torch.no_grad()
def test_tiny_batched_step_through_the_kernels_matches_the_written_out_step(quant):
    """The tiny model's batched step with every Triton op (the row linears and the attention) against the written-out
    step (torch linears over the same weights; fp8: the dequantised weight), three rows at their own positions
    over several steps: logits and slot caches. A linear wired to the wrong norm or residual is off by far more."""
    cfg = preset("tiny")
    m = Voxtral(cfg).init_weights(seed=5).to(DEV, DOT_DTYPE)
    apply_quant(m, VOXTRAL_EXPORT, quant)
    rows = KR.RowLinears(max_rows=4)
    g = torch.Generator().manual_seed(1)
    results = []
    for kernels in (BatchKernels(KB.attend, rows.rms_linear, rows.linear_add), BatchKernels()):
        slots = SlotCaches(cfg.text, 4, 48, DOT_DTYPE, DEV)
        step = BatchDecoder(cfg.text, m.language_model, slots, kernels)
        g.manual_seed(1)
        logits = []
        for start in (0, 9, 20, 31):
            pos = torch.tensor([start, start + 3, 2 * start % 40], device=DEV)
            emb = (torch.randn(3, 1, cfg.text.dim, generator=g) * 0.5).to(DEV, DOT_DTYPE)
            logits.append(step(emb, pos))
        results.append((logits, [b.clone() for b in slots.buffers()]))
    (ours, our_caches), (written, written_caches) = results
    for a, w in zip(ours, written):
        assert a.dtype == torch.float32 and a.shape == w.shape
        assert rel(a, w) < 2e-2
    assert max(rel(a, w) for a, w in zip(our_caches, written_caches)) < 2e-2


COMPILE = r"""
from runner.export import kernels_rows as KR

out = {}
for kind, n, k, glu, block_b in (("rms_glu", 8192, 3072, True, 32), ("add", 3072, 8192, False, 16)):
    for fp8 in (False, True):
        block_n, block_k, warps, stages = KR.rows_config(kind + ("_fp8" if fp8 else ""), n, k, block_b)
        flags = dict(NORM=kind != "add", GLU=glu, SCALED=fp8, RESIDUAL=kind == "add", OUT_F32=False)
        consts = dict(K=k, EPS=1e-5, **flags, BLOCK_B=block_b, BLOCK_N=block_n, BLOCK_K=block_k, PDL=True)
        sig = {"x_ptr": "*bf16", "g_ptr": "*bf16", "w_ptr": "*fp8e4nv" if fp8 else "*bf16", "s_ptr": "*fp32",
               "r_ptr": "*bf16", "out_ptr": "*bf16", "B": "i32", "N": "i32", **dict.fromkeys(consts, "constexpr")}
        c = triton.compile(ASTSource(KR._rows_kernel, sig, consts), target=H200,
                           options={"num_warps": warps, "num_stages": stages})
        z = lambda size, dt=torch.bfloat16: torch.zeros(size, dtype=dt)
        kw = dict(x_ptr=z(4 * k), g_ptr=z(k), w_ptr=z(2 * n * k), s_ptr=z(2 * n, torch.float32), r_ptr=z(4 * n),
                  out_ptr=z(4 * n), B=4, N=n, **consts)
        out[f"{kind}{'_fp8' if fp8 else ''}"] = {"local": ".local" in c.asm["ptx"], "shared": c.metadata.shared,
                                                "writes": written(KR._rows_kernel, kw)}
print(json.dumps(out))
"""


def test_the_3b_tiles_compile_for_the_h200_and_write_only_their_output():
    """Compiled for sm_90 here (no GPU needed) at two 3B shapes and row blocks, bf16 and e4m3, with the PDL wait:
    no spills to local memory, within shared memory; AOTInductor's analysis finds each writes its output alone."""
    got = on_h200_target(COMPILE)
    assert len(got) == 4
    for kind, v in got.items():
        assert v["writes"] == ["out_ptr"], kind
        assert not v["local"] and v["shared"] <= 227 * 1024, kind
