"""The CUDA-only runtime paths on a tiny bf16 CUDA bundle: the prefill captured as a CUDA graph the second time a
prompt shape is seen and replayed after, against the eager-prefill run; the LRU of captured shapes; the decode
step through text_decoder_step's Triton kernels against text_decoder. Skipped without a GPU (CI has none); the GPU
machine runs tests/cuda."""

from __future__ import annotations

import pytest
import torch
from conftest import AUDIO, CACHE, export_cached, runner_for

from runner.audio import N_SAMPLES, load_audio
from runner.families.voxtral import chat_prompt
from runner.runtime.generate import GenerationOptions
from runner.runtime.program import Program

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_bundle(tiny_checkpoint, tmp_path_factory):
    return export_cached(tiny_checkpoint, tmp_path_factory.mktemp("cuda") / "tiny", device="cuda", dtype="bf16")


@pytest.fixture
def runner(cuda_bundle):
    with Program.load(cuda_bundle) as program:
        yield runner_for(program)


OPTS = GenerationOptions(max_new_tokens=8, min_new_tokens=8, record_logits=True)


def _prompt(runner, text: str):
    return chat_prompt(runner.tok, load_audio(AUDIO / "speech.wav"), text)


def test_prefill_is_captured_the_second_time_and_replayed(runner):
    graphs = runner.engine.prefill_graphs
    prompt = _prompt(runner, "What is said?")
    eager, captured, replayed = (runner.generate(prompt, OPTS) for _ in range(3))
    assert not graphs.disabled and len(graphs.graphs) == 1
    for r in (captured, replayed):
        assert r.tokens == eager.tokens and r.prompt_ids == eager.prompt_ids
        for a, b in zip(r.logits, eager.logits):
            assert (a - b).abs().max() <= 1e-3 * b.abs().max()


def test_a_new_replay_sees_new_inputs(runner):
    """Two prompts of one shape (same text length, other audio): the replay must not answer with the first's."""
    samples = load_audio(AUDIO / "speech.wav")
    a = chat_prompt(runner.tok, samples, "Say it.")
    b = chat_prompt(runner.tok, samples[::-1].copy(), "Say it.")
    ra = [runner.generate(a, OPTS) for _ in range(2)][-1]  # eager, then captured
    rb = runner.generate(b, OPTS)  # replayed with b's inputs
    runner.engine.prefill_graphs.graphs.clear()
    runner.engine.prefill_graphs.seen.clear()
    rb_eager = runner.generate(b, OPTS)
    assert rb.tokens == rb_eager.tokens
    assert (rb.logits[0] - rb_eager.logits[0]).abs().max() <= 1e-3 * rb_eager.logits[0].abs().max()
    assert not torch.equal(rb.logits[0], ra.logits[0])


def test_captured_shapes_are_kept_most_recent_first(runner):
    graphs = runner.engine.prefill_graphs
    graphs.capacity = 1
    short, longer = _prompt(runner, "Hi."), _prompt(runner, "Hi there, what is said?")
    for _ in range(2):
        runner.generate(short, OPTS)
    for _ in range(2):
        runner.generate(longer, OPTS)
    assert len(graphs.graphs) == 1 and len(graphs.seen) == 2  # the short prompt's graph was dropped
    again = runner.generate(short, OPTS)  # seen before: captured anew, and correct
    assert len(graphs.graphs) == 1 and again.tokens == runner.generate(short, OPTS).tokens


def test_decode_steps_run_the_kernels_and_match_text_decoder(cuda_bundle):
    with Program.load(cuda_bundle) as p, torch.no_grad():
        dec, step = p.methods["text_decoder"], p.methods["text_decoder_step"]
        h = dec.spec.inputs[0].shape[2]
        g = torch.Generator().manual_seed(5)
        prompt = (torch.randn(1, 20, h, generator=g) * 0.5).to("cuda", torch.bfloat16)
        p.reset_state()  # text_decoder prefills into an empty cache: its last logits are the step's at 19
        want = dec(prompt, torch.arange(20, device="cuda"))[0]
        p.reset_state()
        dec(prompt[:, :17], torch.arange(17, device="cuda"))
        for i in range(17, 20):
            got = step(prompt[:, i : i + 1], torch.tensor([i], device="cuda"))[0]
        assert (got - want).abs().max() <= 5e-2 * want.abs().max()  # the export self-check's bf16 tolerance


