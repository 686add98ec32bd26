"""Weight-only int4 (`--quant int4`): packing, quantisation, the QuantLinear module against its dequantised
reference, which layers a family quantises, how the eager reference rebuilds them, and the options and inspect
line, and the CUDA decode step's trace (fake tensors). The int4 decode step's numbers are in test_kernels.py
(test_decode_step_matches_the_decoder), a whole bundle in test_quant_bundle.py, tinygemm on a GPU in
tests/cuda/test_int4_cuda.py."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from kernel_env import on_h200_target
from torch import nn

from runner.app.inspect_bundle import quant_line
from runner.errors import BundleError, ExportError
from runner.export.options import ExportOptions
from runner.export.pipeline import cache_key
from runner.export.quant import GROUP_SIZE, LEVELS, apply_quant, quantize, quantize_linear
from runner.export.voxtral import EXPORT as VOXTRAL_EXPORT
from runner.export.whisper import EXPORT as WHISPER_EXPORT
from runner.models.quant_linear import (
    LAYOUT,
    QuantLinear,
    check_shape,
    dequantize,
    group_for,
    inner_k_tiles,
    pack,
    quantized_names,
    swap_module,
    unpack,
    use_quant_layout,
)
from runner.models.state import load_state
from runner.models.voxtral import Voxtral
from runner.models.voxtral_batch import BatchDecoder, SlotCaches
from runner.models.voxtral_config import preset
from runner.models.whisper import Whisper, WhisperConfig


def codes(n, k, seed=0):
    return torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def atens_cuda_packing(q: torch.Tensor, inner: int) -> torch.Tensor:
    """aten's CUDA `_convert_weight_to_int4pack` (int4mm.cu, `matrix_to_m16n8k16_Bint4_layout`) written out loop
    by loop, for the CPU: its input is the codes two to a byte, the even column in the high nibble (gpt-fast's
    `w[:, ::2] << 4 | w[:, 1::2]`); one lane t of a warp per (n-tile, outer k-tile) writes T / 2 words."""
    n, k = q.shape
    b = (q[:, ::2] << 4 | q[:, 1::2]).tolist()
    out = torch.zeros(n // 8, k // (inner * 16), 32, inner // 2, dtype=torch.int64)
    for n_tile in range(n // 8):
        for k_outer in range(k // (inner * 16)):
            for t in range(32):
                for inner_k in range(0, inner, 2):
                    n0 = n_tile * 8 + t // 4
                    base = (k_outer * inner + inner_k) * 16 // 2
                    ks = [base + t % 4, base + t % 4 + 4, base + 8 + t % 4, base + 8 + t % 4 + 4]
                    v = [b[n0][j] for j in ks]
                    word = 0
                    for i in range(4):
                        word |= (v[i] & 0xF) << (16 + 4 * i) | (v[i] >> 4) << (4 * i)
                    out[n_tile, k_outer, t, inner_k // 2] = word
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


@pytest.mark.parametrize("n,k", [(8, 32), (16, 64), (24, 128), (8, 384)])
def test_pack_is_atens_cuda_layout_and_unpack_its_inverse(n, k):
    q = codes(n, k)
    q[0, :16] = 15  # the top nibble set: words that are negative as int32
    packed = pack(q)
    assert packed.dtype == torch.int32 and packed.shape == (
        n // 8,
        k // (inner_k_tiles(k) * 16),
        32,
        inner_k_tiles(k) // 2,
    )
    assert torch.equal(packed, atens_cuda_packing(q, inner_k_tiles(k)))
    assert (packed < 0).any()
    assert torch.equal(unpack(packed), q)


@pytest.mark.parametrize(
    "k,want", [(3072, 128), (4096, 128), (8192, 128), (384, 128), (1536, 128), (64, 64), (96, 32), (160, 32)]
)
def test_group_size_is_128_or_the_largest_tinygemm_group_dividing_the_width(k, want):
    assert group_for(k, GROUP_SIZE) == want


@pytest.mark.parametrize("k,t", [(3072, 8), (384, 8), (64, 4), (96, 2), (160, 2)])
def test_inner_k_tiles_are_the_most_that_divide_the_width(k, t):
    assert inner_k_tiles(k) == t


@pytest.mark.parametrize(
    "k,n,match", [(40, 16, "no group of 32/64/128/256"), (48, 16, "no group"), (64, 12, "not a multiple of 8")]
)
def test_shapes_tinygemm_cannot_hold_are_refused(k, n, match):
    with pytest.raises(ValueError, match=match):
        check_shape(k, n, GROUP_SIZE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_keeps_every_weight_within_half_a_step(dtype):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(24, 384, generator=g) * 0.05).to(dtype)
    w[3, :128] = 0.25  # a constant group: one value, no spread
    q, sz = quantize(w, 128, dtype)
    assert q.min() >= 0 and q.max() <= LEVELS and sz.dtype == dtype and sz.shape == (3, 24, 2)
    rec = dequantize(pack(q), sz, torch.float32)
    step = sz[..., 0].T.float().repeat_interleave(128, dim=1)
    # rounding to the nearest code, against the stored (rounded) scale and zero: half a step, and the zero's
    # own rounding at the group's ends
    slack = 0.5 * step + 2 * torch.finfo(dtype).eps * w.float().abs()
    assert ((rec - w.float()).abs() <= slack).all()
    assert torch.equal(rec[3, :128], torch.full((128,), w[3, 0].float().item()))


def test_every_code_is_used_by_a_group_spanning_its_range():
    w = torch.linspace(-1, 1, 128).repeat(2, 1)
    q, _ = quantize(w, 128, torch.float32)
    assert set(q[0].tolist()) == set(range(16))  # min-max: the 16 codes cover [min, max]


@pytest.mark.parametrize("bias", [False, True])
def test_quant_linear_equals_linear_with_the_dequantised_weight(bias):
    """QuantLinear's torch path is F.linear over its dequantised weight: against float64, exact up to float32
    rounding (the CPU methods and the CUDA prefill compute this)."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 48, bias=bias)
    if bias:
        nn.init.normal_(lin.bias)
    ql = quantize_linear(lin)
    x = torch.randn(3, 7, 256)
    want = F.linear(x.double(), ql.dequantize(torch.float64), None if lin.bias is None else lin.bias.double())
    got = ql(x)
    assert got.dtype == torch.float32 and got.shape == (3, 7, 48)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert (ql.dequantize(torch.float32) - lin.weight).abs().max() <= ql.scales_and_zeros[..., 0].max() / 2 + 1e-6


