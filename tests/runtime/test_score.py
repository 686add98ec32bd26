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
from runner.reference.score import STEP_TOLERANCE, compare_with_reference, judge
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


def _steps(n=12, vocab=64, seed=0, scale=8.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, vocab, generator=g) * scale for _ in range(n)]


def test_garbage_logits_fail_the_bf16_check_even_where_every_token_matches():
    """Random logits at 7x the reference's scale: the old rule excused any flip as a near tie (its margin was read
    against the observed error); now every step's error is bounded by the bf16 tolerance of its scale."""
    ref = _steps()
    tokens = [int(r.argmax()) for r in ref]
    garbage = [7 * x for x in _steps(seed=1)]
    report = judge(garbage, ref, tokens, torch.bfloat16, greedy=True)
    assert not report.ok and report.worst_ratio > STEP_TOLERANCE[torch.bfloat16]
    flipped = [r.clone() for r in ref]  # our logits picked token 0 everywhere, eager's margin large
    for x in flipped:
        x[0, 0] = x.max() + 50
    assert not judge(flipped, ref, [0] * len(ref), torch.bfloat16, greedy=True).ok


def test_a_faithful_bf16_run_passes_and_flips_only_at_a_near_tie():
    """The reference plus bf16-sized noise (0.5% of the scale) passes; a flip where eager's own margin is under
    the tolerance passes as a near tie; the same flip at a wide margin fails."""
    ref = _steps()
    g = torch.Generator().manual_seed(2)
    faithful = [r + torch.randn(r.shape, generator=g) * 0.005 * r.abs().max() for r in ref]
    tokens = [int(r.argmax()) for r in ref]
    report = judge(faithful, ref, tokens, torch.bfloat16, greedy=True)
    assert report.ok and report.first_divergence is None and report.worst_ratio < 0.02
    tie_ref = [r.clone() for r in ref]
    top = int(tie_ref[3].argmax())
    runner_up = int(tie_ref[3].topk(2).indices[0, 1])
    tie_ref[3][0, runner_up] = tie_ref[3][0, top] - 0.01 * tie_ref[3].abs().max()  # eager's margin: 1% of scale
    ours = [r.clone() for r in tie_ref]
    ours[3][0, runner_up] += 0.02 * tie_ref[3].abs().max()  # ours, within tolerance, picks the runner-up
    picked = [int(x.argmax()) for x in ours]
    assert picked[3] == runner_up
    report = judge(ours, tie_ref, picked, torch.bfloat16, greedy=True)
    assert report.ok and report.first_divergence == 3 and report.near_tie
    assert not judge(ours, tie_ref, picked, torch.float32, greedy=True).ok  # fp32: no flip is a tie
    wide = [r.clone() for r in ref]
    wide[3][0, runner_up] = wide[3][0, top] - 0.3 * wide[3].abs().max()  # eager's margin: 30% of its scale
    assert not judge(wide, wide, [*tokens[:3], runner_up, *tokens[4:]], torch.bfloat16, greedy=True).ok


def test_nan_logits_are_never_faithful_and_ruled_out_tokens_are_not_errors():
    ref = _steps()
    tokens = [int(r.argmax()) for r in ref]
    nan = [r.clone() for r in ref]
    nan[2][0, 5] = float("nan")
    assert not judge(nan, ref, tokens, torch.bfloat16, greedy=True).ok
    ruled = [r.clone() for r in ref]
    for x, t in zip(ruled, tokens):
        x[0, (t + 1) % 64] = float("-inf")  # a decoding rule held this token out: eager is held to it too
    assert judge(ruled, ref, tokens, torch.float32, greedy=True).ok
