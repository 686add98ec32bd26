"""A check that was asked for and cannot run fails the run (runner/app/golden.py, runner/app/checks.py):
`--expect-tokens` with a golden file that holds no tokens for this bundle's model, device and dtype is one `error:`
line and a failing exit before any file is transcribed, with or without `--reference eager`; a file that holds
them still checks (a wrong token fails, the right ones pass)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES

from runner.app.cli import main
from runner.app.golden import read_golden
from runner.bundle import read_manifest
from runner.errors import RunnerError

GOLDEN = json.loads((FIXTURES / "golden" / "tiny.json").read_text())
SHORT = FIXTURES / "audio" / "short.wav"


def _golden(tmp_path: Path, **change) -> Path:
    path = tmp_path / "golden.json"
    path.write_text(json.dumps({**GOLDEN, **change}))
    return path


def _run(capsys, bundle: Path, *args) -> tuple[int, str, list[str]]:
    capsys.readouterr()
    code = main(["run", "--bundle", str(bundle), "--audio", str(SHORT), "--max-new-tokens", "8", *map(str, args)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, [line for line in err.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("reference", [(), ("--reference", "eager")], ids=["alone", "with the eager reference"])
def test_no_tokens_for_this_device_and_dtype_fails_with_one_line(tiny_bundle, tmp_path, capsys, reference):
    m = read_manifest(tiny_bundle)
    assert f"{m.device}-{m.dtype}" == "cpu-float32"
    path = _golden(tmp_path, tokens={"cuda-bfloat16": GOLDEN["tokens"]["cpu-float32"]})
    code, out, errors = _run(capsys, tiny_bundle, "--json", "--expect-tokens", path, *reference)
    assert code == 1 and out == ""  # nothing transcribed: the run stops before the first file
    assert errors == [
        f"error: {path}: no golden tokens for this model on cpu-float32 (it has cuda-bfloat16): --expect-tokens "
        "cannot check this bundle; leave it out, or check with --reference eager"
    ]


def test_golden_tokens_of_another_model_fail_with_one_line(tiny_bundle, tmp_path, capsys):
    path = _golden(tmp_path, weights_digest="0" * 64)
    code, out, errors = _run(capsys, tiny_bundle, "--expect-tokens", path)
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith(f"error: {path}: golden tokens of another model (weights digest 000000000000, ")
    assert errors[0].endswith("): --expect-tokens cannot check this bundle")


def test_a_file_with_this_bundle_s_tokens_still_checks(tiny_bundle, tmp_path, capsys):
    assert _run(capsys, tiny_bundle, "--expect-tokens", FIXTURES / "golden" / "tiny.json")[0] == 0
    tokens = json.loads(json.dumps(GOLDEN["tokens"]))
    tokens["cpu-float32"]["short.wav"][1] += 1
    code, _, errors = _run(capsys, tiny_bundle, "--expect-tokens", _golden(tmp_path, tokens=tokens))
    assert code == 1 and errors == [f"error: {SHORT}: tokens differ from golden.json at index 1"]


def test_read_golden_gives_this_bundle_s_tokens_or_fails(tiny_bundle, tmp_path):
    manifest = read_manifest(tiny_bundle)
    assert read_golden(FIXTURES / "golden" / "tiny.json", manifest) == GOLDEN["tokens"]["cpu-float32"]
    with pytest.raises(RunnerError, match="no golden tokens for this model on cpu-float32"):
        read_golden(_golden(tmp_path, tokens={}), manifest)
