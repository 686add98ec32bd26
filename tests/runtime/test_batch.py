"""Continuous batching (runner/runtime/batch.py): B sequences in one batched decode step, each in its own slot with
its own position, prompt length and stop; a finished one's slot taken by the next prompt. Greedy tokens at batch B
are exactly batch 1's (fp32 CPU), for files of different lengths, a file in two windows, more files than slots
and a bad file among them; the eager reference's batched path gives its serial path's tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import AUDIO, runner_for

from runner.audio import SAMPLE_RATE
from runner.bundle import read_manifest
from runner.errors import AudioError, GenerationError
from runner.families import family_for
from runner.reference import eager_engine
from runner.runtime.batch import Job, generate_many
from runner.runtime.generate import GenerationOptions, MultimodalRunner
from runner.runtime.program import Program
from runner.runtime.prompt import TextSegment
from runner.stats import Stats
from tests.families.test_long_audio import speech_with_gaps

FILES = ("speech.wav", "short.wav", "silence.wav", "long_35s.flac", "speech_48k_stereo.wav")
# None: each window's cap is the room for its audio's answer (128 for short files, 4 a second beyond), so
# sequences stop at different steps and slots free up apart
OPTS = GenerationOptions(max_new_tokens=None)


@pytest.fixture(scope="module")
def long_file(tmp_path_factory) -> Path:
    """70 s: two windows of a bundle that takes 60 s per prompt."""
    path = tmp_path_factory.mktemp("batch") / "long_70s.wav"
    sf.write(path, speech_with_gaps(70.0), SAMPLE_RATE, subtype="FLOAT")
    return path


@pytest.fixture(scope="module")
def program(tiny_batch_bundle):
    with Program.load(tiny_batch_bundle) as p:
        yield p


def jobs_for(runner: MultimodalRunner, paths) -> list[Job]:
    family = family_for(runner.engine.program.bundle_dir, runner.engine.program.manifest.model)
    return [Job(p, family.prompts(p, None, "en", runner.engine.max_audio_chunks), Stats()) for p in paths]


def by_key(results) -> dict:
    return {r.job.key: r for r in results}


def test_greedy_tokens_at_batch_4_equal_batch_1_with_more_files_than_slots(program, long_file):
    runner = runner_for(program)
    paths = [AUDIO / f for f in FILES] + [long_file, AUDIO / "short.wav", AUDIO / "speech.wav"]
    jobs = jobs_for(runner, paths)
    assert len(jobs) > 4 and len(jobs[5].windows) == 2
    admitted = []
    admit = runner.engine.admit
    runner.engine.admit = lambda slot, n: (admitted.append(slot), admit(slot, n))[1]
    serial = list(generate_many(runner, jobs, OPTS, batch=1))
    batched = list(generate_many(runner, jobs, OPTS, batch=4))
    assert [r.job.key for r in serial] == paths  # batch 1: in order
    assert sorted(map(str, (r.job.key for r in batched))) == sorted(map(str, paths))
    want = {id(r.job): r.result for r in serial}
    for r in batched:
        assert r.error is None, r.error
        got, ref = r.result, want[id(r.job)]
        assert got.tokens == ref.tokens and got.prompt_ids == ref.prompt_ids and got.text == ref.text
        assert got.windows == ref.windows and got.stop_reason == ref.stop_reason
        assert [p.stop_reason for p in got.parts] == [p.stop_reason for p in ref.parts]
        s = got.stats
        assert (s.prompt_tokens, s.generated_tokens, s.windows) == (
            ref.stats.prompt_tokens,
            ref.stats.generated_tokens,
            ref.stats.windows,
        )
        assert s.audio_seconds == pytest.approx(ref.stats.audio_seconds)
        assert s.inference_start_ms <= s.prompt_eval_end_ms <= s.first_token_ms <= s.inference_end_ms
    # 9 windows through 4 slots: slots were freed and taken again, always the lowest free one
    assert len(admitted) == 9 and set(admitted) == {0, 1, 2, 3} and admitted[:4] == [0, 1, 2, 3]
    # completion order: the 2-window file (twice the tokens) finishes after files queued behind it
    keys = [r.job.key for r in batched]
    assert keys.index(long_file) > keys.index(paths[6])


def test_the_files_taking_free_slots_share_encoder_calls_and_keep_their_tokens(program):
    """Four one-chunk files into four free slots: their chunks go through the encoder together, as many a call as
    the bundle takes (2 here), not one call per file; each file's features are still its own log-mel."""
    runner = runner_for(program)
    jobs = jobs_for(runner, [AUDIO / f for f in ("speech.wav", "short.wav", "silence.wav", "speech_48k_stereo.wav")])
    calls = []
    encode = runner.engine.encode
    runner.engine.encode = lambda mel: (calls.append(mel.shape[0]), encode(mel))[1]
    serial = by_key(generate_many(runner, jobs, GenerationOptions(max_new_tokens=16), batch=1))
    assert calls == [1, 1, 1, 1]
    calls.clear()
    batched = by_key(generate_many(runner, jobs, GenerationOptions(max_new_tokens=16), batch=4))
    assert calls == [2, 2]  # max_audio_chunks 2: four chunks in two calls
    for job in jobs:
        assert batched[job.key].result.tokens == serial[job.key].result.tokens
        assert batched[job.key].result.prompt_ids == serial[job.key].result.prompt_ids


