"""The tiny model exported with the fewest slots `--max-batch` batches with (2 and 3): text_decoder_batch's B is
1..max_batch, traced with 2 rows, and at max 2 the compile once took that example as the only size (a program for
exactly 2 rows: the export's self-check failed with "text_decoder_batch: index out of bounds" on a batch of 1).
Through generate_many at every batch size up to max_batch, each file gives its serial tokens, the batched step
running at B = max_batch and at B = 1 (a file alone in slot 0) among others."""

from __future__ import annotations

import pytest
from conftest import AUDIO, export_cached, runner_for

from runner.bundle import read_manifest
from runner.runtime.batch import generate_many
from runner.runtime.generate import GenerationOptions
from runner.runtime.program import Program
from tests.runtime.test_batch import jobs_for

# different lengths (answer rooms), and more files than slots: slots free apart and are taken again
FILES = ("long_35s.flac", "speech.wav", "short.wav", "silence.wav", "speech_48k_stereo.wav")
OPTS = GenerationOptions(max_new_tokens=None)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"max-batch-{n}")
def bundle(request, tiny_checkpoint, tmp_path_factory):
    n = request.param
    out = tmp_path_factory.mktemp("batch") / f"tiny-batch{n}"
    return n, export_cached(tiny_checkpoint, out, max_audio_chunks=2, max_seq_len=1024, max_batch=n)


def test_the_manifest_has_the_slots_asked_for(bundle):
    n, path = bundle
    m = read_manifest(path)
    assert m.model["max_batch"] == n
    spec = m.methods["text_decoder_batch"]
    assert all(x.shape[0] == {"min": 1, "max": n} for x in [*spec.inputs, *spec.outputs])


def test_every_batch_size_gives_each_files_serial_tokens(bundle):
    n, path = bundle
    with Program.load(path) as program:
        runner = runner_for(program)
        sizes = set()
        decode = runner.engine.decode_batch
        runner.engine.decode_batch = lambda tokens, pos: (sizes.add(tokens.shape[0]), decode(tokens, pos))[1]
        jobs = jobs_for(runner, [AUDIO / f for f in FILES])
        serial = {r.job.key: r.result for r in generate_many(runner, jobs, OPTS, batch=1)}
        for batch in range(2, n + 1):
            sizes.clear()
            results = list(generate_many(runner, jobs, OPTS, batch=batch))
            assert sorted(str(r.job.key) for r in results) == sorted(str(k) for k in serial)
            results += generate_many(runner, jobs[1:2], OPTS, batch=batch)  # one file: slot 0 alone, B = 1
            assert {1, batch} <= sizes, sizes
            for r in results:
                assert r.error is None, r.error
                want = serial[r.job.key]
                assert r.result.tokens == want.tokens and r.result.prompt_ids == want.prompt_ids
                assert r.result.text == want.text and r.result.stop_reason == want.stop_reason
