"""tiny-realtime exported with the fewest stream slots --max-streams takes (1 and 2): the steps' batch dim is
1..max_streams with a 2-row example, and at max 2 the compile once took that example as the only size (a program
for exactly 2 rows: "decoder_step: index out of bounds" on a batch of 1). Streamed together through the bundle,
each file gives the eager model's tokens (the bundle's weights, as many slots) and the golden tokens."""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES, export_realtime

from runner.audio import load_audio
from runner.bundle import read_manifest
from runner.families import family_for
from runner.families.voxtral_realtime import ProgramSteps, run_together
from runner.reference.voxtral_realtime import eager_steps
from runner.runtime.program import Program

GOLDEN = json.loads((FIXTURES / "golden" / "tiny-realtime.json").read_text())["tokens"]["cpu-float32"]
FILES = ("speech.wav", "short.wav")  # the longer first: once the second ends, its row is past the live ones


class Sizes(ProgramSteps):
    """Records each decoder step's batch size."""

    def __init__(self, program):
        super().__init__(program)
        self.sizes: set[int] = set()

    def decode(self, token, audio, pos, delay):
        self.sizes.add(token.shape[0])
        return super().decode(token, audio, pos, delay)


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"{n}-slots")
def bundle(request, tmp_path_factory):
    n = request.param
    return n, export_realtime(tmp_path_factory.mktemp("rt") / f"tiny-realtime-{n}", max_streams=n)


def test_the_manifest_has_the_slots_asked_for(bundle):
    n, path = bundle
    m = read_manifest(path)
    assert m.model["max_streams"] == n
    for method in m.methods.values():
        assert all(x.shape[0] == {"min": 1, "max": n} for x in [*method.inputs, *method.outputs])
        assert all(st.shape[0] == n for st in method.state.values())


def test_streams_in_every_slot_give_the_eager_and_golden_tokens(bundle):
    n, path = bundle
    names = FILES[:n]
    audio = [load_audio(FIXTURES / "audio" / name) for name in names]
    with Program.load(path) as program:
        spec = family_for(path, program.manifest.model).spec
        steps = Sizes(program)
        got = run_together(steps, spec, audio, block=777)
        eager = run_together(eager_steps(path, program.manifest, streams=n), spec, audio, block=777)
    assert got == eager == [GOLDEN[name] for name in names]
    assert steps.sizes == set(range(1, n + 1))  # every batch size the program takes, 1 included
