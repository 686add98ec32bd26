"""The streaming bundle on CUDA: the whole step replayed from CUDA graphs (one per batch size, captured before any
stream) gives the tokens of the method calls, of the eager model and of each file alone, for streams batched with
a padding row; and `stream --bench` runs on it. Skipped without a GPU (CI has none); the GPU machine runs
tests/cuda."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import AUDIO, CACHE

from runner.audio import load_audio
from runner.export.options import ExportOptions
from runner.export.registry import LoadRequest
from runner.export.voxtral_realtime import export_voxtral_realtime, load
from runner.families import family_for
from runner.families.voxtral_realtime import GraphSteps, ProgramSteps, run_together, run_whole
from runner.reference.voxtral_realtime import eager_steps
from runner.runtime.program import Program

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FILES = ("speech.wav", "short.wav", "silence.wav")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    loaded = load(LoadRequest("tiny-realtime", None, dtype="fp32", device="cuda"))
    model, source, tekken = loaded.model, loaded.source, loaded.tokenizer
    out = tmp_path_factory.mktemp("rt-cuda") / "tiny-realtime"
    export_voxtral_realtime(
        model, source, tekken, out, ExportOptions(device="cuda", dtype="fp32", cache_dir=CACHE, max_streams=4)
    )
    return out


def test_graphed_steps_equal_method_calls_eager_and_each_file_alone(bundle):
    files = [load_audio(AUDIO / n) for n in FILES]
    with Program.load(bundle) as program:
        spec = family_for(bundle, program.manifest.model).spec
        graphed = GraphSteps(program, spec.window)
        assert list(graphed.graphs) == [1, 2, 4] and graphed.batch_for(3) == 4  # 3 streams: one padding row
        together = run_together(graphed, spec, files, block=777)
        assert together == run_together(ProgramSteps(program), spec, files, block=777)
        assert together == [run_whole(graphed, spec, f) for f in files]
        eager = eager_steps(bundle, program.manifest)
        assert together == [run_whole(eager, spec, f) for f in files]
    assert len(set(together[0])) > 3


def test_stream_bench_runs_on_graphs_and_memory_stays_flat(bundle, tmp_path):
    out = tmp_path / "bench.json"
    args = ["--bench-seconds", "2", "--bench-steps", "10", "--latency-seconds", "1", "--long-minutes", "1.5"]
    p = subprocess.run(
        [sys.executable, "-m", "runner", "stream", "--bench", "--bundle", str(bundle), *args, "--bench-json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["cuda_graphs"] and [b["batch"] for b in r["batches"]] == [1, 2, 4]
    assert r["long_stream"]["minutes"] >= 1.5 and r["long_stream"]["growth_mib"]["allocated_mib"] == 0
    assert "| decode at batch 1 (tokens/s) |" in p.stdout


def test_held_slots_on_graphs_give_each_stream_its_own_tokens(bundle):
    """The server's stepping (StreamSlots: a stream whose audio has not arrived steps on zeros at its own position
    and gets its state back) through the CUDA graphs: each stream's tokens are those of its file streamed alone."""
    import runner

    files = [load_audio(AUDIO / n) for n in FILES]
    block = 3 * 1280
    with runner.load(bundle) as model:
        alone = []
        for f in files:
            with model.stream() as s:
                s.push(f)
                alone.append(list(s.finish().tokens))
        with model.stream_slots() as slots:
            streams = [slots.open() for _ in files]
            ends = [len(files[0]) // 2, len(files[1]), len(files[2])]  # the first pauses halfway: held
            sent = [0] * len(files)
            while any(s < e for s, e in zip(sent, ends)):
                for i, s in enumerate(streams):
                    if sent[i] < ends[i]:
                        s.push(files[i][sent[i] : min(sent[i] + block, ends[i])])
                        sent[i] = min(sent[i] + block, ends[i])
            results = {i: list(streams[i].finish().tokens) for i in (1, 2)}
            streams[0].push(files[0][ends[0] :])
            results[0] = list(streams[0].finish().tokens)
    assert [results[i] for i in range(len(files))] == alone
    assert len(set(alone[0])) > 3
