"""The int4 decode GEMVs (runner/export/kernels_int4.py) against torch on the dequantised weight, and the int4
DecodeStep against its written-out decoder. On a GPU the kernels are compiled; without one Triton's interpreter
runs them on the CPU (as test_kernels.py). Speed: benchmarks/int4_kernels.py on the H200."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_env import DEV, DOT_DTYPE  # before the kernels: on a CPU machine they are interpreted

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


# ragged rows and groups (masks), one group per tile and several, group sizes below 128 (narrow layers), configs
# with and without the next tile prefetched, one warp and four
SHAPES = [(37, 384, 128), (48, 256, 64), (16, 64, 64)]
CONFIGS = [(8, 1, 4, 1), (4, 2, 1, 2), (16, 4, 4, 2)]


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_int4_gemv_add(n, k, group, config):
    ql, x, _, r, w = inputs(n, k, group)
    got = K4._launch_int4_gemv(x, ql.qweight, ql.scales, ql.offsets, residual=r, config=config)
    assert got.dtype == BF16 and got.shape == (n,)
    wx = w @ x.double()
    assert within(got, bf(bf(wx) + r.double()), wx)


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_int4_rms_gemv(n, k, group, config):
    ql, x, norm, _, w = inputs(n, k, group, seed=1)
    got = K4._launch_int4_gemv(x, ql.qweight, ql.scales, ql.offsets, g=norm, eps=1e-5, config=config)
    assert within(got, bf(w @ normed(x, norm)))


@pytest.mark.parametrize("n,k,group", SHAPES[:2])
def test_int4_rms_gemv_glu(n, k, group):
    """The fused gate_up weight: rows [0, n) gate, [n, 2n) up; out = silu(gate) * up, rounded as kernels.py does."""
    ql, x, norm, _, w = inputs(n, k, group, rows=2, seed=2)
    gate, up = (w @ normed(x, norm)).chunk(2)
    want = bf(bf(F.silu(bf(gate))) * bf(up))
    got = K4._launch_int4_gemv(x, ql.qweight, ql.scales, ql.offsets, g=norm, eps=1e-5, glu=True, config=(8, 2, 4, 2))
    assert got.shape == (n,) and within(got, want, ulps=3)  # the gate's and up's roundings, then the product's


def test_int4_rms_gemv_float32_logits():
    ql, x, norm, _, w = inputs(40, 256, 128, seed=3)
    got = K4._launch_int4_gemv(x, ql.qweight, ql.scales, ql.offsets, g=norm, eps=1e-5, out_f32=True)
    assert got.dtype == torch.float32 and within(got, bf(w @ normed(x, norm)))


def test_int4_ops_are_the_launches():
    """The registered ops (what the exported step calls) give the launches' results."""
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
