"""An fp8 bundle end to end on CPU: the tiny preset exported with `--quant fp8` in bf16 (checked against eager by the
exporter), named `-fp8`, recorded in the manifest and shown by inspect, its decoder weights stored as e4m3 codes
with float32 channel scales, its greedy tokens those of the eager model over the same dequantised weights (`run
--reference eager`), and its weights drawn again, byte for byte, when it travels without them. CPU only: the CUDA
prefill's `_scaled_mm` is tests/cuda/test_fp8_cuda.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import as_random_init, eager_checked_records, export_cached
from safetensors import safe_open

from runner.app.cli import main
from runner.bundle import read_manifest, weight_files
from runner.digests import sha256_file
from runner.export import presets
from runner.export.checkpoint import TINY_SEED, load_checkpoint, random_model
from runner.export.regenerate import regenerate

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def fp8_bundle(tiny_checkpoint, tmp_path_factory) -> Path:
    return export_cached(
        tiny_checkpoint, tmp_path_factory.mktemp("bundles") / "tiny-fp8", quant="fp8", dtype="bf16", max_audio_chunks=1
    )


def test_the_default_bundle_name_carries_fp8(tmp_path):
    start = presets.load("tiny", None, random_init=False, seed=0, dtype="bf16", device="cpu", cache_dir=tmp_path)
    out = start.default_out("cpu", "bf16", "fp8", "2.13.0+cpu")
    assert out.name == "voxtral-bundle-tiny-cpu-bf16-fp8-torch2.13"


def test_manifest_records_the_scheme_and_inspect_shows_it(fp8_bundle, capsys):
    m = read_manifest(fp8_bundle)
    quant = m.model["quant"]
    assert m.dtype == "bfloat16"
    assert quant["scheme"] == "fp8" and quant["layout"] == "e4m3-channel" and quant["n_linear"] == 9
    assert quant["from_checkpoint"] == 0 and quant["prefill"] == "dequantised" and "group_size" not in quant
    assert main(["inspect", str(fp8_bundle), "--no-verify"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "weights: fp8 (e4m3) weight-only, a float32 scale per output channel, 9 linear layers" in out


def test_decoder_weights_are_e4m3_codes_with_float32_channel_scales(fp8_bundle, tiny_checkpoint):
    """The codes are the bf16 model's weights quantised per channel: within half an e4m3 step of them."""
    m = read_manifest(fp8_bundle)
    with safe_open(str(fp8_bundle / m.methods["text_decoder"].weights), "pt") as f:
        keys = set(f.keys())
        q, scale = f.get_tensor("lm_head.qweight"), f.get_tensor("lm_head.weight_scale")
        qkv = f.get_tensor("layers.1.self_attn.qkv_proj.qweight")
    assert not any(k.endswith("_proj.weight") or k == "lm_head.weight" for k in keys)
    assert q.dtype == qkv.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (q.shape[0],)
    model, _, _ = load_checkpoint(tiny_checkpoint)
    w = model.language_model.lm_head.weight.to(torch.bfloat16).float()
    assert torch.equal(scale, w.abs().amax(1) / 448)
    assert ((q.float() * scale[:, None] - w).abs() <= w.abs() / 16 + scale[:, None] * 2**-10).all()
    with safe_open(str(fp8_bundle / m.methods["token_embedding"].weights), "pt") as f:
        assert f.get_tensor("embed_tokens.weight").dtype == torch.bfloat16  # not quantised
    assert m.methods["text_decoder_step"].weights == m.methods["text_decoder"].weights


def test_tokens_are_the_eager_models_over_the_same_dequantised_weights(fp8_bundle):
    for r in eager_checked_records(fp8_bundle):
        # teacher-forced: with our tokens as the prefix, the eager model picks each of them; the logits differ by
        # bf16 rounding alone (Inductor's kernels against eager's)
        assert r["reference"]["first_divergence"] is None and r["reference"]["ok"], r["reference"]
        assert r["reference"]["max_logit_error"] <= 2e-2 * max(r["reference"]["logit_scale"], 1.0)


def test_a_random_init_fp8_bundle_regenerates_its_codes_byte_for_byte(fp8_bundle, tmp_path):
    """The tiny preset drawn in bf16 is the seeded checkpoint rounded to bf16: quantised again, the same codes."""
    want = {n: sha256_file(fp8_bundle / n) for n in weight_files(read_manifest(fp8_bundle))}
    drawn = random_model("tiny", TINY_SEED, torch.bfloat16)[1]
    bundle = as_random_init(fp8_bundle, tmp_path / "b", weights_digest=drawn.weights_digest)
    assert sorted(regenerate(bundle)) == sorted(want)
    assert {n: sha256_file(bundle / n) for n in want} == want
