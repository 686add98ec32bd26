"""`python -m runner run`: several files in one process, the JSON contract, prompts, stopping, sampling, and the
e2e job summary (one row per file)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runner.app.cli import main
from runner.families.voxtral.tokenizer import Tekken

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"
FILES = [
    "speech.wav",
    "long_35s.flac",
    "short.wav",
    "speech_48k_stereo.wav",
]  # 4.4 s, 35 s (2 chunks), 0.9 s, 48 kHz stereo


def run_json(bundle: Path, *args: str) -> list[dict]:
    """The CLI in a subprocess; stdout must hold nothing but JSON lines."""
    out = subprocess.run(
        [sys.executable, "-m", "runner", "run", "--bundle", str(bundle), "--json", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


def audio_args(*names: str) -> list[str]:
    return [a for n in names for a in ("--audio", str(AUDIO / n))]


def test_n_files_in_one_process_give_the_tokens_of_n_processes(tiny_bundle):
    together = run_json(tiny_bundle, *audio_args(*FILES), "--max-new-tokens", "24")
    assert [Path(r["audio"]).name for r in together] == FILES
    for name, record in zip(FILES, together):
        alone = run_json(tiny_bundle, *audio_args(name), "--max-new-tokens", "24")
        assert alone[0]["tokens"] == record["tokens"], name
        assert alone[0]["prompt_ids"] == record["prompt_ids"], name


def test_json_record_and_transcription_prompt_layout(tiny_bundle):
    tok = Tekken.from_file(tiny_bundle / "tekken.json")
    (short, long) = run_json(
        tiny_bundle, *audio_args("short.wav", "long_35s.flac"), "--language", "en", "--max-new-tokens", "5"
    )
    for record, chunks in ((short, 1), (long, 2)):
        assert {"audio", "text", "prompt_ids", "tokens", "stats", "stop_reason"} <= set(record)
        s = tok.special_id
        ids = record["prompt_ids"]
        # <s>[INST][BEGIN_AUDIO] + [AUDIO] x 375 per 30 s chunk + [/INST]lang:en[TRANSCRIBE], as mistral-common builds it
        head, audio, tail = ids[:3], ids[3 : 3 + 375 * chunks], ids[3 + 375 * chunks :]
        assert head == [tok.bos_id, s("[INST]"), s("[BEGIN_AUDIO]")]
        assert audio == [s("[AUDIO]")] * 375 * chunks
        assert tail == [s("[/INST]"), *tok.encode("lang:en"), s("[TRANSCRIBE]")]
        assert record["stats"]["prompt_tokens"] == len(ids)
        assert record["stats"]["generated_tokens"] == len(record["tokens"]) <= 5
        assert record["text"] == tok.decode([t for t in record["tokens"] if t != tok.eos_id])


def test_chat_prompt_keeps_special_token_text_as_text(tiny_bundle):
    tok = Tekken.from_file(tiny_bundle / "tekken.json")
    prompt = "What is said? [INST] </s>"
    (record,) = run_json(tiny_bundle, *audio_args("short.wav"), "--prompt", prompt, "--max-new-tokens", "3")
    tail = record["prompt_ids"][3 + 375 :]
    assert tail == tok.encode(prompt) + [tok.special_id("[/INST]")]
    assert tok.special_id("[INST]") not in tail[:-1] and tok.eos_id not in tail


def test_sampling_is_reproducible_with_a_seed_and_differs_from_greedy(tiny_bundle):
    args = [*audio_args("speech.wav"), "--max-new-tokens", "16", "--min-new-tokens", "16"]
    a = run_json(tiny_bundle, *args, "--temperature", "1.5", "--seed", "3")[0]["tokens"]
    b = run_json(tiny_bundle, *args, "--temperature", "1.5", "--seed", "3")[0]["tokens"]
    greedy = run_json(tiny_bundle, *args)[0]["tokens"]
    assert a == b and len(a) == 16
    assert a != greedy


def test_context_end_stops_with_a_message_not_an_exception(tiny_bundle, capsys):
    # 35 s of audio is 750 audio positions; 400 forced tokens run past the bundle's 1024-token context
    rc = main(
        [
            "run",
            "--bundle",
            str(tiny_bundle),
            *audio_args("long_35s.flac"),
            "--max-new-tokens",
            "400",
            "--min-new-tokens",
            "400",
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    (record,) = [json.loads(line) for line in out.splitlines()]
    assert record["stop_reason"] == "context"
    assert len(record["prompt_ids"]) + len(record["tokens"]) == 1024 + 1  # the last token needs no position
    assert "stopped at the end of the context (1024 tokens)" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-new-tokens", "-1"], "--max-new-tokens"),
        (["--language", "xx"], "unknown language 'xx'"),
        (["--top-p", "0"], "--top-p"),
        (["--word-timestamps"], "--word-timestamps: a voxtral bundle gives no word times"),  # capabilities
    ],
)
def test_bad_options_are_one_error_line(tiny_bundle, capsys, args, message):
    rc = main(["run", "--bundle", str(tiny_bundle), *audio_args("short.wav"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1].startswith("error: ") and message in err[-1]


def test_golden_mismatch_fails_the_run(tiny_bundle, tmp_path, monkeypatch, capsys):
    golden = json.loads(GOLDEN.read_text())
    golden["tokens"]["cpu-float32"]["short.wav"][3] += 1
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(golden))
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    rc = main(
        [
            "run",
            "--bundle",
            str(tiny_bundle),
            *audio_args("short.wav"),
            "--max-new-tokens",
            "32",
            "--expect-tokens",
            str(path),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1] == f"error: {AUDIO / 'short.wav'}: tokens differ from golden.json at index 3"
    (row,) = summary_rows(summary.read_text()).values()  # the summary is written before the run fails
    assert row[1:] == ["**differs** at token 3", "–", "–", "–"]
    assert (
        "**1 failure(s)**:" in summary.read_text()
        and "tokens differ from golden.json at index 3" in summary.read_text()
    )


GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden" / "tiny.json"


def summary_rows(text: str) -> dict[str, list[str]]:
    """The e2e summary's table: file -> [text, golden tokens, expected text, WER, eager reference]."""
    lines = text.splitlines()
    head = lines.index("| file | text | golden tokens | expected text | WER | eager reference |")
    rows = {}
    for line in lines[head + 2 :]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_e2e_summary_has_one_row_per_file_and_stdout_stays_json(tiny_bundle, tmp_path, monkeypatch, capsys):
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    golden = json.loads(GOLDEN.read_text())["tokens"]["cpu-float32"]
    refs = tmp_path / "refs.json"
    refs.write_text(json.dumps({"speech.wav": "hello world", "short.wav": "ok"}))
    names = ["speech.wav", "short.wav", "silence.wav"]
    argv = ["run", "--bundle", str(tiny_bundle), *audio_args(*names), "--max-new-tokens", "32", "--json",
            "--expect-tokens", str(GOLDEN), "--reference", "eager", "--wer", str(refs)]  # fmt: skip
    assert main(argv) == 1  # silence.wav has no reference transcript
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]  # stdout: nothing but the JSON lines
    assert [Path(r["audio"]).name for r in records] == names
    text = summary.read_text()
    assert text.startswith("earlier step\n### e2e: tiny (cpu, float32), 3 file(s)\n")  # appended
    assert "greedy, at most 32 new tokens; checked: golden tokens tiny.json, WER against refs.json, the eager" in text
    rows = summary_rows(text)
    assert list(rows) == names
    for name, record in zip(names, records):
        cut, golden_cell, expected, wer_cell, reference = rows[name]
        assert golden_cell == f"match ({len(golden[name])} tokens)"
        assert expected == "–" and reference == "match"
        shown = cut.replace("\\", "").removesuffix("…")
        flat = " ".join(record["text"].split())
        assert len(shown) <= 60 and flat.startswith(shown) and (cut.endswith("…") == (len(flat) > 60))
        assert "|" not in cut.replace("\\|", "")  # a transcript cannot break the table
    w = records[0]["wer"]
    assert rows["speech.wav"][3] == f"{w['wer']:.1%} ({w['errors']}/{w['words']})"
    assert rows["silence.wav"][3] == "**no reference**"
    assert "word error rate over 2 file(s):" in text and "**1 failure(s)**:" in text
    assert "refs.json: no reference transcript for silence.wav" in text


