"""The decode-step Triton kernels (runner/export/kernels.py, kernels_attention.py) against torch: the math, the masks at ragged sizes,
the split-and-combine of attention, and the whole DecodeStep against the written-out decoder. On a GPU the
kernels are compiled; without one, Triton's interpreter runs them on the CPU (TRITON_INTERPRET=1). Speed is
measured on the H200 (benchmarks/decode_kernels.py); the export's self-check compares the compiled step with the
decoder too. The interpreter computes tl.dot on bfloat16 wrongly, so there attention and the step run in
float16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_env import DEV, DOT_DTYPE, on_h200_target  # before the kernels: on a CPU machine they are interpreted

pytest.importorskip("triton")

from runner.export import kernels as K  # noqa: E402
from runner.export import kernels_attention as KA  # noqa: E402
from runner.export.decode_step import DecodeStep  # noqa: E402
from runner.export.quant import apply_quant  # noqa: E402
from runner.export.voxtral import EXPORT as VOXTRAL_EXPORT  # noqa: E402
from runner.models.fp8_linear import quantize as quantize_fp8  # noqa: E402
from runner.models.voxtral import Voxtral, apply_rope, rope, rope_inv_freq  # noqa: E402
from runner.models.voxtral_config import preset  # noqa: E402


def rms(x, g, eps):
    h = x.float()
    return g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rel(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _gemv_inputs(n, k, rows=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    x = torch.randn(k, generator=g).to(DEV, bf)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(DEV, bf)
    w = (torch.randn(rows * n, k, generator=g) * 0.05).to(DEV, bf)
    r = torch.randn(n, generator=g).to(DEV, bf)
    return x, norm, w, r


# ragged sizes (masks on rows and columns) and exact multiples; configs smaller and larger than the matrix
SHAPES = [(48, 64), (37, 100), (96, 128)]
CONFIGS = [(8, 32, 4, 1), (2, 64, 4, 1), (16, 256, 4, 1)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_rms_gemv(n, k, config):
    x, norm, w, _ = _gemv_inputs(n, k)
    want = F.linear(rms(x, norm, 1e-5), w)
    got = K._launch_gemv(x, w, g=norm, eps=1e-5, config=config)
    assert got.dtype == torch.bfloat16 and got.shape == (n,)
    assert rel(got, want) < 1e-2  # a bf16 rounding or two: the norm's scale is applied after the sum


@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_add(n, k):
    x, _, w, r = _gemv_inputs(n, k, seed=1)
    got = K._launch_gemv(x, w, residual=r, config=(4, 32, 4, 1))
    assert rel(got, r + F.linear(x, w)) < 1e-2


@pytest.mark.parametrize("n,k", SHAPES)
def test_rms_gemv_glu(n, k):
    """The fused gate_up weight: rows [0, n) gate, [n, 2n) up; out = silu(gate) * up."""
    x, norm, w, _ = _gemv_inputs(n, k, rows=2, seed=2)
    gate, up = F.linear(rms(x, norm, 1e-5), w).chunk(2)
    got = K._launch_gemv(x, w, g=norm, eps=1e-5, glu=True, config=(8, 64, 4, 1))
    assert got.shape == (n,) and rel(got, F.silu(gate) * up) < 2e-2


def _fp8(w):
    """w -> (codes, scales) and the float64 weight they stand for: the reference the fp8 GEMVs are held to."""
    codes, scale = quantize_fp8(w.cpu())
    return codes.to(DEV), scale.to(DEV), codes.double() * scale.double()[:, None]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("kind", ["rms", "rms_glu", "rms_f32", "add"])
def test_fp8_gemvs_match_float64_over_the_same_codes(n, k, kind):
    """The kernels on e4m3 codes with a scale per row against float64 over the dequantised weight: every kind, the
    scale of the up half (rows n..2n) included. The tolerance is the bf16 kernels' (the output's rounding); a scale
    left out or applied to the wrong row is off by the rows' spread of scales (tens of percent)."""
    glu = kind == "rms_glu"
    x, norm, w, r = _gemv_inputs(n, k, rows=2 if glu else 1, seed=4)
    w = w * torch.linspace(0.2, 3.0, w.shape[0], device=DEV)[:, None].to(w.dtype)  # distinct scales per row
    codes, scale, wd = _fp8(w)
    xs = rms(x, norm, 1e-5) if kind != "add" else x
    y = xs.cpu().double() @ wd.T
    if kind == "add":
        got, want = K.gemv_add_fp8(x, codes, scale, r), r.cpu().double() + y
    else:
        got = K.rms_gemv_fp8(x, norm, codes, scale, 1e-5, glu, kind == "rms_f32")
        want = F.silu(y[:n]) * y[n:] if glu else y
    assert got.shape == (n,) and got.dtype == (torch.float32 if kind == "rms_f32" else torch.bfloat16)
    assert rel(got.cpu(), want) < 2e-2


