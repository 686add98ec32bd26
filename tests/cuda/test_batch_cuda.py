"""Continuous batching on CUDA, on a tiny bf16 bundle exported with --max-batch 4: the batched step replays one CUDA
graph per bucket (1, 2, 4), and its greedy tokens are batch 1's, or differ first where batch 1 itself sees a near
tie (bf16: the batched step's GEMMs sum in another order than the batch-1 Triton kernels), as `--reference`
judges a divergence. Skipped without a GPU (CI has none); the GPU machine runs tests/cuda."""

from __future__ import annotations

import pytest
import torch
from conftest import AUDIO, export_cached, runner_for

from runner.families import family_for
from runner.runtime.batch import Job, generate_many
from runner.runtime.generate import GenerationOptions
from runner.runtime.program import Program

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FILES = ("speech.wav", "short.wav", "silence.wav", "long_35s.flac", "speech_48k_stereo.wav", "speech.wav")
OPTS = GenerationOptions(max_new_tokens=16, min_new_tokens=16, record_logits=True)


@pytest.fixture(scope="module")
def batch_bundle(tiny_checkpoint, tmp_path_factory):
    return export_cached(
        tiny_checkpoint, tmp_path_factory.mktemp("cuda") / "tiny-b4", device="cuda", dtype="bf16",
        max_audio_chunks=2, max_seq_len=1024, max_batch=4,
    )  # fmt: skip


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)


def test_batched_steps_replay_a_graph_per_bucket_and_keep_batch_1s_tokens(batch_bundle):
    with Program.load(batch_bundle) as program:
        runner = runner_for(program)
        family = family_for(batch_bundle, program.manifest.model)
        # the same file twice under two keys: they run in two slots at once
        jobs = [Job(i, family.prompts(AUDIO / f, None, "en", 2)) for i, f in enumerate(FILES)]
        serial = {r.job.key: r for r in generate_many(runner, jobs, OPTS, batch=1)}
        batched = {r.job.key: r for r in generate_many(runner, jobs, OPTS, batch=4)}
        assert runner.engine.batch_graphs is not None and sorted(runner.engine.batch_graphs.graphs) == [1, 2, 4]
    for key, one in serial.items():
        many = batched[key]
        assert one.error is None and many.error is None, (one.error, many.error)
        a, b = many.result, one.result
        assert a.prompt_ids == b.prompt_ids and len(a.tokens) == len(b.tokens) == 16
        first = first_divergence(a.tokens, b.tokens)
        agree = len(a.tokens) if first is None else first + 1  # the steps whose inputs were the same
        for x, y in zip(a.logits[:agree], b.logits[:agree]):
            assert (x - y).abs().max() <= 5e-2 * max(y.abs().max().item(), 1.0)
        if first is not None:  # bf16 may flip a token only where batch 1's own pick was a near tie
            ref = b.logits[first]
            margin = (ref[0, b.tokens[first]] - ref[0, a.tokens[first]]).item()
            error = (a.logits[first] - ref).abs().max().item()
            assert margin <= 2 * error, f"{FILES[key]}: token {first} differs, batch 1's margin {margin:.3g}"


def test_the_batched_attention_compiled_is_the_triton_op(batch_bundle):
    """text_decoder_batch's own plan compiled (each row over its own positions, export/kernels_batch.py), and the
    prefill's too: no fallback recorded."""
    from runner.bundle import read_manifest

    assert "fallbacks" not in read_manifest(batch_bundle).model
