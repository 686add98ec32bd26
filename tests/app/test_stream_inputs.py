"""`stream`'s inputs (runner/app/stream.py): samples on stdin that are not float PCM (NaN, Inf, s16 bytes read as
`--pcm f32le`) are refused in one line instead of streaming zeros; one unreadable file among several streams is
that stream's error record while the others' records are still written; and every numeric flag of `stream` (and
`run --max-wer`) is checked by the parser: one argparse line naming the flag, never a traceback."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import AUDIO, CACHE, FIXTURES, parse_error

from runner.app.cli import build_parser, main
from runner.app.stream import _stdin_blocks
from runner.audio import SAMPLE_RATE, load_audio
from runner.errors import AudioError

BLOCK = 1280  # 80 ms at 16 kHz
GOLDEN = json.loads((FIXTURES / "golden" / "tiny-realtime.json").read_text())["tokens"]["cpu-float32"]


@pytest.fixture(scope="module")
def rt_bundle(tmp_path_factory) -> Path:
    """The tiny-realtime bundle (its compiles come from the cache, as tests/export/test_realtime_e2e.py's)."""
    from runner.export.options import ExportOptions
    from runner.export.registry import LoadRequest
    from runner.export.voxtral_realtime import export_voxtral_realtime, load

    loaded = load(LoadRequest("tiny-realtime", None))
    out = tmp_path_factory.mktemp("rt") / "tiny-realtime"
    export_voxtral_realtime(loaded.model, loaded.source, loaded.tokenizer, out, ExportOptions(cache_dir=CACHE))
    return out


def fed(data: bytes, pcm: str) -> np.ndarray:
    return np.concatenate(list(_stdin_blocks(io.BytesIO(data), pcm, BLOCK)))


def s16_bytes() -> bytes:
    samples = load_audio(AUDIO / "speech.wav")
    return (np.clip(samples, -1, 1 - 2**-15) * 32768).astype("<i2").tobytes()


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error:")]


# ---------------------------------------------------------------- stdin samples


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_f32_sample_on_stdin_is_refused(bad):
    x = np.full(3 * BLOCK, 0.1, dtype="<f4")
    x[2 * BLOCK + 5] = bad
    with pytest.raises(AudioError, match=r"^stdin: .*NaN or Inf.*sample 2565.*--pcm s16le"):
        fed(x.tobytes(), "f32le")


def test_s16_data_read_as_f32le_is_refused_naming_s16le():
    with pytest.raises(AudioError, match=r"^stdin: .*does not look like f32le.*--pcm s16le"):
        fed(s16_bytes(), "f32le")


def test_a_float_sample_far_beyond_full_scale_is_refused():
    x = np.zeros(BLOCK, dtype="<f4")
    x[7] = 1e6
    with pytest.raises(AudioError, match=r"sample 7 .*1e\+06.*does not look like f32le"):
        fed(x.tobytes(), "f32le")


def test_loud_but_plausible_float_pcm_still_streams():
    x = np.linspace(-1.5, 1.5, 2 * BLOCK + 3, dtype="<f4")  # clipped or boosted audio goes a little past 1
    np.testing.assert_array_equal(fed(x.tobytes(), "f32le"), x)
    np.testing.assert_array_equal(fed(s16_bytes(), "s16le")[:10], load_audio(AUDIO / "speech.wav")[:10])


def test_a_float_wav_with_nan_on_stdin_is_refused():
    x = np.full(SAMPLE_RATE, 0.1, dtype=np.float32)
    x[100] = np.nan
    buf = io.BytesIO()
    sf.write(buf, x, SAMPLE_RATE, format="WAV", subtype="FLOAT")
    with pytest.raises(AudioError, match=r"^stdin: .*NaN or Inf"):
        fed(buf.getvalue(), "s16le")


@pytest.mark.parametrize("data", ["nan", "s16"])
def test_the_cli_refuses_bad_stdin_in_one_line(rt_bundle, monkeypatch, capsys, data):
    if data == "nan":
        payload = np.full(SAMPLE_RATE, np.nan, dtype="<f4").tobytes()
    else:
        payload = s16_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(payload)))
    rc = main(["stream", "--bundle", str(rt_bundle), "--audio", "-", "--pcm", "f32le", "--json"])
    out, err = capsys.readouterr()
    assert rc == 1
    (line,) = error_lines(err)
    assert line.startswith("error: stdin: ") and "--pcm s16le" in line, line
    (rec,) = [json.loads(x) for x in out.splitlines()]
    assert rec["audio"] == "-" and "tokens" not in rec and rec["error"] in line