def test_rms_gemv_float32_logits():
    x, norm, w, _ = _gemv_inputs(96, 128, seed=3)
    got = K._launch_gemv(x, w, g=norm, eps=1e-5, out_f32=True, config=(8, 64, 4, 1))
    assert got.dtype == torch.float32 and rel(got, F.linear(rms(x, norm, 1e-5), w).float()) < 1e-2


def reference_attention(q, kc, vc, pos):
    """Query heads j*rep..j*rep+rep-1 against KV head j over positions 0..pos, in float32."""
    rep = q.shape[0] // kc.shape[1]
    k = kc[0, :, : pos + 1].float().repeat_interleave(rep, 0)
    v = vc[0, :, : pos + 1].float().repeat_interleave(rep, 0)
    p = torch.softmax((q.float()[:, None] @ k.transpose(-1, -2))[:, 0] * q.shape[1] ** -0.5, -1)
    return (p[:, None] @ v)[:, 0].reshape(-1)


@pytest.mark.parametrize("pos", [0, 7, 1023])
def test_rope_table(pos):
    """One kernel per step for every layer's RoPE: model.rope's cos and sin, within one rounding of the dtype."""
    d, theta = 128, 1e8
    pos_t = torch.tensor([pos], device=DEV)
    got = KA.rope_table(pos_t, rope_inv_freq(d, theta, DEV), torch.empty(0, dtype=torch.bfloat16, device=DEV))
    cos, sin = rope(pos_t, d, theta, torch.bfloat16)
    assert got.shape == (2, d) and got.dtype == torch.bfloat16
    assert (got.float() - torch.cat([cos, sin]).float()).abs().max() <= 2**-8


