"""models/state.py's empty_model: a model built on the meta device without drawing weights, so torch does not
import its compiler stack for it (meta normal_ does: 0.9 s of a 5 s Whisper e2e run), and nn.init is left as it
was, an exception in the build included."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from runner.models.state import empty_model

PROBE = """
import sys, torch
from runner.models.state import empty_model
from runner.models.voxtral import Voxtral
from runner.models.voxtral_config import preset
m = empty_model(lambda: Voxtral(preset("tiny")))
assert all(p.is_meta for p in m.parameters())
print("torch._dynamo" in sys.modules)
"""


def test_no_compiler_import_for_an_empty_model():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_nothing_is_drawn_and_init_is_restored():
    before = {n: getattr(nn.init, n) for n in ("normal_", "uniform_", "kaiming_uniform_", "ones_", "zeros_")}
    m = empty_model(lambda: nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Embedding(5, 3)))
    assert all(p.is_meta for p in m.parameters())
    with pytest.raises(RuntimeError, match="boom"):
        empty_model(lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert {n: getattr(nn.init, n) for n in before} == before
    assert nn.init.ones_(torch.zeros(3)).sum().item() == 3.0  # the real one again