# ---------------------------------------------------------------- one bad stream among several


@pytest.mark.parametrize("bad", ["garbage", "missing"])
def test_one_bad_file_among_streams_keeps_the_others_records(rt_bundle, tmp_path, capsys, bad):
    broken = tmp_path / "broken.wav"
    if bad == "garbage":
        broken.write_bytes(b"this is not audio at all" * 50)
    files = [AUDIO / "speech.wav", broken, AUDIO / "short.wav"]
    argv = ["stream", "--bundle", str(rt_bundle), "--json"]
    rc = main([*argv, *(x for f in files for x in ("--audio", str(f)))])
    out, err = capsys.readouterr()
    assert rc == 1
    records = [json.loads(x) for x in out.splitlines()]
    assert [r["audio"] for r in records] == [str(f) for f in files]
    assert records[0]["tokens"] == GOLDEN["speech.wav"] and records[2]["tokens"] == GOLDEN["short.wav"]
    assert set(records[1]) == {"audio", "error"} and str(broken) in records[1]["error"]
    (line,) = error_lines(err)
    assert line == f"error: {records[1]['error']}"


def test_one_bad_file_among_streams_in_text_mode(rt_bundle, tmp_path, capsys):
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF" + b"\0" * 100)
    rc = main(["stream", "--bundle", str(rt_bundle), "--audio", str(broken), "--audio", str(AUDIO / "short.wav")])
    out, err = capsys.readouterr()
    assert rc == 1
    assert out.splitlines()[0].startswith(f"{AUDIO / 'short.wav'}: ")
    (line,) = error_lines(err)
    assert str(broken) in line


# ---------------------------------------------------------------- the parser


STREAM_FLAGS = ["--block-ms", "--bench-seconds", "--bench-steps", "--latency-seconds", "--long-minutes",
                "--long-limit-s"]  # fmt: skip
BAD_VALUES = ["nan", "inf", "-inf", "abc", "0", "-1", "1e11", "100000000000", "1e400", ""]


@pytest.mark.parametrize("flag", STREAM_FLAGS)
@pytest.mark.parametrize("value", BAD_VALUES)
def test_a_stream_number_out_of_range_is_one_argparse_line(flag, value, capsys):
    line = parse_error(["stream", "--bundle", "b", f"{flag}={value}"], capsys)
    assert f"error: argument {flag}: {value!r}: " in line, line


def test_stream_numbers_in_range_parse():
    args = build_parser().parse_args(["stream", "--bundle", "b"])
    assert (args.block_ms, args.bench_seconds, args.bench_steps) == (80, 20.0, 50)
    assert (args.latency_seconds, args.long_minutes, args.long_limit_s) == (10.0, 12.0, 300.0)
    given = ["--block-ms", "30", "--bench-seconds", "2.5", "--bench-steps", "3", "--latency-seconds", "1",
             "--long-minutes", "0.05", "--long-limit-s", "60"]  # fmt: skip
    args = build_parser().parse_args(["stream", "--bundle", "b", *given])
    assert (args.block_ms, args.bench_seconds, args.bench_steps) == (30, 2.5, 3)
    assert (args.latency_seconds, args.long_minutes, args.long_limit_s) == (1.0, 0.05, 60.0)


@pytest.mark.parametrize("argv", [["--block-ms", "100000000000"], ["--bench", "--bench-seconds", "inf"],
                                  ["--bench", "--long-limit-s", "nan"]])  # fmt: skip
def test_the_reported_values_never_reach_the_bundle(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["stream", "--bundle", str(tmp_path / "none"), "--audio", "-", *argv])
    assert e.value.code == 2 and f"argument {argv[-2]}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "-0.5", "abc"])
def test_run_max_wer_must_be_a_finite_rate(value, capsys):
    line = parse_error(["run", "--bundle", "b", "--audio", "a.wav", f"--max-wer={value}"], capsys)
    assert f"error: argument --max-wer: {value!r}: " in line, line
    assert build_parser().parse_args(["run", "--bundle", "b", "--max-wer", "0.25"]).max_wer == 0.25
