"""The export's self-check keeps one copy of the weights on the device: where the free memory cannot take the
bundle's weights beside the eager model's, the eager model goes to the host first (the 24B preset on an 80 GB
card). The check itself is exercised by every export test (test_export.py: a tampered model, zero tolerance)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.export import self_check

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
    model = Recorder()
    assert self_check.make_room(model, stage, "cuda") is moved
    assert model.moves == ([("cpu",)] if moved else [])


def test_a_cpu_export_never_moves_the_model(stage, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: pytest.fail("asked a GPU on a CPU export"))
    model = Recorder()
    assert self_check.make_room(model, stage, "cpu") is False and model.moves == []
