"""An int4 bundle end to end on CPU: `--quant int4` exported (checked against eager by the exporter), recorded in
the manifest and shown by inspect, its decoder weights stored as packed int32 codes with scales and zeros, its
tokens those of the eager int4 model (`run --reference eager`), and its weights drawn again when it travels
without them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import as_random_init, eager_checked_records, export_cached
from safetensors import safe_open

from runner.app.cli import main
from runner.bundle import MANIFEST_NAME, read_manifest, weight_files
from runner.digests import sha256_file
from runner.errors import RunnerError
from runner.export.regenerate import regenerate

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
    for r in eager_checked_records(int4_bundle):
        # teacher-forced: with our tokens as the prefix, the eager int4 model picks each of them (fp32: exactly)
        assert r["reference"]["first_divergence"] is None and r["reference"]["ok"], r["reference"]
        assert r["reference"]["max_logit_error"] <= 1e-4 * max(r["reference"]["logit_scale"], 1.0)


def test_a_random_init_int4_bundle_regenerates_its_codes_byte_for_byte(int4_bundle, tmp_path):
    """Random-init bundles travel without weights (the GPU matrix's 3b-int4 cell too): regenerating draws the
    model and quantises it as the manifest's record says; every file must match its sha256."""
    want = {n: sha256_file(int4_bundle / n) for n in weight_files(read_manifest(int4_bundle))}
    bundle = as_random_init(int4_bundle, tmp_path / "b")
    assert sorted(regenerate(bundle)) == sorted(want)
    assert {n: sha256_file(bundle / n) for n in want} == want


def test_an_int4_bundle_of_the_older_layout_is_refused_with_what_to_do(int4_bundle, tmp_path):
    bundle = as_random_init(int4_bundle, tmp_path / "b")
    data = json.loads((bundle / MANIFEST_NAME).read_text())
    del data["model"]["quant"]["layout"]  # what session 21's exporter wrote
    (bundle / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(RunnerError, match="'planes' layout of an older exporter.*export the bundle again"):
        regenerate(bundle)
