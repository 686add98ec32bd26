"""An int4 bundle end to end on CPU: `--quant int4` exported (checked against eager by the exporter), recorded in
the manifest and shown by inspect, its decoder weights stored as int32 codes with scales and offsets, and its
tokens those of the eager int4 model (`run --reference eager`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import export_cached
from safetensors import safe_open

from runner.app.cli import main
from runner.bundle import read_manifest

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"


@pytest.fixture(scope="module")
def int4_bundle(tiny_checkpoint, tmp_path_factory) -> Path:
    return export_cached(
        tiny_checkpoint, tmp_path_factory.mktemp("bundles") / "tiny-int4", quant="int4", max_audio_chunks=1
    )


def test_manifest_records_the_scheme_and_inspect_shows_it(int4_bundle, capsys):
    quant = read_manifest(int4_bundle).model["quant"]
    assert quant["scheme"] == "int4" and quant["group_size"] == 128 and quant["n_linear"] == 9
    assert main(["inspect", str(int4_bundle), "--no-verify"]) == 0
    assert "weights: int4 weight-only, groups of 128" in " ".join(capsys.readouterr().out.split())


def test_decoder_weights_are_packed_codes_and_scales_and_zeros(int4_bundle):
    m = read_manifest(int4_bundle)
    with safe_open(str(int4_bundle / m.methods["text_decoder"].weights), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("layers.0.self_attn.qkv_proj.qweight").dtype == torch.int32
        assert f.get_tensor("lm_head.scales_and_zeros").dtype == torch.float32  # the bundle's dtype
    assert {"lm_head.qweight", "lm_head.scales_and_zeros"} <= keys
    assert not any(k.endswith("_proj.weight") or k == "lm_head.weight" for k in keys)
    with safe_open(str(int4_bundle / m.methods["token_embedding"].weights), "pt") as f:
        assert f.get_tensor("embed_tokens.weight").dtype == torch.float32  # not quantised
    assert m.methods["text_decoder_step"].weights == m.methods["text_decoder"].weights


def test_tokens_are_the_eager_int4_models(int4_bundle):
    out = subprocess.run(
        [sys.executable, "-m", "runner", "run", "--bundle", str(int4_bundle), "--json", "--reference", "eager",
         "--max-new-tokens", "24", "--min-new-tokens", "24", "--audio", str(AUDIO / "speech.wav"),
         "--audio", str(AUDIO / "short.wav")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(records) == 2
    for r in records:
        assert len(r["tokens"]) == 24
        # teacher-forced: with our tokens as the prefix, the eager int4 model picks each of them (fp32: exactly)
        assert r["reference"]["first_divergence"] is None and r["reference"]["ok"], r["reference"]
        assert r["reference"]["max_logit_error"] <= 1e-4 * max(r["reference"]["logit_scale"], 1.0)