@pytest.mark.parametrize("pos", [0, 15, 16, 47, 63])  # one position, block edges, the last slot
# tl.dot: block_t >= 16; 16 and 64 splits (a long cache's, and the long sweep's widest) leave most of them empty here
@pytest.mark.parametrize("splits,block_t", [(1, 16), (4, 16), (8, 32), (8, 16), (16, 16), (64, 16)])
def test_decode_attention(pos, splits, block_t):
    """The fused op against apply_rope + a cache write + attention in float32: output, the written slot, every other
    slot untouched, and the split counters (the last split of each KV head merges)."""
    g = torch.Generator().manual_seed(pos)
    h, kv, d, max_seq = 4, 2, 16, 64
    qkv = torch.randn((h + 2 * kv) * d, generator=g).to(DEV, DOT_DTYPE)
    kc, vc = (torch.randn(1, kv, max_seq, d, generator=g).to(DEV, DOT_DTYPE) for _ in range(2))
    kc[:, :, pos + 1 :] = 1e4  # past the position: must not be read
    want_k, want_v = kc.clone(), vc.clone()
    cos, sin = rope(torch.tensor([pos]), d, 1e4, DOT_DTYPE)
    q, k, v = qkv.split([h * d, kv * d, kv * d])
    q = apply_rope(q.view(h, d), cos.to(DEV), sin.to(DEV))
    want_k[0, :, pos] = apply_rope(k.view(kv, d), cos.to(DEV), sin.to(DEV))
    want_v[0, :, pos] = v.view(kv, d)
    counters = torch.zeros(32, dtype=torch.int32, device=DEV)
    pos_t = torch.tensor([pos], device=DEV)
    got = KA._launch_attention(qkv, cos[0].to(DEV), sin[0].to(DEV), kc, vc, pos_t, counters, 16, splits, block_t)
    assert got.shape == (h * d,)
    assert torch.equal(vc, want_v)
    # RoPE rounded once (as Inductor's compiled decoder rounds it), eager after each product too: apart by at most
    # those roundings: eps/2 of each term (|cos|, |sin| <= 1) and of each result; other slots untouched
    raw = k.view(kv, d).float()
    bound = 1.5 * torch.finfo(DOT_DTYPE).eps * (raw.abs() + raw.roll(d // 2, -1).abs())
    assert ((kc[0, :, pos] - want_k[0, :, pos]).float().abs() <= bound).all()
    kc[0, :, pos] = want_k[0, :, pos]
    assert torch.equal(kc, want_k)
    tol = 2e-3 if DOT_DTYPE == torch.float16 else 2e-2  # bf16 probabilities in p @ V
    assert (got.float() - reference_attention(q, want_k, want_v, pos)).abs().max() < tol
    assert not counters.any()  # the last split of each head resets its count: a second call merges again
    again = KA._launch_attention(qkv, cos[0].to(DEV), sin[0].to(DEV), kc, vc, pos_t, counters, 16, splits, block_t)
    assert torch.equal(again, got)


def test_attention_splits_follow_the_capacity():
    assert KA.attention_splits(1024) == KA.ATTN_SPLITS == 4  # the headline bundle's, as tuned
    assert KA.attention_splits(8192) == KA.attention_splits(10240) == KA.LONG_SPLITS == 16


@pytest.mark.parametrize("quant", ["none", "int4", "fp8"])
def test_decode_step_matches_the_decoder(quant):
    """Prefill 8 positions with the written-out decoder, then 3 steps with each; logits and caches agree. With
    int4 (the decoder dequantises in torch) the step's linears are tinygemm on a GPU in bf16, elsewhere the
    dequantised matmul: then this checks the step's wiring (norms, residuals, SiLU * up around each linear);
    tinygemm itself: tests/cuda/test_int4_cuda.py. With fp8 the step's GEMV kernels read the e4m3 codes."""
    torch.manual_seed(0)
    m = Voxtral(preset("tiny")).init_weights(0).to(DEV, DOT_DTYPE)
    apply_quant(m, VOXTRAL_EXPORT, quant)
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
        assert rel(a, b) < tol
        if DOT_DTYPE == torch.float16:  # bf16 random logits have near ties; fp16 keeps the order here
            assert a.argmax() == b.argmax()
    assert max(rel(a, b) for a, b in zip(got_kv, want_kv)) < tol


@pytest.mark.parametrize("head_dim,kernels", [(16, True), (128, True), (8, False), (24, False)])
def test_decode_step_module_only_where_attention_can_tile(head_dim, kernels):
    """CUDA exports get the kernels when tl.dot can tile the head (a power of two >= 16), else the decoder."""
    from dataclasses import replace

    from runner.export.voxtral import decode_step_module

    c = preset("tiny")
    text = replace(c.text, head_dim=head_dim)
    m = Voxtral(replace(c, text=text))
    assert isinstance(decode_step_module(m, "cuda"), DecodeStep) == kernels
    assert not isinstance(decode_step_module(m, "cpu"), DecodeStep)


ATTENTION_COMPILE = r"""
from runner.export import kernels_attention as KA

consts = {"SM_SCALE": 128**-0.5, "H": 32, "H_KV": 8, "D": 128, "BLOCK_H": 16, "REP_P2": 4, "BLOCK_T": 128,
          "SPLITS": 16, "PDL": True}
ptrs = ("qkv_ptr", "cos_ptr", "sin_ptr", "k_ptr", "v_ptr", "pos_ptr", "count_ptr", "m_ptr", "l_ptr", "acc_ptr",
        "out_ptr")
types = {"pos_ptr": "*i64", "count_ptr": "*i32", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32"}
sig = {**{p: types.get(p, "*bf16") for p in ptrs}, "count_offset": "i32", "max_seq": "i32",
       **dict.fromkeys(consts, "constexpr")}
names = KA._attention_kernel.arg_names
attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ptrs}
k = triton.compile(ASTSource(KA._attention_kernel, sig, consts, attrs), target=H200, options={"num_warps": 4})
ptx = k.asm["ptx"]
code = [line.strip() for line in ptx.splitlines() if line.strip() and not line.strip().startswith((".loc", "//"))]
first_branch = next(i for i, line in enumerate(code) if " bra" in line)
target = code[first_branch].split()[-1].rstrip(";")
print(json.dumps({
    "exit_before_wait": first_branch < next(i for i, line in enumerate(code) if "griddepcontrol.wait" in line),
    "to_ret": code[code.index(target + ":") + 1] == "ret;",
    "atomic": "atom." in ptx, "shared": k.metadata.shared,
}))
"""


def test_the_long_cache_attention_compiles_for_the_h200_with_its_early_exit():
    """The 10-minute bundle's attention (16 splits, PDL) compiled for sm_90 by Triton here: the splits past the
    position's last branch to the exit before the PDL wait (they hold no SM slot while the qkv GEMV runs), the
    others merge through the atomic count."""
    got = on_h200_target(ATTENTION_COMPILE)
    assert got["exit_before_wait"] and got["to_ret"] and got["atomic"] and got["shared"] <= 227 * 1024
