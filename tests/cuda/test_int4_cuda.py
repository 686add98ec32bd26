"""int4 on CUDA (`--quant int4`): our pure-torch packing is aten's CUDA `_convert_weight_to_int4pack`, bit for bit;
tinygemm (`_weight_int4pack_mm`) on the stored buffers computes the dequantised linear; a tiny bf16 int4 bundle
exports (the exporter checks the int4 decode step against the eager model) and transcribes. Skipped without a
GPU: the GPU machine runs tests/cuda."""

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
from runner.export.quant import quantize_linear
from runner.models.quant_linear import inner_k_tiles, pack

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"


@pytest.mark.parametrize("n,k", [(64, 64), (256, 96), (6144, 3072), (3072, 8192)])
def test_pack_is_atens_cuda_packing(n, k):
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(0), dtype=torch.int32).cuda()
    bytes_ = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # gpt-fast's: the even column in the high nibble
    assert torch.equal(pack(q), torch.ops.aten._convert_weight_to_int4pack(bytes_, inner_k_tiles(k)))


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("n,k", [(128, 64), (6144, 3072), (3072, 8192)])
def test_tinygemm_is_the_dequantised_linear(m, n, k):
    torch.manual_seed(0)
    lin = quantize_linear(nn.Linear(k, n, bias=False).to("cuda", torch.bfloat16))
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    want = x.double() @ lin.dequantize(torch.float32).double().T
    got = lin.tinygemm(x)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-2


def test_a_tiny_int4_bundle_exports_and_transcribes(tiny_checkpoint, tmp_path_factory):
    bundle = export_cached(
        tiny_checkpoint,
        tmp_path_factory.mktemp("cuda") / "tiny-int4",
        device="cuda",
        dtype="bf16",
        quant="int4",
        max_audio_chunks=1,
        max_seq_len=1024,
    )
    assert read_manifest(bundle).model["quant"]["layout"] == "tinygemm"
    out = subprocess.run(
        [sys.executable, "-m", "runner", "run", "--bundle", str(bundle), "--json", "--max-new-tokens", "16",
         "--min-new-tokens", "16", "--audio", str(AUDIO / "speech.wav")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(json.loads(out.stdout.splitlines()[0])["tokens"]) == 16
