"""Transcript files (`run --output-format/--output-dir`): the bytes openai-whisper's own writers give for the same
segments, written atomically, never over a file this runner did not write unless --force; and `run`'s records
carry segments (one per window where the family has no timestamp tokens) and say what happened to each window."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from whisper import utils as whisper_utils  # openai-whisper, the test extra: without it these fail, never skip

from runner.app.report import segments_of, window_records, window_warnings
from runner.app.writers import FORMATS, LEDGER, OutputOptions, TranscriptWriter, check_targets, transcript
from runner.errors import RunnerError
from runner.runtime.results import GenerationResult, Segment, WindowResult
from runner.stats import Stats

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"


def segment(start: float, end: float, text: str) -> dict:
    return Segment(start, end, text, (1, 2, 3), -0.25, 0.01, 0.0).to_dict()


# times on the millisecond boundaries rounding decides, past an hour (SRT and VTT differ there), and texts with
# what the formats escape: "-->", tabs, surrounding spaces, non-ASCII
SEGMENTS = [
    segment(0.0, 2.0004, " Hello there."),
    segment(2.0005, 7.25, " An arrow --> inside, and\ta tab. "),
    segment(59.9996, 61.5, "Ünïcödé, 日本語 text"),
    segment(3599.9994, 3600.0006, " the hour boundary"),
    segment(3723.456, 36000.5, " ten hours on"),
]


def whisper_bytes(fmt: str, result: dict, audio: Path, folder: Path) -> bytes:
    folder.mkdir(parents=True, exist_ok=True)
    whisper_utils.get_writer(fmt, str(folder))(result, str(audio))
    return (folder / f"{audio.stem}.{fmt}").read_bytes()


def with_words(s: dict) -> dict:
    """`s` with word times (--word-timestamps): the subtitles then run from the first word to the last."""
    words = s["text"].split(" ")
    step = (s["end"] - s["start"]) / (len(words) + 1)
    timed = [
        {"word": (" " if i else "") + w, "start": s["start"] + (i + 0.5) * step, "end": s["start"] + (i + 1) * step}
        for i, w in enumerate(words)
    ]
    return {**s, "words": [{**w, "probability": 0.5} for w in timed]}


@pytest.mark.parametrize(
    "segments",
    [SEGMENTS, SEGMENTS[:1], [], [with_words(s) for s in SEGMENTS]],
    ids=["many", "one", "none", "word-times"],
)
def test_each_format_is_byte_for_byte_openai_whispers(tmp_path, segments):
    result = transcript("".join(s["text"] for s in segments), segments, "en")
    audio = tmp_path / "in" / "talk.m4a"
    written = TranscriptWriter(OutputOptions(FORMATS, tmp_path / "ours")).write(audio, result)
    assert [p.name for p in written] == [f"talk.{fmt}" for fmt in FORMATS]
    for fmt, path in zip(FORMATS, written):
        assert path.read_bytes() == whisper_bytes(fmt, result, audio, tmp_path / "whisper"), fmt
    assert json.loads((tmp_path / "ours" / "talk.json").read_text())["segments"] == segments


def test_all_means_whispers_formats_and_either_flag_alone_asks_for_files(tmp_path):
    assert OutputOptions.parse(None, None, False) is None
    assert OutputOptions.parse("all", None, False) == OutputOptions(FORMATS, Path("."))
    assert OutputOptions.parse(None, tmp_path, False) == OutputOptions(FORMATS, tmp_path)
    assert OutputOptions.parse("srt", tmp_path, True) == OutputOptions(("srt",), tmp_path, True)


def test_a_file_not_ours_is_refused_and_ours_replaced(tmp_path):
    options = OutputOptions(("srt", "txt"), tmp_path)
    audio = [Path("a/one.wav"), Path("b/two.flac")]
    (tmp_path / "two.txt").write_text("my notes\n")
    with pytest.raises(RunnerError, match="two.txt.*did not write.*--force") as e:
        check_targets(audio, options)
    assert "one." not in str(e.value)
    check_targets(audio, OutputOptions(("srt", "txt"), tmp_path, force=True))  # --force: replaced
    assert (tmp_path / "two.txt").read_text() == "my notes\n"  # nothing written by the check itself

    writer = TranscriptWriter(options)
    writer.write(audio[0], transcript("x", SEGMENTS[:1], None))
    check_targets(audio[:1], options)  # what we wrote is ours to replace: a re-run writes it again
    writer.write(audio[0], transcript("y", SEGMENTS[1:2], None))
    assert "An arrow" in (tmp_path / "one.txt").read_text()
    (tmp_path / "one.srt").write_text((tmp_path / "one.srt").read_text() + "an edit\n")
    with pytest.raises(RunnerError, match="one.srt"):  # changed since: the user's now
        check_targets(audio[:1], options)
    with pytest.raises(RunnerError, match="one.srt.*--force"):  # and at write time, if it changed mid-run
        writer.write(audio[0], transcript("z", SEGMENTS[:1], None))
    assert (tmp_path / "one.srt").read_text().endswith("an edit\n")


def test_two_inputs_writing_one_file_are_refused(tmp_path):
    options = OutputOptions(("vtt",), tmp_path)
    with pytest.raises(RunnerError, match=r"a/x.wav and b/x.flac would both write x.vtt"):
        check_targets([Path("a/x.wav"), Path("b/x.flac")], options)
    check_targets([Path("a/x.wav"), Path("a/./x.wav")], options)  # the same file named twice is fine


def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    options = OutputOptions(("srt",), tmp_path)
    writer = TranscriptWriter(options)
    writer.write(Path("talk.wav"), transcript("x", SEGMENTS[:1], None))
    before = (tmp_path / "talk.srt").read_bytes()

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        writer.write(Path("talk.wav"), transcript("y", SEGMENTS, None))
    assert (tmp_path / "talk.srt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["talk.srt", LEDGER])


# ---------------------------------------------------------------- records: segments and window outcomes


def window(text: str, seconds: float, **outcome) -> WindowResult:
    stats = Stats()
    stats.audio_seconds = seconds
    return WindowResult(text, 2, "eos", stats, **outcome)


def test_without_timestamp_tokens_segments_are_the_windows_bounds():
    parts = (window(" one", 60.0), window("", 30.0), window(" three", 12.5))
    result = GenerationResult(" one three", [], [5, 6, 7, 8, 9, 10], "eos", Stats(), windows=(2, 2, 2), parts=parts)
    segs = segments_of(result)
    # the empty window has no segment, and no times are made up inside a window
    assert [(s.start, s.end, s.text, s.tokens) for s in segs] == [
        (0.0, 60.0, " one", (5, 6)),
        (90.0, 102.5, " three", (9, 10)),
    ]
    records = window_records(result)
    assert [(w["start_s"], w["end_s"]) for w in records] == [(0.0, 60.0), (60.0, 90.0), (90.0, 102.5)]
    assert all("temperature" not in w for w in records)  # nothing judged: nothing claimed
    assert window_warnings(Path("a.wav"), result) == []


def test_timestamp_segments_win_and_window_outcomes_are_recorded_and_warned():
    parts = (
        window(" fine", 30.0, temperature=0.0, fallbacks=0),
        window(" odd", 30.0, temperature=0.4, fallbacks=2),
        window("", 30.0, temperature=0.0, fallbacks=0, silent=True),
    )
    own = (Segment(1.5, 4.0, " fine", (1,)), Segment(31.0, 33.0, " odd", (2,), temperature=0.4))
    result = GenerationResult(" fine odd", [], [1, 2, 3], "eos", Stats(), windows=(1, 1, 1), parts=parts, segments=own)
    assert segments_of(result) == own
    outcomes = [{k: w[k] for k in ("temperature", "fallbacks", "silent")} for w in window_records(result)]
    assert outcomes == [
        {"temperature": 0.0, "fallbacks": 0, "silent": False},
        {"temperature": 0.4, "fallbacks": 2, "silent": False},
        {"temperature": 0.0, "fallbacks": 0, "silent": True},
    ]
    warnings = window_warnings(Path("a.wav"), result)
    assert len(warnings) == 2
    assert warnings[0].startswith("warning: a.wav: window 2/3 (30.0-60.0 s) decoded only at temperature 0.4")
    assert warnings[1].startswith("warning: a.wav: window 3/3 (60.0-90.0 s) judged silent")


# ---------------------------------------------------------------- the CLI, on a real run of the tiny bundle


def run_cli(bundle: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runner", "run", "--bundle", str(bundle), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_writes_whispers_files_from_the_records_segments(tiny_bundle, tmp_path):
    # 70 s: two windows of the tiny bundle (60 s capacity), so two segments at the window cut
    wave, rate = sf.read(AUDIO / "long_35s.flac")
    sf.write(tmp_path / "long_70s.flac", np.concatenate([wave, wave]), rate)
    audio = [tmp_path / "long_70s.flac", AUDIO / "short.wav"]
    out = tmp_path / "subs"
    args = [a for p in audio for a in ("--audio", str(p))] + ["--max-new-tokens", "6", "--json"]
    done = run_cli(tiny_bundle, *args, "--output-format", "all", "--output-dir", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in done.stdout.splitlines()]
    long, short = records
    assert [(s["start"], s["end"]) for s in long["segments"]] == [
        (w["start_s"], w["end_s"]) for w in long["windows"] if w["text"].strip()
    ]
    assert len(long["windows"]) == 2
    for record, path in zip(records, audio):
        result = transcript(record["text"], record["segments"], None)
        for fmt in FORMATS:
            ours = (out / f"{path.stem}.{fmt}").read_bytes()
            assert ours == whisper_bytes(fmt, result, path, tmp_path / "whisper" / path.stem), (path.name, fmt)

    # a file someone else put there is refused before anything runs (no record, the file left as it was) ...
    (out / "short.srt").write_text("1\n00:00:00,000 --> 00:00:01,000\nmine\n\n")
    refused = run_cli(tiny_bundle, *args, "--output-format", "srt", "--output-dir", str(out))
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.count("error:") == 1 and "short.srt" in refused.stderr, refused.stderr
    assert "mine" in (out / "short.srt").read_text()
    # ... and once it is moved away, the same run replaces the files it wrote before
    (out / "short.srt").rename(tmp_path / "mine.srt")
    again = run_cli(tiny_bundle, *args, "--output-format", "srt", "--output-dir", str(out))
    assert again.returncode == 0, again.stderr[-2000:]
    for path in audio:
        whispers = tmp_path / "whisper" / path.stem / f"{path.stem}.srt"
        assert (out / f"{path.stem}.srt").read_bytes() == whispers.read_bytes()


def test_output_flags_give_the_output_options():
    from runner.app.cli import build_parser

    def options(*flags: str) -> OutputOptions | None:
        args = build_parser().parse_args(["run", "--bundle", "b", "--audio", "a.wav", *flags])
        return OutputOptions.parse(args.output_format, args.output_dir, args.force)

    assert options() is None
    assert options("--output-format", "vtt", "--output-dir", "subs", "--force") == OutputOptions(
        ("vtt",), Path("subs"), True
    )
    with pytest.raises(SystemExit):
        options("--output-format", "docx")


def test_the_run_says_which_windows_were_silent_or_fallbacks_on_stderr_and_in_the_summary(capsys):
    from runner.app.e2e_summary import E2ESummary
    from runner.app.report import Reporter
    from runner.app.run_args import RunOptions
    from runner.runtime.batch import Job, JobResult
    from runner.runtime.options import RuntimeOptions

    parts = (window(" odd", 30.0, temperature=0.6, fallbacks=3), window("", 8.0, temperature=0.0, silent=True))
    result = GenerationResult(" odd", [], [1, 2], "eos", Stats(), windows=(1, 1), parts=parts)
    summary = E2ESummary("e2e", "greedy", 1)
    report = Reporter(RunOptions(RuntimeOptions(), json=True), summary, None, False, None)
    report.file_text(JobResult(Job(Path("talk.wav"), []), result))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert lines == window_warnings(Path("talk.wav"), result) and len(lines) == 2
    markdown = summary.markdown([])
    assert "window 1/2 (0.0-30.0 s) decoded only at temperature 0.6" in markdown and "judged silent" in markdown