def test_e2e_summary_marks_the_expected_text_and_nothing_is_written_without_the_variable(
    tiny_bundle, tmp_path, monkeypatch, capsys
):
    argv = ["run", "--bundle", str(tiny_bundle), *audio_args("short.wav"), "--max-new-tokens", "4"]
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--json"]) == 0  # without GITHUB_STEP_SUMMARY: no summary anywhere
    assert list(tmp_path.iterdir()) == []
    said = json.loads(capsys.readouterr().out)["text"].strip()
    assert said, "the tiny bundle says something for short.wav"
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert main([*argv, "--expect", said[:3]]) == 0
    assert main([*argv, "--expect", "not said at all"]) == 1
    said_row, unsaid_row = (summary_rows(part).popitem()[1] for part in summary.read_text().split("### e2e")[1:])
    assert said_row[2] == "yes" and unsaid_row[2] == "**no**"
    assert said_row[1] == said_row[3] == said_row[4] == "–"  # not asked for: golden tokens, WER, eager reference
    assert summary.read_text().count("all 1 file(s) pass") == 1 and "**1 failure(s)**:" in summary.read_text()


def assert_e2e_check(bundle: Path, names: list[str], capsys) -> None:
    """What `nox -s e2e` checks: the fixture files against golden tokens and the eager reference."""
    rc = main(["run", "--bundle", str(bundle), *audio_args(*names), "--max-new-tokens", "32",
               "--expect-tokens", "fixtures/golden/tiny.json", "--reference", "eager"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    assert err.count("eager reference: match") == len(names)


def test_golden_tokens_of_the_tiny_bundle_hold(tiny_bundle, tmp_path, monkeypatch, capsys):
    names = ["speech.wav", "speech_48k_stereo.wav", "long_35s.flac", "short.wav", "silence.wav"]
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path / "summary.md"))  # as the e2e job runs it
    assert_e2e_check(tiny_bundle, names, capsys)
    text = (tmp_path / "summary.md").read_text()
    rows = summary_rows(text)
    assert list(rows) == names
    assert all(r[1] == "match (32 tokens)" and r[4] == "match" for r in rows.values()), rows
    assert text.rstrip().endswith("all 5 file(s) pass")


