"""The int4 decode GEMVs (runner/export/kernels_int4.py) against torch on the dequantised weight, and the int4
DecodeStep against its written-out decoder. On a GPU the kernels are compiled; without one Triton's interpreter
runs them on the CPU (as test_kernels.py). Speed: benchmarks/int4_kernels.py on the H200."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":  # before the kernels are defined: @triton.jit then makes interpreted functions
    os.environ["TRITON_INTERPRET"] = "1"
DOT_DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16  # the interpreter's tl.dot is wrong in bf16
pytest.importorskip("triton")

from runner.export import kernels_int4 as K4  # noqa: E402
from runner.export.decode_step import DecodeStep  # noqa: E402
from runner.export.quant import apply_quant, quantize_linear  # noqa: E402
from runner.models.voxtral import Voxtral  # noqa: E402
from runner.models.voxtral_config import preset  # noqa: E402

BF16 = torch.bfloat16


def bf(t: torch.Tensor) -> torch.Tensor:
    """A float64 value rounded as the kernel rounds each linear's output before its epilogue."""
    return t.to(BF16).double()


def within(got: torch.Tensor, want: torch.Tensor, *scales: torch.Tensor, ulps: float = 1.0) -> bool:
    """|got - want| at most `ulps` bf16 units in the last place of each magnitude given (the wanted value's, and
    an intermediate's the kernel rounds to bf16 on the way): float32 sums in another order than float64's can move
    a rounding by one unit, never more."""
    eps = torch.finfo(BF16).eps
    bound = sum(eps * t.abs() for t in (want, *scales)) * ulps + torch.finfo(BF16).tiny
    return bool(((got.double() - want).abs() <= bound).all())


def inputs(n, k, group, rows=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, rows * n, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.05, generator=g)
    ql = quantize_linear(lin.to(BF16), group).to(DEV)
    x = torch.randn(k, generator=g).to(DEV, BF16)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(DEV, BF16)
    r = torch.randn(n, generator=g).to(DEV, BF16)
    return ql, x, norm, r, ql.dequantize(torch.float64)


def normed(x, norm, eps=1e-5):
    """The kernels' RMSNorm: x * g, then 1/rms(x) after the sum (the same in exact arithmetic)."""
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean() + eps) * norm.double()


# ragged rows and groups (masks), one group per tile and several, an odd group count, group sizes below 128 (narrow
# layers; 32, 16 and 8 put fewer than 4 words of a group in a thread), configs with and without the next tile
# prefetched, one warp and four; v2: one subtile and several (K loaded in one step, or over several), rows per thread
SHAPES = [(37, 384, 128), (48, 256, 64), (16, 64, 64)]
V2_SHAPES = SHAPES + [(24, 640, 128), (20, 96, 32), (12, 48, 16), (9, 40, 8)]
CONFIGS = [("v1", (8, 1, 4, 1)), ("v1", (4, 2, 1, 2)), ("v1", (16, 4, 4, 2))]
V2_CONFIGS = [("v2", (8, 1, 1)), ("v2", (4, 3, 1)), ("v2", (2, 2, 2))]
CASES = [(*shape, *c) for shape in SHAPES for c in CONFIGS] + [(*shape, *c) for shape in V2_SHAPES for c in V2_CONFIGS]


@pytest.mark.parametrize("n,k,group,variant,config", CASES)
def test_int4_gemv_add(n, k, group, variant, config):
    ql, x, _, r, w = inputs(n, k, group)
    got = K4._launch_int4_gemv(x, ql.qweight, ql.scales, ql.offsets, residual=r, config=config, variant=variant)
    assert got.dtype == BF16 and got.shape == (n,)
    wx = w @ x.double()
    assert within(got, bf(bf(wx) + r.double()), wx)


@pytest.mark.parametrize("n,k,group,variant,config", CASES)
def test_int4_rms_gemv(n, k, group, variant, config):
    ql, x, norm, _, w = inputs(n, k, group, seed=1)
    got = K4._launch_int4_gemv(x, ql.qweight, ql.scales, ql.offsets, g=norm, eps=1e-5, config=config, variant=variant)
    assert within(got, bf(w @ normed(x, norm)))