def test_voxtral_int4_replaces_the_decoder_linears_and_lm_head_only():
    m = Voxtral(preset("tiny")).init_weights(0)
    ref = copy.deepcopy(m)
    record = apply_quant(m, VOXTRAL_EXPORT, "int4")
    quantised = {n for n, mod in m.named_modules() if isinstance(mod, QuantLinear)}
    layers = m.config.text.n_layers
    assert len(quantised) == record["n_linear"] == 4 * layers + 1
    assert "language_model.lm_head" in quantised
    assert all(n.startswith("language_model.model.layers.") for n in quantised - {"language_model.lm_head"})
    # the embedding, audio tower and projector are untouched, bit for bit
    for name, p in ref.named_parameters():
        if name.startswith(("audio_tower.", "multi_modal_projector.", "language_model.model.embed_tokens")):
            assert torch.equal(dict(m.named_parameters())[name], p), name
    assert record == {
        "scheme": "int4",
        "group_size": GROUP_SIZE,
        "symmetric": False,
        "layout": LAYOUT,
        "scale_dtype": "float32",
        "modules": list(VOXTRAL_EXPORT.quant_modules),
        "n_linear": 4 * layers + 1,
    }
    assert apply_quant(Voxtral(preset("tiny")), VOXTRAL_EXPORT, "none") is None


def test_whisper_int4_leaves_the_cross_kv_projections_and_the_tied_output_alone():
    m = Whisper(WhisperConfig()).init_weights(0)
    apply_quant(m, WHISPER_EXPORT, "int4")
    quantised = {n.split(".", 3)[-1] for n, mod in m.named_modules() if isinstance(mod, QuantLinear)}
    assert quantised == {
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
        "encoder_attn.q_proj", "encoder_attn.out_proj", "fc1", "fc2",
    }  # fmt: skip
    assert isinstance(m.decoder.layers[0].encoder_attn.k_proj, nn.Linear)  # run by the audio encoder
    assert not any(isinstance(mod, QuantLinear) for mod in m.encoder.modules())
    assert isinstance(m.decoder.embed_tokens, nn.Embedding)  # the tied output projection


