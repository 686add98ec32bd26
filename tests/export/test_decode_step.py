"""text_decoder_step: the decoder exported for one token. It names text_decoder's weights file, so a Program binds
one copy of the weights and one KV cache to both; the runner decodes through it; a bundle whose two methods
disagree on that state is refused by name."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from conftest import prompt_for, runner_for

from runner.bundle import file_entries, read_manifest, write_manifest
from runner.errors import DelegateError
from runner.runtime.generate import GenerationOptions
from runner.runtime.program import Program

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"


def test_step_binds_text_decoders_weights_and_cache(tiny_bundle):
    with Program.load(tiny_bundle) as p:
        dec, step = p.methods["text_decoder"].handle, p.methods["text_decoder_step"].handle
        assert dec.spec.weights == step.spec.weights == "text_decoder.safetensors"
        assert dec.constants.keys() == step.constants.keys() and dec.state.keys() == step.state.keys()
        for key, t in dec.constants.items():  # the same memory, not an equal copy
            assert step.constants[key].data_ptr() == t.data_ptr(), key
        for key, t in dec.state.items():
            assert step.state[key] is t, key


def test_step_decodes_from_the_cache_text_decoder_wrote(tiny_bundle):
    """Prefill with text_decoder, one token with the step method, against text_decoder prefilling both (it
    takes a prompt into an empty cache: the last position's logits are the step's)."""
    g = torch.Generator().manual_seed(3)
    with Program.load(tiny_bundle) as p, torch.no_grad():
        dec, step = p.methods["text_decoder"], p.methods["text_decoder_step"]
        h = dec.spec.inputs[0].shape[2]
        prompt, token = torch.randn(1, 9, h, generator=g) * 0.5, torch.randn(1, 1, h, generator=g) * 0.5
        p.reset_state()
        want = dec(torch.cat([prompt, token], dim=1), torch.arange(10))[0]
        p.reset_state()
        dec(prompt, torch.arange(9))
        got = step(token, torch.tensor([9]))[0]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
        p.reset_state()  # zeroes the shared buffers once, for both methods
        assert all(t.abs().sum() == 0 for t in p.methods["text_decoder_step"].handle.state.values())


def test_runner_decodes_through_the_step_method(tiny_bundle):
    calls = {"text_decoder": 0, "text_decoder_step": 0}
    with Program.load(tiny_bundle) as p:
        for name in calls:
            method = p.methods[name]
            p.methods[name] = _Counted(method, calls, name)
        runner = runner_for(p)
        result = runner.generate(
            prompt_for(runner, AUDIO / "short.wav", None, "en"), GenerationOptions(max_new_tokens=6, min_new_tokens=6)
        )
    assert len(result.tokens) == 6
    assert calls == {"text_decoder": 1, "text_decoder_step": 5}  # the prompt once, then one step per new token


class _Counted:
    def __init__(self, method, calls, name):
        self.method, self.calls, self.name = method, calls, name

    def __getattr__(self, attr):
        return getattr(self.method, attr)

    def __call__(self, *inputs):
        self.calls[self.name] += 1
        return self.method(*inputs)


def test_methods_disagreeing_on_shared_state_are_refused(tiny_bundle, tmp_path):
    bundle = Path(shutil.copytree(tiny_bundle, tmp_path / "b"))
    m = read_manifest(bundle)
    step = m.methods["text_decoder_step"]
    key = next(iter(step.state))
    state = {**step.state, key: dataclasses.replace(step.state[key], shape=[2, *step.state[key].shape[1:]])}
    methods = {**m.methods, step.name: dataclasses.replace(step, state=state)}
    write_manifest(bundle, dataclasses.replace(m, methods=methods, files=file_entries(bundle, sorted(m.files))))
    with pytest.raises(DelegateError, match=f"text_decoder_step: state {key} is .* another method over text_decoder"):
        Program.load(bundle)


def test_the_triton_step_has_the_decoder_as_its_fallback(monkeypatch):
    """Where the Triton decode kernels serve the step (CUDA), a compile failure of theirs falls back to the decoder
    itself at S = 1 (the pipeline's fallback, tested in test_batch_export.py): the same spec and weights file, and
    the same weight names, so the one weights file still serves text_decoder and the step. Elsewhere the step is
    that decoder already, with nothing to fall back to."""
    pytest.importorskip("triton")
    from runner.export import voxtral as vx
    from runner.export.decode_step import DecodeStep
    from runner.export.methods import method_weights
    from runner.export.options import ExportOptions
    from runner.models.voxtral import TextDecoder, Voxtral
    from runner.models.voxtral_config import preset

    model = Voxtral(preset("tiny")).init_weights(0)
    model.setup_caches(64)
    emb = lambda s: torch.zeros(1, s, model.config.text.dim)  # noqa: E731
    opts = ExportOptions(max_seq_len=64, max_audio_chunks=1)
    plain = vx.step_plan(model, opts, {}, emb, model.decoder())
    assert isinstance(plain.module, TextDecoder) and plain.fallback is None
    monkeypatch.setattr(vx, "_triton_tiles", lambda *_: True)  # as on CUDA
    plan = vx.step_plan(model, opts, {}, emb, model.decoder())
    assert isinstance(plan.module, DecodeStep) and isinstance(plan.fallback.module, TextDecoder)
    assert plan.fallback.spec == plan.spec and plan.fallback.key_extra == {"fallback": "decoder"}
    assert method_weights(plan).keys() == method_weights(plan.fallback).keys()
