"""The export's self-check keeps one copy of the weights on the device: where the free memory cannot take the
bundle's weights beside the eager model's, the eager model goes to the host first (the 24B preset on an 80 GB
card), and nothing else of the exporter's still refers to the weights' memory when it does. The check itself is
exercised by every export test (test_export.py: a tampered model, zero tolerance)."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from conftest import CACHE
from torch import nn

from runner.export import pipeline, self_check
from runner.export.checkpoint import load_checkpoint
from runner.export.options import ExportOptions
from runner.export.voxtral import export_voxtral

WEIGHTS = 3 << 20


@pytest.fixture
def stage(tmp_path):
    (tmp_path / "text_decoder.safetensors").write_bytes(b"\0" * WEIGHTS)
    (tmp_path / "text_decoder.so").write_bytes(b"\0" * (5 * WEIGHTS))  # code, not weights: not counted
    return tmp_path


class Recorder(nn.Linear):
    def __init__(self):
        super().__init__(2, 2)
        self.moves = []

    def to(self, *args, **kwargs):
        self.moves.append(args)
        return self


@pytest.mark.parametrize("free_over_need,moved", [(-1, True), (0, False), (1 << 30, False)])
def test_the_eager_model_moves_to_the_host_only_when_the_weights_would_not_fit(stage, monkeypatch, free_over_need,
                                                                               moved):  # fmt: skip
    need = WEIGHTS + self_check.LOAD_HEADROOM
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (need + free_over_need, 80 << 30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    model, said = Recorder(), []
    assert self_check.make_room(model, stage, "cuda", lambda what, message: said.append(message)) is moved
    assert model.moves == ([("cpu",)] if moved else [])
    assert len(said) == moved and all("moving the eager model to the host" in m for m in said)


def test_a_cpu_export_never_moves_the_model(stage, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: pytest.fail("asked a GPU on a CPU export"))
    model = Recorder()
    assert self_check.make_room(model, stage, "cpu") is False and model.moves == []


def live_tensors() -> list[torch.Tensor]:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on every live object touches deprecated module attributes
        warnings.simplefilter("ignore", FutureWarning)
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def storage(t: torch.Tensor) -> int | None:
    """Where t's memory is; None for a tensor with none (a fake one a compile left behind, one freed in place)."""
    try:
        s = t.untyped_storage()
        return s.data_ptr() if s.nbytes() else None
    except RuntimeError:
        return None


def test_the_self_check_starts_with_nothing_else_on_the_weights_memory(tiny_checkpoint, tmp_path, monkeypatch):
    """When the self-check starts, no tensor the export made but the eager model's own parameters refers to their
    memory: moving the model to the host then frees the device (a 24B export on an 80 GB H100 ran out of memory in
    the check while the exporter's last weights dict, detached views of the decoder's 46 GB, was still alive).
    Tensors alive before the export are left out (and kept alive, so no new one takes an old one's id): earlier
    tests' non-owning aliases may point at memory the allocator has since given to these parameters."""
    before = live_tensors()
    old = {id(t) for t in before}
    seen = {}

    def check(stage, plans, model, *args):
        params = {id(p) for p in model.parameters()}
        storages = {storage(p) for p in model.parameters()} - {None}
        others = [t for t in live_tensors() if id(t) not in params | old and storage(t) in storages]
        seen["others"] = [tuple(t.shape) for t in others]
        seen["params"] = len(params)
        return {}

    monkeypatch.setattr(pipeline, "check_bundle", check)
    model, source, tekken = load_checkpoint(tiny_checkpoint)
    export_voxtral(model, source, tekken, tmp_path / "tiny", ExportOptions(cache_dir=CACHE))
    assert seen["params"] > 10 and seen["others"] == []
