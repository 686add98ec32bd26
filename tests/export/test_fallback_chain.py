"""A method's fallbacks as a chain (the fp8 prefill's: `_scaled_mm`, the dequantised Triton prefill, the whole-cache
decoder): a fallback that does not compile either gives way to its own fallback, after a failed compile or a failed
self-check alike, and `model.fallbacks` keeps every reason on the way, joined by "; then "."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import Doubled, export_cached

from runner.app.cli import main
from runner.bundle import read_manifest
from runner.export import voxtral as vx

RUN = ["--audio", "fixtures/audio/speech.wav", "--max-new-tokens", "4"]


class Broken(torch.nn.Module):
    """A method that cannot be exported, as a kernel an older torch cannot compile."""

    def __init__(self, why: str):
        super().__init__()
        self.why = why

    def forward(self, embeds, cache_position):
        raise RuntimeError(self.why)


@pytest.fixture
def plan_prefill(monkeypatch):
    """Replaces text_decoder's plan by `chain(plan)` of the plan voxtral would make."""
    original = vx.prefill_plan

    def patch(chain):
        monkeypatch.setattr(vx, "prefill_plan", lambda *a: chain(original(*a)))

    return patch


def test_a_fallback_that_does_not_compile_gives_way_to_its_own(tiny_checkpoint, tmp_path, plan_prefill):
    def chain(plan):
        second = replace(plan, module=Broken("nor its fallback"), key_extra={"test": "broken 2"}, fallback=plan)
        return replace(plan, module=Broken("no kernel for this torch"), key_extra={"test": "broken"}, fallback=second)

    plan_prefill(chain)
    out = export_cached(tiny_checkpoint, tmp_path / "fb", max_audio_chunks=1, max_seq_len=512)
    m = read_manifest(out)
    assert m.model["fallbacks"] == {
        "text_decoder": "RuntimeError: no kernel for this torch; then RuntimeError: nor its fallback"
    }
    assert m.methods["text_decoder"].library == "text_decoder.so"
    assert main(["run", "--bundle", str(out), *RUN]) == 0


def test_a_failed_self_check_whose_fallback_does_not_compile_publishes_the_next(
    tiny_checkpoint, tmp_path, plan_prefill
):
    def chain(plan):
        second = replace(plan, module=Broken("no kernel for this torch"), key_extra={"test": "broken"}, fallback=plan)
        bad = replace(plan, reference=Doubled(plan.reference or plan.module), key_extra={"test": "mismatch"})
        return replace(bad, fallback=second, fallback_on_mismatch=True)

    plan_prefill(chain)
    out = export_cached(tiny_checkpoint, tmp_path / "fb", max_audio_chunks=1, max_seq_len=512)
    m = read_manifest(out)
    first, then = m.model["fallbacks"]["text_decoder"].split("; then ")
    assert first.startswith("self-check: max relative error ") and then == "RuntimeError: no kernel for this torch"
    # the library named as the checked one's fallback, whichever link of the chain compiled
    assert (
        m.methods["text_decoder"].library == "text_decoder.fallback.so" and (out / "text_decoder.fallback.so").exists()
    )
    assert not (out / "text_decoder.so").exists()
    assert main(["run", "--bundle", str(out), *RUN]) == 0


def test_a_fallback_that_fails_its_self_check_too_may_fall_back_again(tiny_checkpoint, tmp_path, plan_prefill):
    """Each fallback taken on a failed check gets a library name not yet loaded in this process: a loaded library
    is handed back by its path, so a second `.fallback.so` would be checked as the first."""

    def chain(plan):
        mismatching = dict(reference=Doubled(plan.reference or plan.module), fallback_on_mismatch=True)
        second = replace(plan, key_extra={"test": "mismatch again"}, fallback=plan, **mismatching)
        return replace(plan, key_extra={"test": "mismatch"}, fallback=second, **mismatching)

    plan_prefill(chain)
    out = export_cached(tiny_checkpoint, tmp_path / "fb", max_audio_chunks=1, max_seq_len=512)
    m = read_manifest(out)
    reasons = m.model["fallbacks"]["text_decoder"].split("; then ")
    assert len(reasons) == 2 and all(r.startswith("self-check: max relative error ") for r in reasons), reasons
    assert m.methods["text_decoder"].library == "text_decoder.fallback2.so"
    assert sorted(p.name for p in out.glob("text_decoder.*so")) == ["text_decoder.fallback2.so"]
    assert main(["run", "--bundle", str(out), *RUN]) == 0
