"""Bad option values end as one `error:` line naming the option, exit 1, before any work (issue 23, "one line for
every bad input"), and the values at the edge of the valid range work: a temperature of 1e-40 samples the
argmax (the limit as the temperature goes to 0) instead of raising on NaN probabilities."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import error_line

from runner.app.cli import main

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio" / "short.wav"


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--temperature", "nan"], "--temperature nan"),  # NaN compared false to everything: it ran greedy
        (["--temperature", "inf"], "--temperature inf"),
        (["--temperature", "-1"], "--temperature -1"),
        (["--top-p", "0"], "--top-p 0"),
        (["--temperature", "1", "--seed", str(2**70)], "--seed"),  # overflowed in manual_seed, a traceback
        (["--temperature", "1", "--seed", "-3"], "--seed -3"),
        (["--max-wer", "0.5"], "--max-wer needs --wer"),  # silently ignored before
    ],
)
def test_a_bad_run_option_is_one_line(tiny_bundle, capsys, extra, needle):
    argv = ["run", "--bundle", str(tiny_bundle), "--audio", str(AUDIO), "--max-new-tokens", "4", *extra]
    assert main(argv) == 1
    assert needle in error_line(capsys)


def test_a_tiny_temperature_samples_the_argmax(tiny_bundle, capsys):
    base = ["run", "--bundle", str(tiny_bundle), "--audio", str(AUDIO), "--max-new-tokens", "8", "--json"]
    assert main([*base, "--temperature", "1e-40", "--seed", "3"]) == 0
    sampled = json.loads(capsys.readouterr().out)["tokens"]
    assert main(base) == 0
    assert sampled == json.loads(capsys.readouterr().out)["tokens"]


@pytest.mark.parametrize("chunks", ["0", "-1"])
def test_a_bad_export_size_is_one_line_before_compiling(tmp_path, capsys, chunks):
    out = tmp_path / "b"
    with pytest.raises(SystemExit) as e:  # the parser's range (tests/export/test_sizes_regenerate.py)
        main(["export", "--preset", "tiny", "--device", "cpu", f"--max-audio-chunks={chunks}", "--out", str(out)])
    assert e.value.code == 2
    assert f"argument --max-audio-chunks: {chunks!r}: a whole number from 1 to" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_bad_flag_combination_is_one_line_before_the_checkpoint_loads(tmp_path, capsys, monkeypatch):
    """int4 on CUDA in fp32 (tinygemm takes bf16) is refused before the preset's weights are drawn or read."""
    from runner.export import presets

    monkeypatch.setattr(presets, "load", lambda *a, **k: pytest.fail("the checkpoint was loaded before the check"))
    argv = ["export", "--preset", "voxtral-mini-3b", "--random-init", "--device", "cuda", "--dtype", "fp32"]
    assert main([*argv, "--quant", "int4", "--out", str(tmp_path / "b")]) == 1
    assert "--quant int4 on --device cuda needs --dtype bf16" in error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_bad_file_among_several_gets_its_record_and_the_rest_go_on(tiny_bundle, tmp_path, capsys):
    """One broken file in the middle of a batch: every file gets its JSON record (an error record for the bad
    one), the files after it are transcribed, and the exit code says something failed."""
    bad = tmp_path / "broken.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot audio")
    argv = ["run", "--bundle", str(tiny_bundle), "--json", "--max-new-tokens", "4"]
    for f in (AUDIO, bad, AUDIO.with_name("speech.wav")):
        argv += ["--audio", str(f)]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert [Path(r["audio"]).name for r in records] == ["short.wav", "broken.wav", "speech.wav"]
    assert "error" in records[1] and str(bad) in records[1]["error"] and len(records[2]["tokens"]) == 4
    assert [line for line in err.splitlines() if line.startswith("error:")] == [f"error: {records[1]['error']}"]
