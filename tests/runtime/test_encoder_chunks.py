"""`--encoder-chunks N`: audio_encoder on at most N chunks per call, the outputs joined in order, is the
encoder on the whole prompt at once (each 30 s chunk attends only to itself), and so is the transcript."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import AUDIO, prompt_for, runner_for

from runner.audio import N_SAMPLES, load_audio
from runner.runtime.generate import GenerationOptions
from runner.runtime.options import RuntimeOptions
from runner.runtime.program import Program


def test_the_encoder_in_groups_is_the_encoder_at_once(tiny_bundle):
    wave = torch.from_numpy(load_audio(AUDIO / "long_35s.flac"))  # two chunks
    with Program.load(tiny_bundle) as program:
        whole, grouped = (runner_for(program, RuntimeOptions(encoder_chunks=n)).engine for n in (0, 1))
        padded = torch.nn.functional.pad(wave, (0, 2 * N_SAMPLES - wave.numel()))
        mel = whole.preprocess(padded)
        assert mel.shape[0] == 2
        want, got = whole.encode(mel), grouped.encode(mel)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # and the chunks really went one at a time: the second half is the second chunk's own encoding
        torch.testing.assert_close(got[:, got.shape[1] // 2 :], whole.encode(mel[1:]), rtol=1e-5, atol=1e-5)

        opts = GenerationOptions(max_new_tokens=12)
        runs = [runner_for(program, RuntimeOptions(encoder_chunks=n)) for n in (0, 1, 3)]
        tokens = [r.generate(prompt_for(r, AUDIO / "long_35s.flac"), opts).tokens for r in runs]
        assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 12


@pytest.mark.parametrize("flag,unit,bad", [
    ("--encoder-chunks", "chunks", "-1"), ("--encoder-chunks", "chunks", "two"),
    ("--prefill-chunk", "tokens", "-1"), ("--prefill-chunk", "tokens", "many"),
])  # fmt: skip
def test_a_bad_chunk_size_is_a_usage_error(flag, unit, bad):
    """`--encoder-chunks` and `--prefill-chunk` (tests/runtime/test_prefill_chunk.py) take a whole number, 0 or more."""
    out = subprocess.run(
        [sys.executable, "-m", "runner", "run", flag, bad, "--audio", str(AUDIO / "speech.wav")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and flag in out.stderr and f"whole number of {unit}" in out.stderr