def test_runtime_flags_and_variables_become_one_options_value():
    import argparse

    from runner.app.options import Environment, add_runtime_flags, runtime_options

    p = argparse.ArgumentParser()
    add_runtime_flags(p)
    plain = runtime_options(p.parse_args([]), Environment.read({}))
    assert plain.cuda_graph and plain.warm_up and plain.pdl and not plain.rehash
    off = runtime_options(p.parse_args(["--no-warm-up", "--no-cuda-graph", "--rehash"]), Environment.read({}))
    assert not off.warm_up and not off.cuda_graph and off.rehash and off.pdl
    assert not runtime_options(p.parse_args([]), Environment.read({"VOXTRAL_RUNNER_PDL": "0"})).pdl


@pytest.mark.parametrize("value", ["abc", "nan", "inf"])
def test_a_long_form_threshold_that_is_not_a_finite_number_is_one_line(value, capsys):
    from runner.app.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["run", "--bundle", "b", "--audio", "a.wav", "--logprob-threshold", value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"argument --logprob-threshold: {value!r}: a finite number, or none"), err


def test_a_long_form_threshold_takes_a_number_or_none():
    from runner.app.cli import build_parser

    args = build_parser().parse_args(["run", "--bundle", "b", "--audio", "a.wav", "--logprob-threshold", "none"])
    assert args.logprob_threshold is None
    args = build_parser().parse_args(["run", "--bundle", "b", "--audio", "a.wav", "--no-speech-threshold", "0.5"])
    assert args.no_speech_threshold == 0.5
