"""The features' conversion to the audio encoder's declared dtype (the seed's convert_to_bfloat16, generalised), on
the CPU: a bf16 bundle's preprocessor gives float32 features, its audio_encoder declares bfloat16, and the run
converts and matches the eager bf16 model; a dtype it cannot convert to is one clear error line. Before, only the
GPU tests (bf16 CUDA bundles) went through the conversion."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from runner.app.cli import main
from runner.bundle import read_manifest, write_manifest
from runner.errors import GenerationError
from runner.runtime.engine import ProgramEngine, to_encoder_dtype
from runner.runtime.program import Program

try:
    from tests.conftest import AUDIO, export_cached
except ImportError:  # tests/ on sys.path rather than importable as a package
    from conftest import AUDIO, export_cached


@pytest.fixture(scope="module")
def bf16_bundle(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16") / "tiny-bf16"
    return export_cached(tiny_checkpoint, out, dtype="bf16", max_audio_chunks=2, max_seq_len=1024)


def test_float32_features_go_to_a_bf16_encoder_converted_and_match_eager_bf16(bf16_bundle, monkeypatch, capsys):
    seen = []
    real = to_encoder_dtype

    def spy(mel, want):
        out = real(mel, want)
        seen.append((mel.dtype, want, out.dtype))
        return out

    import runner.runtime.generate as generate

    monkeypatch.setattr(generate, "to_encoder_dtype", spy)
    with Program.load(bf16_bundle) as program:
        engine = ProgramEngine(program)
        assert program.methods["preprocessor"].spec.outputs[0].dtype == "float32"
        assert engine.encoder_dtype == torch.bfloat16
        wave = torch.zeros(480000)
        wave[:16000] = torch.sin(torch.arange(16000) / 7)
        mel = engine.preprocess(wave)
        assert mel.dtype == torch.float32
        got = engine.encode(to_encoder_dtype(mel, engine.encoder_dtype))
        assert got.dtype == torch.bfloat16 and torch.isfinite(got.float()).all()
    argv = ["run", "--bundle", str(bf16_bundle), "--audio", str(AUDIO / "speech.wav"), "--max-new-tokens", "8"]
    capsys.readouterr()
    assert main([*argv, "--json", "--reference", "eager"]) == 0
    assert seen and all(s == (torch.float32, torch.bfloat16, torch.bfloat16) for s in seen)
    rec = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert rec["reference"]["ok"] and len(rec["tokens"]) >= 1  # the eager bf16 model would pick the same tokens


@pytest.mark.parametrize(
    "have, want, ok",
    [
        (torch.float32, torch.bfloat16, True),
        (torch.float32, torch.float16, True),
        (torch.float32, torch.float32, True),
        (torch.float32, torch.float64, False),
        (torch.float32, torch.int8, False),
        (torch.bfloat16, torch.float16, False),
        (torch.int64, torch.bfloat16, False),
    ],
)
def test_what_converts_and_what_is_a_clear_error(have, want, ok):
    mel = torch.randn(1, 8, 16).to(have)
    if ok:
        out = to_encoder_dtype(mel, want)
        assert out.dtype == want and torch.equal(out, mel.to(want))
        assert (out is mel) == (have == want)
    else:
        with pytest.raises(GenerationError, match="unsupported dtype conversion"):
            to_encoder_dtype(mel, want)


def test_an_encoder_declaring_a_dtype_it_cannot_be_fed_is_one_error_line(tiny_bundle, tmp_path, capsys):
    """A bundle whose audio_encoder declares float64 (the manifest pins the files, not what the library wants):
    the run stops with one line naming the conversion, exit 1."""
    import shutil

    bundle = shutil.copytree(tiny_bundle, tmp_path / "b")
    m = read_manifest(bundle)
    enc = m.methods["audio_encoder"]
    inputs = [dataclasses.replace(enc.inputs[0], dtype="float64"), *enc.inputs[1:]]
    write_manifest(
        bundle, dataclasses.replace(m, methods={**m.methods, "audio_encoder": dataclasses.replace(enc, inputs=inputs)})
    )
    capsys.readouterr()
    assert main(["run", "--bundle", str(bundle), "--audio", str(AUDIO / "short.wav"), "--max-new-tokens", "2"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert (
        len(err) == 1 and "audio_encoder expects torch.float64" in err[0] and "unsupported dtype conversion" in err[0]
    )