@pytest.mark.parametrize(
    "n,k,group,variant,config",
    [(*s, "v1", (8, 2, 4, 2)) for s in SHAPES[:2]]
    + [(*s, "v2", c) for s in SHAPES[:2] for c in ((4, 2, 1), (2, 1, 2))],
)
def test_int4_rms_gemv_glu(n, k, group, variant, config):
    """The fused gate_up weight: rows [0, n) gate, [n, 2n) up; out = silu(gate) * up, rounded as kernels.py does."""
    ql, x, norm, _, w = inputs(n, k, group, rows=2, seed=2)
    gate, up = (w @ normed(x, norm)).chunk(2)
    want = bf(bf(F.silu(bf(gate))) * bf(up))
    got = K4._launch_int4_gemv(
        x, ql.qweight, ql.scales, ql.offsets, g=norm, eps=1e-5, glu=True, config=config, variant=variant
    )
    assert got.shape == (n,) and within(got, want, ulps=3)  # the gate's and up's roundings, then the product's


@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_int4_rms_gemv_float32_logits(variant):
    ql, x, norm, _, w = inputs(40, 256, 128, seed=3)
    got = K4._launch_int4_gemv(x, ql.qweight, ql.scales, ql.offsets, g=norm, eps=1e-5, out_f32=True, variant=variant)
    assert got.dtype == torch.float32 and within(got, bf(w @ normed(x, norm)))


def test_int4_v2_large_inputs_and_constant_groups():
    """Residual-stream magnitudes (x up to ~1e3) and a constant group (scale clamped to the smallest float): the
    unpack gives q exactly, so nothing is lost to the 2^23 bias."""
    ql, x, norm, r, _ = inputs(33, 512, 128, seed=5)
    with torch.no_grad():
        ql.scales[3, 1] = torch.finfo(torch.float32).tiny
        ql.qweight[3, 16:32] = 0
    w = ql.dequantize(torch.float64)
    x = (x.float() * 300).to(BF16)
    got = K4._launch_int4_gemv(x, ql.qweight, ql.scales, ql.offsets, residual=r, variant="v2")
    wx = w @ x.double()
    assert within(got, bf(bf(wx) + r.double()), wx)
    got = K4._launch_int4_gemv(x, ql.qweight, ql.scales, ql.offsets, g=norm, eps=1e-5, variant="v2")
    assert within(got, bf(w @ normed(x, norm)))


@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_int4_ops_are_the_launches(variant, monkeypatch):
    """The registered ops (what the exported step calls) give the launches' results, with either kernel."""
    monkeypatch.setattr(K4, "INT4_VARIANT", variant)
    ql, x, norm, r, _ = inputs(24, 128, 128, seed=4)
    add = torch.ops.voxtral.int4_gemv_add(x, ql.qweight, ql.scales, ql.offsets, r, False)
    assert torch.equal(add, K4._launch_int4_gemv(x, ql.qweight, ql.scales, ql.offsets, residual=r))
    rms = torch.ops.voxtral.int4_rms_gemv(x, norm, ql.qweight, ql.scales, ql.offsets, 1e-5, False, True, False)
    assert torch.equal(rms, K4._launch_int4_gemv(x, ql.qweight, ql.scales, ql.offsets, g=norm, eps=1e-5, out_f32=True))


def test_int4_decode_step_matches_its_decoder():
    """The int4 model: prefill 8 positions with the written-out decoder (dequantised in torch), then 3 steps with
    it and with the int4 kernels; logits and caches agree as the bf16 step's do (test_kernels.py)."""
    torch.manual_seed(0)
    m = Voxtral(preset("tiny")).init_weights(0).to(DEV, DOT_DTYPE)
    apply_quant(m, "voxtral", "int4")
    m.setup_caches(64)
    dec, step = m.decoder(), DecodeStep(m.config.text, m.language_model)
    caches = [t for layer in dec.layers for t in (layer.self_attn.kv_cache.k_cache, layer.self_attn.kv_cache.v_cache)]
    e = (torch.randn(1, 11, m.config.text.dim) * 0.5).to(DEV, DOT_DTYPE)
    outputs = {}
    with torch.no_grad():
        for name, module in (("decoder", dec), ("step", step)):
            m.reset_caches()
            dec(e[:, :8], torch.arange(8, device=DEV))
            logits = [module(e[:, i : i + 1], torch.tensor([i], device=DEV)) for i in range(8, 11)]
            outputs[name] = (logits, [t.clone() for t in caches])
    (want, want_kv), (got, got_kv) = outputs["decoder"], outputs["step"]
    tol = 1e-2 if DOT_DTYPE == torch.float16 else 5e-2  # the export self-check's bf16 tolerance
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert (a - b).abs().max() / b.abs().max() < tol
        if DOT_DTYPE == torch.float16:
            assert a.argmax() == b.argmax()
    assert max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got_kv, want_kv)) < tol