def test_a_bad_job_in_the_middle_yields_its_error_and_the_rest_go_on(program, tmp_path):
    runner = runner_for(program)
    loud = tmp_path / "loud.wav"  # finite samples whose log-mel overflows: an AudioError after its prefill
    sf.write(loud, np.full(SAMPLE_RATE, 3e38, np.float32), SAMPLE_RATE, subtype="FLOAT")
    good = jobs_for(runner, [AUDIO / "speech.wav", AUDIO / "short.wav", AUDIO / "silence.wav"])
    too_long = Job("too-long", [[TextSegment(tuple([5] * 2000))]])  # more positions than the context
    empty = Job("empty", [])
    jobs = [good[0], *jobs_for(runner, [loud]), too_long, good[1], empty, good[2]]
    serial = by_key(generate_many(runner, jobs, GenerationOptions(max_new_tokens=24), batch=1))
    batched = by_key(generate_many(runner, jobs, GenerationOptions(max_new_tokens=24), batch=3))
    assert set(batched) == set(serial) and len(batched) == len(jobs)
    assert isinstance(batched[loud].error, AudioError) and batched[loud].result is None
    assert isinstance(batched["too-long"].error, GenerationError) and "2000 positions" in str(batched["too-long"].error)
    assert isinstance(batched["empty"].error, GenerationError)
    for job in good:
        assert batched[job.key].error is None
        assert batched[job.key].result.tokens == serial[job.key].result.tokens


def test_a_sequence_that_stops_at_its_first_token_never_takes_a_slot(program):
    runner = runner_for(program)
    jobs = jobs_for(runner, [AUDIO / "short.wav", AUDIO / "speech.wav"])
    serial = by_key(generate_many(runner, jobs, GenerationOptions(max_new_tokens=1), batch=1))
    batched = by_key(generate_many(runner, jobs, GenerationOptions(max_new_tokens=1), batch=2))
    for key, r in batched.items():
        assert r.result.tokens == serial[key].result.tokens and len(r.result.tokens) == 1


def test_the_eager_references_batched_path_equals_its_serial_path_and_the_program(program, tiny_batch_bundle):
    manifest = read_manifest(tiny_batch_bundle)
    engine = eager_engine(tiny_batch_bundle, manifest)
    assert engine.max_batch == 4
    family = family_for(tiny_batch_bundle, manifest.model)
    eager = MultimodalRunner(engine, family.tokenizer, family.audio_id)
    paths = [AUDIO / f for f in ("speech.wav", "short.wav", "long_35s.flac")]
    jobs = [Job(p, family.prompts(p, None, "en", engine.max_audio_chunks)) for p in paths]
    opts = GenerationOptions(max_new_tokens=32)
    serial = by_key(generate_many(eager, jobs, opts, batch=1))
    batched = by_key(generate_many(eager, jobs, opts, batch=3))
    exported = by_key(generate_many(runner_for(program), jobs, opts, batch=3))
    for p in paths:
        assert batched[p].result.tokens == serial[p].result.tokens == exported[p].result.tokens


def test_a_bundle_without_the_batched_step_asked_for_batch_2_names_max_batch(tiny_bundle):
    with Program.load(tiny_bundle) as p:
        assert p.manifest.model["max_batch"] == 1 and "text_decoder_batch" not in p.methods
        runner = runner_for(p)
        with pytest.raises(GenerationError, match=r"--batch 2: .*without --max-batch.*--max-batch 2"):
            list(generate_many(runner, jobs_for(runner, [AUDIO / "short.wav"]), OPTS, batch=2))


def test_a_batch_over_the_bundles_slots_names_its_max_batch(program):
    runner = runner_for(program)
    with pytest.raises(GenerationError, match=r"--batch 5: .*at most 4 files.*--max-batch 4"):
        list(generate_many(runner, [], OPTS, batch=5))


def test_a_batched_run_holds_the_program_like_generate(program):
    runner = runner_for(program)
    running = generate_many(runner, jobs_for(runner, [AUDIO / "short.wav"] * 2), GenerationOptions(max_new_tokens=4), 2)
    next(running)
    with pytest.raises(GenerationError, match="runner is busy"):
        runner.generate(jobs_for(runner, [AUDIO / "short.wav"])[0].windows[0], OPTS)
    list(running)
    runner.generate(jobs_for(runner, [AUDIO / "short.wav"])[0].windows[0], GenerationOptions(max_new_tokens=2))
