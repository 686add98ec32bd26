"""`run --reference eager` scores our tokens with the eager model teacher-forced, each window's prompt and answer
in one decoder call: the logits it gives are the ones the eager model gives stepping token by token, and a token
the eager model would not have picked is reported at its index."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import runner_for

from runner.bundle import read_manifest
from runner.families import family_for
from runner.reference import eager_engine
from runner.reference.score import compare_with_reference
from runner.runtime.generate import GenerationOptions, MultimodalRunner
from runner.runtime.program import Program

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"
STEPPED = GenerationOptions(max_new_tokens=24, min_new_tokens=24, record_logits=True)


@pytest.fixture(scope="module")
def eager(tiny_bundle):
    manifest = read_manifest(tiny_bundle)
    family = family_for(tiny_bundle, manifest.model)
    return MultimodalRunner(eager_engine(tiny_bundle, manifest), family.tokenizer, family.audio_id), family


@pytest.mark.parametrize("name", ["short.wav", "long_35s.flac"])
def test_scoring_in_one_call_gives_the_logits_of_stepping(eager, name):
    runner, family = eager
    windows = family.prompts(AUDIO / name, None, "en", runner.engine.max_audio_chunks)
    stepped = runner.generate_windows(windows, STEPPED)  # EOS does not stop it (min_new_tokens): EOS is fed too
    scored = runner.score_windows(windows, stepped.window_tokens())
    assert len(scored) == len(stepped.tokens) == 24
    want, got = torch.cat(stepped.logits), torch.cat(scored)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert got.argmax(-1).tolist() == stepped.tokens


def test_a_token_eager_would_not_pick_is_reported_at_its_index(eager, tiny_bundle):
    runner, family = eager
    with Program.load(tiny_bundle) as program:
        ours_runner = runner_for(program)
        windows = family.prompts(AUDIO / "speech.wav", None, "en", ours_runner.engine.max_audio_chunks)
        ours = ours_runner.generate_windows(windows, STEPPED)
    opts = GenerationOptions(max_new_tokens=24)
    report = compare_with_reference(runner, windows, ours, opts, torch.float32)
    assert report.ok and report.first_divergence is None and report.max_logit_error < 1e-4 * report.logit_scale
    tokens = list(ours.tokens)
    tokens[5] = (tokens[5] + 1) % family.tokenizer.vocab_size  # fed from here on: eager's later picks follow it
    report = compare_with_reference(runner, windows, dataclasses.replace(ours, tokens=tokens), opts, torch.float32)
    assert not report.ok and report.first_divergence == 5 and not report.near_tie
