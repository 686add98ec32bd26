"""`--prefill-chunk T`: a prompt prefilled in pieces of at most T tokens, in order, each at its own positions, the
last piece's logits the prompt's. A bundle whose text_decoder attends to the prompt alone (the CPU export's) cannot
take pieces and says so at load. That the pieces give the whole prompt's answer is tested where the bundles that
take them are built: on a GPU (tests/cuda/test_cuda_runtime.py) and through the kernel (tests/export). A bad T is a
usage error: tests/runtime/test_encoder_chunks.py, beside --encoder-chunks'."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import runner_for

from runner.bundle import read_manifest
from runner.errors import BundleError
from runner.runtime.options import RuntimeOptions
from runner.runtime.program import Program


def test_a_cpu_bundle_cannot_prefill_in_pieces(tiny_bundle):
    assert read_manifest(tiny_bundle).model["prefill_pieces"] is False
    with Program.load(tiny_bundle) as program:
        runner_for(program, RuntimeOptions(prefill_chunk=0))  # the default: one call
        with pytest.raises(BundleError, match="--prefill-chunk: .* from position 0 only"):
            runner_for(program, RuntimeOptions(prefill_chunk=8))


@pytest.mark.parametrize(
    "chunk,length,pieces", [(8, 23, [(0, 8), (8, 16), (16, 23)]), (8, 8, [(0, 8)]), (30, 23, [(0, 23)])]
)
def test_a_prompt_goes_in_order_in_pieces_of_at_most_t_tokens(tiny_bundle, monkeypatch, chunk, length, pieces):
    """The engine's split, with the bundle said to take pieces (its method replaced by a recorder): each piece's
    embeddings and positions, in order, and the last one's logits returned."""
    manifest = json.loads((tiny_bundle / "model.pte").read_text())
    with Program.load(tiny_bundle) as program:
        monkeypatch.setitem(program.manifest.model, "prefill_pieces", True)
        engine = runner_for(program, RuntimeOptions(prefill_chunk=chunk)).engine
        calls = []

        def run(method, embeds, pos):
            calls.append((method, embeds, pos))
            return torch.full((1, 4), float(len(calls)))

        monkeypatch.setattr(engine, "_run", run)
        embeds, pos = torch.randn(1, length, 16), torch.arange(length)
        logits = engine.decode(embeds, pos)
    assert manifest["model"]["prefill_pieces"] is False  # the file was not touched
    assert [(int(p[0]), int(p[-1]) + 1) for _, _, p in calls] == pieces
    assert all(m is engine._dec for m, _, _ in calls)
    assert torch.equal(torch.cat([e for _, e, _ in calls], dim=1), embeds)
    assert torch.equal(logits, torch.full((1, 4), float(len(pieces))))


def test_inspect_says_whether_the_prefill_takes_pieces(tiny_bundle, capsys):
    from runner.app.cli import main
    from runner.app.inspect_bundle import prefill_line

    assert main(["inspect", str(tiny_bundle), "--no-verify"]) == 0
    assert "prefill: in one call (its attention starts at position 0)" in " ".join(capsys.readouterr().out.split())
    assert "--prefill-chunk T" in prefill_line({"prefill_pieces": True})