def test_the_eager_reference_rebuilds_the_layout_from_the_record():
    """What reference/voxtral.py does with a bundle: a model built on the meta device, the record's modules made
    QuantLinear, then the bundle's state assigned; it computes what the exported model's eager twin computes."""
    m = Voxtral(preset("tiny")).init_weights(0)
    record = apply_quant(m, VOXTRAL_EXPORT, "int4")
    m.setup_caches(32)
    with torch.device("meta"):
        rebuilt = Voxtral(m.config)
    use_quant_layout(rebuilt, record)
    load_state(rebuilt, {k: v.clone() for k, v in m.state_dict().items()}, source="test", assign=True)
    rebuilt.setup_caches(32)
    e = torch.randn(1, 5, m.config.text.dim)
    with torch.no_grad():
        assert torch.equal(rebuilt.decoder()(e, torch.arange(5)), m.decoder()(e, torch.arange(5)))


def test_whisper_reference_load_keeps_the_codes_exact():
    """load_state without `assign` converts floats to float32 first; the int32 codes must not pass through a float
    (2^31 does not fit float32's mantissa)."""
    m = Whisper(WhisperConfig()).init_weights(0)
    record = apply_quant(m, WHISPER_EXPORT, "int4")
    fresh = Whisper(WhisperConfig())
    use_quant_layout(fresh, record)
    load_state(fresh, m.state_dict(), source="test")
    for (name, a), b in zip(m.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_quant_option_is_checked_and_keys_the_compile_cache():
    with pytest.raises(ExportError, match="--quant int8: choose from none, int4"):
        ExportOptions(quant="int8")
    with pytest.raises(ExportError, match="--quant int4 on --device cuda needs --dtype bf16"):
        ExportOptions(quant="int4", device="cuda", dtype="fp32")
    ExportOptions(quant="int4", device="cuda", dtype="bf16")

    class Source:
        weights_digest = "w"

    m = Voxtral(preset("tiny"))
    plain = ExportOptions(max_seq_len=512, max_audio_chunks=1)
    keys = {cache_key(m, Source(), o, "text_decoder", {}) for o in (plain, replace(plain, quant="int4"))}
    assert len(keys) == 2


def test_inspect_line_names_the_scheme():
    record = apply_quant(Voxtral(preset("tiny")), VOXTRAL_EXPORT, "int4")
    line = quant_line(record)
    assert "int4 weight-only, groups of 128, asymmetric (scale + zero) in float32, tinygemm layout, 9 linear" in line
    assert quant_line(None) == "weights: unquantised (the bundle's dtype)"


def test_a_record_of_another_layout_is_refused_with_what_to_do():
    record = apply_quant(Voxtral(preset("tiny")), VOXTRAL_EXPORT, "int4")
    with torch.device("meta"):
        m = Voxtral(preset("tiny"))
    with pytest.raises(
        BundleError, match="'planes' layout of an older exporter, not 'tinygemm': export the bundle again"
    ):
        use_quant_layout(m, {k: v for k, v in record.items() if k != "layout"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stored_scales_and_zeros_are_what_atens_int4pack_matmul_takes(dtype):
    """aten's int4pack matmul (tinygemm on CUDA; its CPU twin here, which takes the codes as they are and the same
    scales_and_zeros) computes (q - 8) * scale + zero: our dequantised linear."""
    torch.manual_seed(0)
    lin = quantize_linear(nn.Linear(512, 96, bias=False).to(dtype))
    sz = lin.scales_and_zeros
    x = torch.randn(3, 512).to(dtype)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack(lin.qweight), 8)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, lin.group_size, sz)
    want = x.double() @ lin.dequantize(torch.float32).double().T
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err
    wrong = torch.stack([sz[..., 0], sz[..., 1] - 8 * sz[..., 0]], -1)  # the zero at code 0, not 8: 8 steps off
    bad = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, lin.group_size, wrong)
    assert ((bad.double() - want).abs().max() / want.abs().max()).item() > 10 * err
    assert torch.equal(lin.tinygemm(x), lin(x))  # off CUDA, the step's tinygemm call is the dequantised matmul


