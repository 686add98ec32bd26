"""Weight-only fp8 (`--quant fp8`): per-channel e4m3 quantisation against every e4m3 value, the Fp8Linear module
against its dequantised reference (and kept in e4m3 / float32 through `.to(dtype)`), the CUDA prefill's
`scaled_mm` (run here through the CPU's `torch._scaled_mm`) against per-token-quantised activations, when it serves,
its trace over fake CUDA tensors, the layers a family quantises, the eager reference's rebuild, and the options,
CLI and inspect line. A whole bundle is in test_fp8_bundle.py, FP8 checkpoints in test_fp8_checkpoint.py, the GPU
in tests/cuda/test_fp8_cuda.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim

from runner.app.cli import main
from runner.app.inspect_bundle import quant_line
from runner.errors import BundleError, ExportError, RunnerError
from runner.export import self_check
from runner.export import voxtral as export_voxtral
from runner.export.methods import MethodPlan, kv_cache_state
from runner.export.options import ExportOptions
from runner.export.quant import apply_quant
from runner.export.voxtral import EXPORT as VOXTRAL_EXPORT
from runner.export.whisper import EXPORT as WHISPER_EXPORT
from runner.models.fp8_linear import FP8, Fp8Linear, fp8_layers, quantize, scaled_mm, scaled_mm_serves
from runner.models.quant_linear import QuantLinear, few_rows, use_quant_layout
from runner.models.state import load_state
from runner.models.voxtral import Voxtral, silu_mul
from runner.models.voxtral_config import preset
from runner.models.whisper import Whisper, WhisperConfig

# every finite e4m3 value, from its 256 bit patterns (the two NaNs left out): the independent reference
E4M3 = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(FP8).float()
E4M3 = E4M3[~E4M3.isnan()].unique()


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Each value of x (within +-448) rounded to the nearest e4m3 value, by search over all of them."""
    return E4M3[(x.double()[..., None] - E4M3.double()).abs().argmin(-1)]


def error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


def test_quantize_rounds_each_row_to_the_nearest_e4m3_value_of_its_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 96, generator=g) * torch.logspace(-4, 1, 24)[:, None]  # rows over five decades
    w[5] = 0.0  # an all-zero row
    q, scale = quantize(w)
    assert q.dtype == FP8 and q.shape == w.shape and scale.dtype == torch.float32 and scale.shape == (24,)
    nonzero = torch.arange(24) != 5
    assert torch.equal(scale[nonzero], w[nonzero].abs().amax(1) / 448)  # each row's largest magnitude to 448
    assert torch.equal(q.float()[nonzero].abs().amax(1), torch.full((23,), 448.0))
    want = nearest_e4m3((w / scale[:, None]).clamp(-448, 448))
    ties = ((w / scale[:, None]).double()[..., None] - E4M3.double()).abs().topk(2, largest=False).values
    exact = (ties[..., 1] - ties[..., 0]) > 1e-9  # away from a tie, where round-half-even decides
    assert torch.equal(q.float()[exact], want[exact]) and exact.float().mean() > 0.99
    assert torch.equal(q.float()[5], torch.zeros(96))


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_is_the_linear_with_its_dequantised_weight(bias):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=bias).to(torch.bfloat16)
    if bias:
        nn.init.normal_(lin.bias)
    f8 = Fp8Linear.from_linear(lin)
    deq = (f8.qweight.float() * f8.weight_scale[:, None]).to(torch.bfloat16)
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    assert torch.equal(f8(x), F.linear(x, deq, lin.bias))
    # within half an e4m3 step of the weight it came from (an eighth of each power of two; subnormals: 2^-10)
    slack = lin.weight.float().abs() / 16 + f8.weight_scale[:, None] * 2**-10
    assert ((f8.dequantize(torch.float32) - lin.weight.float()).abs() <= slack + 1e-6).all()


