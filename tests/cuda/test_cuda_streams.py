"""The delegate's stream promise (runner/runtime/delegate.py), on a tiny bf16 CUDA bundle: every handle has a CUDA
stream of its own; an eager call runs the container on it (`...Run` is handed that stream), after the work the
caller queued on its own stream and before the work the caller queues next; a graph-safe call (what the decode
graph and the captured prefill record) runs on the caller's current stream instead. Skipped without a GPU; the
GPU machine runs tests/cuda."""

from __future__ import annotations

import pytest
import torch
from conftest import export_cached

from runner.runtime.program import Program

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

RUN, RUN_GRAPH = "AOTInductorModelContainerRun", "AOTInductorModelContainerRunSingleThreaded"


@pytest.fixture(scope="module")
def program(tiny_checkpoint, tmp_path_factory):
    bundle = export_cached(tiny_checkpoint, tmp_path_factory.mktemp("cuda") / "tiny", device="cuda", dtype="bf16")
    with Program.load(bundle) as p:
        yield p


def test_every_handle_has_a_stream_of_its_own(program):
    streams = [m.handle.stream for m in program.methods.values()]
    assert all(isinstance(s, torch.cuda.Stream) for s in streams)
    ids = {s.cuda_stream for s in streams}
    assert len(ids) == len(streams) and torch.cuda.current_stream().cuda_stream not in ids


def _spy(handle, sym: str, calls: list):
    """Record the stream each call hands the container (argument 5: the AOTInductorStreamHandle)."""
    real = handle.fns[sym]

    def spy(*args):
        calls.append(args[5].value)
        return real(*args)

    handle.fns[sym] = spy
    return real


def test_an_eager_call_runs_on_the_handles_stream_and_a_graph_safe_one_on_the_callers(program):
    method = program.methods["token_embedding"]
    h, backend = method.handle, method.backend
    caller = torch.cuda.Stream()
    eager, graphed = [], []
    real_run, real_graph = _spy(h, RUN, eager), _spy(h, RUN_GRAPH, graphed)
    try:
        with torch.cuda.stream(caller):
            ids = torch.ones(1, 4, dtype=torch.int64, device="cuda")
            a = method(ids)[0]
            b = backend.execute(h, [ids], graph_safe=True)[0]
        torch.cuda.synchronize()
    finally:
        h.fns[RUN], h.fns[RUN_GRAPH] = real_run, real_graph
    assert eager == [h.stream.cuda_stream] and graphed == [caller.cuda_stream]
    assert torch.equal(a, b)


def test_an_eager_call_is_ordered_after_and_before_the_callers_work(program):
    """The caller's stream is held up (a ~0.1 s GPU sleep), then writes the input and, after the call, copies the
    output. The handle's stream must wait for the write (else the method reads the old ids), and the copy for
    the method (else it reads what the method has not written yet)."""
    method = program.methods["token_embedding"]
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        want = method(torch.full((1, 8), 5, dtype=torch.int64, device="cuda"))[0].clone()
        ids = torch.zeros(1, 8, dtype=torch.int64, device="cuda")
        torch.cuda._sleep(200_000_000)  # GPU cycles: the fill below runs ~0.1 s after this call returns
        ids.fill_(5)
        got = method(ids)[0].clone()  # the clone is on the caller's stream, after the call
    torch.cuda.synchronize()
    assert not torch.equal(want, method(torch.zeros_like(ids))[0])  # the two inputs do give different outputs
    assert torch.equal(got, want)