def test_decode_graph_overlaps_the_decode_kernels_and_keeps_the_tokens(runner):
    """PDL (runner/runtime/pdl.py) in the decode graph: every GEMV and attention launch of the step gets a
    programmatic edge (AOTInductor's kernel names are found in the graph), and the step replayed with those edges
    gives the tokens of one captured with plain edges, from the same prompt and cache."""
    from runner.runtime import pdl
    from runner.runtime.graphs import DecodeGraph

    engine = runner.engine
    if not engine.pdl:
        pytest.skip("the bundle's kernels do not wait: exported before sm_90 or with VOXTRAL_RUNNER_PDL=0")
    layers = engine.program.manifest.model["config"]["text"]["n_layers"]
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    token, pos = torch.zeros(1, 1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")
    engine.reset()
    engine.graph_step(token, pos)  # warm-up, outside the capture
    with torch.cuda.graph(graph):
        engine.graph_step(token, pos)
    assert pdl.programmatic_edges(graph.raw_cuda_graph()) == 5 * layers + 1  # qkv, attention, o, gate_up, down; lm_head
    graph.instantiate()
    graph.replay()

    prompt = _prompt(runner, "What is said?")
    runs = {}
    for overlap in (True, False):
        engine.reset()
        graph = DecodeGraph(engine.graph_step, "cuda", overlap=overlap)
        engine.reset()
        logits, ids = runner.prefill(prompt)
        token, out = logits.argmax(dim=-1, keepdim=True), []
        for i in range(8):
            token = graph.step(token, len(ids) + i).argmax(dim=-1, keepdim=True)
            out.append(int(token))
        runs[overlap] = out
    assert runs[True] == runs[False]


def test_warm_up_leaves_nothing_behind(cuda_bundle):
    """After the warm-up at load the caches are empty, the decode step is captured, the waveform's host buffer is
    pinned, no prefill shape is counted as seen, and a generate() gives what an engine without the warm-up gives."""
    prompt_text = "What is said?"
    with Program.load(cuda_bundle) as program:
        cold = runner_for(program)
        want = cold.generate(_prompt(cold, prompt_text), OPTS)
    with Program.load(cuda_bundle) as program:
        warm = runner_for(program)
        warm.engine.warm_up()
        assert warm.engine.graph is not None
        assert warm.engine.pinned.capacity >= N_SAMPLES  # the waveform's host buffer pinned at load
        assert not warm.engine.prefill_graphs.seen
        assert all(not t.any() for m in program.methods.values() for t in m.handle.state.values())
        got = warm.generate(_prompt(warm, prompt_text), OPTS)
    assert got.tokens == want.tokens and got.prompt_ids == want.prompt_ids
    for a, b in zip(got.logits, want.logits):
        assert (a - b).abs().max() <= 1e-3 * b.abs().max()


def test_the_prefill_compiled_is_the_triton_flash_attention(cuda_bundle):
    """The CUDA text_decoder's own plan compiled (the Triton prefill op, export/kernels_prefill.py), not its
    whole-cache fallback: a torch that cannot compile the op would still export, and this says so."""
    from runner.bundle import read_manifest

    assert "fallbacks" not in read_manifest(cuda_bundle).model


def test_the_self_check_with_one_copy_of_the_weights(tiny_checkpoint, tmp_path, monkeypatch):
    """An export whose weights would not fit twice (the free memory reported as none): the eager outputs are
    computed, the eager model goes to the host, the bundle loads and every method passes against them."""
    from runner.export import self_check
    from runner.export.checkpoint import load_checkpoint
    from runner.export.options import ExportOptions
    from runner.export.voxtral import export_voxtral

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 80 << 30))
    model, source, tekken = load_checkpoint(tiny_checkpoint)
    opts = ExportOptions(device="cuda", dtype="bf16", cache_dir=CACHE)  # cuda_bundle's: its compiles are cached
    report = export_voxtral(model, source, tekken, tmp_path / "tiny", opts)
    assert report.max_error and all(e <= self_check.TOLERANCE[torch.bfloat16] for e in report.max_error.values())
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_a_prompt_in_pieces_is_the_prompt_at_once(cuda_bundle):
    """`--prefill-chunk`: the prompt in pieces of 16 tokens (each attending to the cache the ones before it wrote,
    through the prefill op at a start position) answers as the prompt in one call, captured and replayed too."""
    from runner.bundle import read_manifest
    from runner.runtime.options import RuntimeOptions

    assert read_manifest(cuda_bundle).model["prefill_pieces"] is True
    with Program.load(cuda_bundle) as program:
        whole, pieces = (runner_for(program, RuntimeOptions(prefill_chunk=t)) for t in (0, 16))
        prompt = _prompt(whole, "What is said?")
        want = whole.generate(prompt, OPTS)
        assert len(want.prompt_ids) > 16
        for got in (pieces.generate(prompt, OPTS) for _ in range(3)):  # direct, captured, replayed
            assert got.tokens == want.tokens
            assert (got.logits[0] - want.logits[0]).abs().max() <= 2e-2 * want.logits[0].abs().max()
