"""A fixed window whose transcript is implausibly short for the sound in it (a word or two over half a minute of
speech: what was said there is lost) is reported, in its record and on stderr; silence, a chat answer and a
transcript of normal length are not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runner.app.cli import main
from runner.audio import SAMPLE_RATE
from runner.runtime.voicing import implausibly_short, sound_seconds

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"


def test_sound_seconds_counts_the_frames_above_minus_40_dbfs():
    t = np.arange(3 * SAMPLE_RATE) / SAMPLE_RATE
    tone = 0.1 * np.sin(2 * np.pi * 220 * t)  # -23 dBFS for 3 s
    hiss = np.random.default_rng(0).normal(0, 0.001, 2 * SAMPLE_RATE)  # -60 dBFS for 2 s
    x = np.concatenate([tone, hiss, np.zeros(SAMPLE_RATE)]).astype(np.float32)
    assert sound_seconds(x) == pytest.approx(3.0, abs=0.03)
    assert sound_seconds(np.zeros(10, np.float32)) == 0.0


@pytest.mark.parametrize(
    ("tokens", "sound", "short"),
    [(1, 25.0, True), (12, 25.0, True), (13, 25.0, False), (0, 4.9, False), (0, None, False), (80, 30.0, False)],
)
def test_a_transcript_under_half_a_token_a_second_of_sound_is_implausibly_short(tokens, sound, short):
    assert implausibly_short(tokens, sound) is short


def run_json(bundle, *args, capsys):
    rc = main(["run", "--bundle", str(bundle), "--json", *args])
    out, err = capsys.readouterr()
    return rc, json.loads(out), err


def test_a_window_cut_short_is_reported_in_its_record_and_on_stderr(tiny_bundle, capsys):
    """The 35 s fixture (one window of the tiny bundle), its answer cut to 2 tokens: judged short, said once per window
    on stderr; its record keeps the sound it measured."""
    rc, record, err = run_json(tiny_bundle, "--audio", str(AUDIO / "long_35s.flac"), "--max-new-tokens", "2",
                               capsys=capsys)  # fmt: skip
    assert rc == 0, err  # a warning, not a failure: the text may be right for music or noise
    first = record["windows"][0]
    assert first["implausibly_short"] is True and first["sound_s"] >= 5
    assert "window 1/1 (0.0-35.0 s) came out implausibly short: 2 token(s)" in err


def test_silence_a_full_answer_and_a_chat_answer_are_not_judged_short(tiny_bundle, capsys):
    _, quiet, err = run_json(tiny_bundle, "--audio", str(AUDIO / "silence.wav"), "--max-new-tokens", "2",
                             capsys=capsys)  # fmt: skip
    assert quiet["windows"][0]["implausibly_short"] is False and "implausibly short" not in err
    _, full, err = run_json(tiny_bundle, "--audio", str(AUDIO / "long_35s.flac"), "--min-new-tokens", "24",
                            "--max-new-tokens", "24", capsys=capsys)  # fmt: skip
    assert full["windows"][0]["implausibly_short"] is False and "implausibly short" not in err
    _, chat, err = run_json(tiny_bundle, "--audio", str(AUDIO / "speech.wav"), "--prompt", "Is this English?",
                            "--max-new-tokens", "1", capsys=capsys)  # fmt: skip
    assert "implausibly_short" not in json.dumps(chat) and "implausibly short" not in err
