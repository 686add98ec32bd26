"""fp8 on CUDA (`--quant fp8`): the prefill's `scaled_mm` (`torch._scaled_mm` on the fp8 tensor cores, row-wise scales)
against float64 over the same e4m3 operands, at the 3B's sizes; a tiny bf16 fp8 bundle exports with its prompt
through `_scaled_mm` (the exporter checks it against the eager, dequantising model), records it, and transcribes
with tokens the eager model's. Skipped without an sm_89+ GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import export_cached
from torch import nn

from runner.bundle import read_manifest
from runner.models.fp8_linear import Fp8Linear, scaled_mm

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an sm_89+ CUDA device"
)
AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"


@pytest.mark.parametrize("m", [1, 16, 700])
@pytest.mark.parametrize("n,k", [(128, 64), (6144, 3072), (3072, 8192), (16384, 3072)])
def test_scaled_mm_is_the_matmul_of_the_e4m3_operands(m, n, k):
    torch.manual_seed(0)
    lin = Fp8Linear.from_linear(nn.Linear(k, n, bias=False).to("cuda", torch.bfloat16))
    x = torch.randn(1, m, k, device="cuda").to(torch.bfloat16)
    got = scaled_mm(lin, x)
    sx = x[0].float().abs().amax(1, keepdim=True) / 448
    xq = (x[0].float() / sx).to(torch.float8_e4m3fn).double() * sx.double()
    want = xq @ lin.dequantize(torch.float64).T
    assert got.dtype == torch.bfloat16 and got.shape == (1, m, n)
    assert ((got[0].double() - want).abs().max() / want.abs().max()).item() < 1e-2
    plain = lin(x)[0].double()  # the dequantised matmul, which the decode steps run: within the activations' rounding
    assert ((got[0].double() - plain).abs().max() / plain.abs().max()).item() < 8e-2


@pytest.mark.parametrize("m", [1, 385])
@pytest.mark.parametrize("n,k", [(5120, 3072), (3072, 8192), (16384, 3072), (131072, 3072)])
def test_fp8_mm_is_the_product_with_the_scaled_codes_at_the_3b_sizes(m, n, k):
    """export/kernels_fp8.py's GEMM compiled for this GPU: against float64 over the same codes, and within bf16's
    rounding of the dequantised matmul (it rounds no activation, unlike scaled_mm above)."""
    from runner.export import kernels_fp8

    torch.manual_seed(0)
    lin = Fp8Linear.from_linear(nn.Linear(k, n, bias=False).to("cuda", torch.bfloat16))
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    got = kernels_fp8.fp8_mm(x, lin.qweight, lin.weight_scale)
    want = x.double() @ lin.dequantize(torch.float64).T
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-2
    plain = lin(x).double()
    assert ((got.double() - plain).abs().max() / plain.abs().max()).item() < 1e-2


def tiny_fp8(checkpoint: Path, out: Path) -> Path:
    return export_cached(
        checkpoint, out, device="cuda", dtype="bf16", quant="fp8", max_audio_chunks=1, max_seq_len=1024
    )


def transcribed(bundle: Path) -> dict:
    """`run --json --reference eager` on the speech fixture, 16 tokens: its record."""
    out = subprocess.run(
        [sys.executable, "-m", "runner", "run", "--bundle", str(bundle), "--json", "--reference", "eager",
         "--max-new-tokens", "16", "--min-new-tokens", "16", "--audio", str(AUDIO / "speech.wav")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[0])


def test_a_tiny_fp8_bundle_exports_its_prompt_through_scaled_mm_and_transcribes(tiny_checkpoint, tmp_path_factory):
    bundle = tiny_fp8(tiny_checkpoint, tmp_path_factory.mktemp("cuda") / "tiny-fp8")
    model = read_manifest(bundle).model
    assert model["quant"]["prefill"] == "scaled_mm" and "fallbacks" not in model, model.get("fallbacks")
    record = transcribed(bundle)
    assert len(record["tokens"]) == 16
    # the eager reference dequantises in its prompt too; the bundle's prompt rounds its activations to e4m3
    assert record["reference"]["ok"], record["reference"]


def test_a_failed_scaled_check_publishes_the_prefill_through_fp8_mm_and_it_transcribes(
    tiny_checkpoint, tmp_path_factory, monkeypatch
):
    """The chain's second link on this GPU: the `_scaled_mm` prefill's reference made to differ (its logits moved),
    so its self-check fails and the export takes the prefill whose GEMMs run through kernels_fp8's op. That one
    compiles, passes against the dequantised model and publishes: one reason in `model.fallbacks` (a second would
    mean it too gave way), and the bundle transcribes as the eager model does."""
    from runner.export import voxtral as export_voxtral

    forward = export_voxtral.ScaledReference.forward
    monkeypatch.setattr(export_voxtral.ScaledReference, "forward", lambda self, *a: forward(self, *a) + 100.0)
    bundle = tiny_fp8(tiny_checkpoint, tmp_path_factory.mktemp("cuda") / "tiny-fp8-widened")
    why = read_manifest(bundle).model["fallbacks"]["text_decoder"]
    assert why.startswith("self-check: ") and "; then " not in why, why
    record = transcribed(bundle)
    assert len(record["tokens"]) == 16 and record["reference"]["ok"], record["reference"]