@torch.no_grad()
def test_the_batched_step_runs_int4_layers_at_a_few_rows_as_the_dequantised_model():
    """BatchDecoder calls each int4 linear through `few_rows` (tinygemm on CUDA, where B <= 32 rows): on rows at
    their own positions it computes what the same step over nn.Linear layers holding the dequantised weights does."""
    cfg = preset("tiny")
    q = Voxtral(cfg).init_weights(seed=5)
    record = apply_quant(q, VOXTRAL_EXPORT, "int4")
    plain = copy.deepcopy(q)
    for name in quantized_names(plain, record["modules"]):
        ql = plain.get_submodule(name)
        lin = nn.Linear(ql.in_features, ql.out_features, bias=False)
        lin.weight.copy_(ql.dequantize(torch.float32))
        swap_module(plain, name, lin)
    emb = torch.randn(3, 1, cfg.text.dim, generator=torch.Generator().manual_seed(1)) * 0.5
    pos = torch.tensor([0, 7, 3])
    got, want = (
        BatchDecoder(cfg.text, m.language_model, SlotCaches(cfg.text, 4, 16, torch.float32))(emb, pos)
        for m in (q, plain)
    )
    assert got.shape == (3, cfg.text.vocab_size) and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_prefill_runs_an_int4_lm_head_on_its_last_row_alone():
    """The prompt's logits are the last position's: an int4 lm_head goes through `few_rows` (tinygemm on CUDA) on
    that one row, never dequantised whole (0.8 GB at 3B for one row)."""
    m = Voxtral(preset("tiny")).init_weights(0)
    apply_quant(m, VOXTRAL_EXPORT, "int4")
    m.setup_caches(32)
    lm_head, rows = m.language_model.lm_head, []
    plain = lm_head.tinygemm
    lm_head.tinygemm = lambda x: rows.append(tuple(x.shape)) or plain(x)
    e = torch.randn(1, 6, m.config.text.dim, generator=torch.Generator().manual_seed(0))
    logits = m.decoder()(e, torch.arange(6))
    assert rows == [(1, m.config.text.dim)] and logits.shape == (1, m.config.text.vocab_size)
    m.reset_caches()
    everywhere = m.decoder()(e, torch.arange(6), every_position=True)  # scoring: every row, dequantised
    assert rows == [(1, m.config.text.dim)] and torch.allclose(everywhere[-1:], logits, atol=1e-6)


TRACE_INT4_STEP = r"""
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from runner.export.decode_step import DecodeStep
from runner.export.quant import apply_quant
from runner.export.voxtral import EXPORT as VOXTRAL_EXPORT
from runner.models.voxtral import Voxtral
from runner.models.voxtral_config import preset

cfg = preset("tiny")
with torch.device("meta"):
    m = Voxtral(cfg).to(torch.bfloat16)
m.setup_caches(64, torch.bfloat16)
record = apply_quant(m, VOXTRAL_EXPORT, "int4")
with FakeTensorMode():
    for sub in m.modules():  # every weight, code and cache as a fake CUDA tensor of its shape and dtype
        for name, p in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cuda"), False))
        for name, b in list(sub.named_buffers(recurse=False)):
            sub.register_buffer(name, torch.empty(b.shape, dtype=b.dtype, device="cuda"))
    example = (torch.empty(1, 1, cfg.text.dim, dtype=torch.bfloat16, device="cuda"),
               torch.zeros(1, dtype=torch.int64, device="cuda"))
    ep = torch.export.export(DecodeStep(cfg.text, m.language_model), example, strict=False)
calls = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
print(json.dumps({"calls": calls, "n_linear": record["n_linear"]}))
"""


def test_the_cuda_int4_step_traces_to_tinygemm_on_the_stored_buffers():
    """The CUDA branch no CPU run takes: the int4 decode step traced by torch.export with fake CUDA tensors (no GPU
    needed; in a fresh interpreter, where the Triton kernels are not interpreted) calls aten's tinygemm once per
    quantised linear, and no dequantised matmul is left in its graph."""
    pytest.importorskip("triton")
    got = on_h200_target(TRACE_INT4_STEP)
    calls = got["calls"]
    assert calls.count("aten._weight_int4pack_mm.default") == got["n_linear"] > 0
    matmuls = {f"aten.{op}.default" for op in ("mm", "addmm", "linear", "matmul", "bmm")}
    assert not matmuls & set(calls), calls