def test_a_dtype_cast_keeps_the_codes_in_e4m3_and_the_scales_in_float32():
    """Module.to(dtype) casts every floating tensor, e4m3 ones too: an fp8 layer keeps its storage (a bf16 scale
    would move every weight of its row), its bias follows the model."""
    f8 = Fp8Linear.from_linear(nn.Linear(32, 16))
    codes, scales = f8.qweight.clone(), f8.weight_scale.clone()
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float(), lambda m: m.to("cpu")):
        cast(f8)
        assert f8.qweight.dtype == FP8 and f8.weight_scale.dtype == torch.float32
        assert torch.equal(f8.qweight.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(
            f8.weight_scale, scales
        )
    assert f8.bias.dtype == torch.float32
    with torch.device("meta"):
        empty = Fp8Linear(32, 16, True, torch.float32).to(torch.bfloat16)
    empty.to_empty(device="cpu")
    assert empty.qweight.device.type == "cpu" and empty.qweight.dtype == FP8 and empty.bias.dtype == torch.bfloat16


@pytest.mark.parametrize("m", [1, 7])
def test_scaled_mm_multiplies_per_token_quantised_activations(m):
    """The CUDA prefill's matmul, through the CPU's `torch._scaled_mm`: each row of x to e4m3 at its own scale, times
    the stored codes, both scales applied; against float64 of the same e4m3 operands, and within the activations'
    rounding of the dequantised matmul."""
    torch.manual_seed(1)
    lin = Fp8Linear.from_linear(nn.Linear(64, 48, bias=True).to(torch.bfloat16))
    x = (torch.randn(1, m, 64) * torch.logspace(-2, 1, m)[None, :, None]).to(torch.bfloat16)
    got = scaled_mm(lin, x)
    assert got.dtype == torch.bfloat16 and got.shape == (1, m, 48)
    sx = x[0].float().abs().amax(1, keepdim=True) / 448
    xq = nearest_e4m3(x[0].float() / sx)
    want = (xq * sx).double() @ lin.dequantize(torch.float64).T + lin.bias.double()
    rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item()  # noqa: E731
    assert rel(got[0], want) < 1e-2  # bf16 output
    assert rel(got[0], lin(x)[0].double()) < 8e-2  # e4m3 activations: 3 mantissa bits


def test_scaled_mm_serves_a_cuda_prefill_on_sm89_and_later_with_sizes_of_16():
    m = Voxtral(preset("tiny")).init_weights(0).to(torch.bfloat16)
    assert not scaled_mm_serves("cuda", m, (9, 0))  # no fp8 layer yet
    apply_quant(m, VOXTRAL_EXPORT, "fp8")
    assert scaled_mm_serves("cuda", m, (9, 0)) and scaled_mm_serves("cuda", m, (8, 9))
    assert scaled_mm_serves("cuda", m, (10, 0))
    assert not scaled_mm_serves("cuda", m, (8, 6))  # Ampere: no fp8 tensor cores
    assert not scaled_mm_serves("cpu", m)
    odd = nn.Module()
    odd.lin = Fp8Linear.from_linear(nn.Linear(40, 16))
    assert not scaled_mm_serves("cuda", odd, (9, 0))  # _scaled_mm takes K, N multiples of 16


class LayerAndHead(nn.Module):
    """A decoder layer's four linears and the lm_head on the last row, as the prefill calls them. The whole prefill
    is not traced here: indexing a fake CUDA tensor (`x[:, None]`, as its RoPE does) needs a CUDA build of torch;
    narrow and select do not."""

    def __init__(self, m: Voxtral):
        super().__init__()
        self.layer, self.lm_head = m.language_model.model.layers[0], m.language_model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn, mlp = self.layer.self_attn, self.layer.mlp
        x = x + attn.o_proj(attn.qkv_proj(x).narrow(-1, 0, x.shape[-1]))
        x = x + mlp.down_proj(silu_mul(mlp.gate_up_proj(x)))
        return few_rows(self.lm_head, x.select(1, -1)).float()


def test_the_cuda_prefill_traces_its_fp8_layers_to_scaled_mm():
    """The CUDA branch no CPU run takes: the prefill's fp8 layers traced by torch.export over fake CUDA tensors, with a
    dynamic prompt length, as the CUDA export traces them (export/voxtral.py's `_export_through`): one `_scaled_mm`
    per layer on the stored codes (its stride and size checks pass), no dequantised matmul, and the eager layers
    dequantising again afterwards."""
    m = Voxtral(preset("tiny")).init_weights(0).to(torch.bfloat16)
    apply_quant(m, VOXTRAL_EXPORT, "fp8")
    with FakeTensorMode():
        for sub in m.modules():  # every weight and code as a fake CUDA tensor of its shape and dtype
            for name, p in list(sub.named_parameters(recurse=False)):
                setattr(sub, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cuda"), False))
            for name, b in list(sub.named_buffers(recurse=False)):
                sub.register_buffer(name, torch.empty(b.shape, dtype=b.dtype, device="cuda"))
        x = torch.empty(1, 5, m.config.text.dim, dtype=torch.bfloat16, device="cuda")
        seq = Dim("seq", min=1, max=64)
        plan = SimpleNamespace(example=(x,), dynamic_shapes=({1: seq},))
        ep = export_voxtral._export_through(LayerAndHead(m), plan, scaled_mm)
    calls = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert calls.count("aten._scaled_mm.default") == 5, calls
    assert not {f"aten.{op}.default" for op in ("mm", "addmm", "linear", "matmul", "bmm")} & set(calls), calls
    assert not any(lin.matmul for lin in fp8_layers(m))


def test_a_scaled_mm_prefill_is_checked_against_eager_rounding_its_activations_as_it_does():
    """The self-check compares the prefill compiled onto `_scaled_mm` with eager computing the same: here against an
    emulation (each row of x to e4m3 at its own scale, times the dequantised weight), not the dequantised matmul,
    which parts from it by the activations' rounding (over the 3B's 30 random layers: past bf16's tolerance). Its
    dequantising fallback keeps the dequantised reference, and the eager layers dequantise again afterwards."""
    m = Voxtral(preset("tiny")).init_weights(0).to(torch.bfloat16)
    apply_quant(m, VOXTRAL_EXPORT, "fp8")
    m.setup_caches(16)  # eager_outputs empties them after
    head, x = LayerAndHead(m), (torch.randn(1, 9, m.config.text.dim) * 4).to(torch.bfloat16)
    plan = MethodPlan("text_decoder", head, (x,), None, SimpleNamespace(state=None), [(x,)])
    export_voxtral.scaled_mm_prefill(plan)
    widened, dequantised = plan.fallback, plan.fallback.fallback
    assert plan.key_extra == {"fp8": "scaled_mm"} and widened.key_extra == {"fp8": "fp8_mm"}
    assert dequantised.key_extra == {"fallback": "dequantised"}
    # a failed check takes the next link too (pipeline's MethodCompiler.check); the dequantised one passes on no mismatch
    assert [p.fallback_on_mismatch for p in (plan, widened, dequantised)] == [True, True, False]
    assert widened.reference is dequantised.reference is None  # both checked against the module itself, dequantising
    got = self_check.eager_outputs([plan], m)["text_decoder"][0]
    fallback = self_check.eager_outputs([dequantised], m)["text_decoder"][0]

    def emulated(lin, x):
        sx = x.float().abs().amax(-1, keepdim=True) / 448
        y = (nearest_e4m3(x.float() / sx) * sx) @ lin.dequantize(torch.float32).T
        return (y if lin.bias is None else y + lin.bias.float()).to(x.dtype)

    for lin in fp8_layers(m):
        lin.matmul = emulated
    with torch.no_grad():
        want = head(x).double()
    for lin in fp8_layers(m):
        lin.matmul = None
    rel = lambda a: ((a.double() - want).abs().max() / want.abs().max()).item()  # noqa: E731
    assert rel(got) < 2e-2 and rel(fallback) > 4 * rel(got), (rel(got), rel(fallback))
    with torch.no_grad():
        assert torch.equal(fallback, head(x)) and not any(lin.matmul for lin in fp8_layers(m))


def test_the_cuda_scaled_mm_prefill_falls_back_to_the_widened_then_the_dequantised_triton_prefill_then_the_whole_cache(
    monkeypatch,
):
    """prefill_plan as on an sm_89+ GPU with the Triton tiles (both patched in: the plan is built, not run): the chain
    is the `_scaled_mm` prefill, the prompt's GEMMs through kernels_fp8's op, the dequantised Triton prefill, then
    the whole-cache decoder, which attends over the whole cache and so is the last resort. The first two fall back
    on a failed self-check too; every link after the first is held to the dequantised reference."""
    m = Voxtral(preset("tiny")).init_weights(0).to(torch.bfloat16)
    apply_quant(m, VOXTRAL_EXPORT, "fp8")
    monkeypatch.setattr(export_voxtral, "_triton_tiles", lambda *a: True)
    monkeypatch.setattr(export_voxtral.fp8_linear, "scaled_mm_serves", lambda *a: True)
    c, S = m.config.text, 64
    state = kv_cache_state(c.n_layers, [1, c.n_kv_heads, S, c.head_dim], torch.bfloat16)
    emb = lambda s: torch.zeros(1, s, c.dim, dtype=torch.bfloat16)  # noqa: E731
    opts = ExportOptions(dtype="bf16", quant="fp8", max_audio_chunks=1, max_seq_len=S)
    reference = m.decoder()
    plan = export_voxtral.prefill_plan(m, opts, state, emb, Dim("seq", min=1, max=S), reference)
    scaled, widened, dequantised = plan, plan.fallback, plan.fallback.fallback
    whole = dequantised.fallback
    assert scaled.key_extra == {"fp8": "scaled_mm"} and isinstance(scaled.reference, export_voxtral.ScaledReference)
    assert widened.key_extra == {"fp8": "fp8_mm"} and widened.reference is reference
    assert dequantised.key_extra == {"fallback": "dequantised"} and dequantised.reference is reference
    assert widened.module is dequantised.module is scaled.module and scaled.module.prefill  # the Triton prefill
    assert widened.export is not None and dequantised.export is None  # traced through the op; plainly
    assert whole.key_extra == {"fallback": "whole-cache"} and not whole.module.prefill and whole.fallback is None
    assert [p.fallback_on_mismatch for p in (scaled, widened, dequantised, whole)] == [True, True, False, False]


def test_voxtral_fp8_quantises_the_int4_layers_and_records_them():
    m = Voxtral(preset("tiny")).init_weights(0)
    ref = copy.deepcopy(m)
    record = apply_quant(m, VOXTRAL_EXPORT, "fp8")
    int4_model = copy.deepcopy(ref)
    apply_quant(int4_model, VOXTRAL_EXPORT, "int4")
    int4 = {n for n, mod in int4_model.named_modules() if isinstance(mod, QuantLinear)}
    fp8 = {n for n, mod in m.named_modules() if isinstance(mod, Fp8Linear)}
    assert fp8 == int4 and len(fp8) == 4 * m.config.text.n_layers + 1 and "language_model.lm_head" in fp8
    for name, p in ref.named_parameters():
        if name.startswith(("audio_tower.", "multi_modal_projector.", "language_model.model.embed_tokens")):
            assert torch.equal(dict(m.named_parameters())[name], p), name
    assert record == {
        "scheme": "fp8",
        "format": "float8_e4m3fn",
        "symmetric": True,
        "layout": "e4m3-channel",
        "scale_dtype": "float32",
        "modules": list(VOXTRAL_EXPORT.quant_modules),
        "n_linear": 9,
        "from_checkpoint": 0,
    }


def test_whisper_fp8_quantises_the_layers_int4_does():
    """The family's quant_modules, whatever the scheme: the decoder's but the cross-attention K/V (run in the audio
    encoder) and the tied output projection."""
    m = Whisper(WhisperConfig()).init_weights(0)
    int4_model = copy.deepcopy(m)
    apply_quant(m, WHISPER_EXPORT, "fp8")
    apply_quant(int4_model, WHISPER_EXPORT, "int4")
    fp8 = {n for n, mod in m.named_modules() if isinstance(mod, Fp8Linear)}
    assert fp8 and fp8 == {n for n, mod in int4_model.named_modules() if isinstance(mod, QuantLinear)}


@torch.no_grad()
def test_the_eager_reference_rebuilds_the_fp8_layers_from_the_record():
    m = Voxtral(preset("tiny")).init_weights(0).to(torch.bfloat16)
    record = apply_quant(m, VOXTRAL_EXPORT, "fp8")
    m.setup_caches(32)
    with torch.device("meta"):
        rebuilt = Voxtral(m.config).to(torch.bfloat16)
    use_quant_layout(rebuilt, record)
    load_state(rebuilt, {k: v.clone() for k, v in m.state_dict().items()}, source="test", assign=True)
    rebuilt.setup_caches(32)
    e = torch.randn(1, 5, m.config.text.dim).to(torch.bfloat16)
    assert torch.equal(rebuilt.decoder()(e, torch.arange(5)), m.decoder()(e, torch.arange(5)))
    with pytest.raises(BundleError, match="'e4m3-tensor' layout, not 'e4m3-channel'"):
        use_quant_layout(rebuilt, {**record, "layout": "e4m3-tensor"})


def test_fp8_needs_bf16_on_every_device():
    for device in ("cpu", "cuda"):
        with pytest.raises(ExportError, match=r"^--quant fp8 needs --dtype bf16 \("):
            ExportOptions(quant="fp8", dtype="fp32", device=device)
        ExportOptions(quant="fp8", dtype="bf16", device=device)
    with pytest.raises(ExportError, match="--quant int8: choose from none, int4, fp8"):
        ExportOptions(quant="int8")


def test_the_cli_refuses_fp32_fp8_in_one_line_and_defaults_fp8_to_bf16(tmp_path, capsys, monkeypatch):
    from runner.export import presets

    asked = []

    def load(*args, **kwargs):
        asked.append(kwargs["dtype"])
        raise RunnerError("stopped before loading")

    monkeypatch.setattr(presets, "load", load)
    argv = ["export", "--preset", "tiny", "--device", "cpu", "--quant", "fp8", "--out", str(tmp_path / "b")]
    assert main([*argv, "--dtype", "fp32"]) == 1
    assert (
        error_line(capsys)
        == "error: --quant fp8 needs --dtype bf16 (the fp8 layers compute in bf16: torch's fp8 matmul gives bf16)"
    )
    assert asked == [] and list(tmp_path.iterdir()) == []
    assert main(argv) == 1 and asked == ["bf16"]  # no --dtype: bf16, on the CPU too
    assert "stopped before loading" in error_line(capsys)


def test_inspect_line_names_the_scheme_and_what_came_from_the_checkpoint():
    record = apply_quant(Voxtral(preset("tiny")), VOXTRAL_EXPORT, "fp8")
    line = quant_line({**record, "prefill": "dequantised"})
    assert line.startswith("weights: fp8 (e4m3) weight-only, a float32 scale per output channel, 9 linear layers")
    assert "checkpoint" not in line and "_scaled_mm" not in line
    line = quant_line({**record, "from_checkpoint": 8, "prefill": "scaled_mm"})
    assert ", 8 as the checkpoint stored them; the prompt on the fp8 tensor cores (torch._scaled_mm)" in line
