"""`export --max-batch N`: N > 1 adds text_decoder_batch (B = 1..N tokens of B sequences, its own slot cache
of N rows paired by name with the prefill's cache) and records `model.max_batch`; the default bundle's methods stay
byte for byte what they were; a family without a batched step refuses the flag in one error line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import Doubled

from runner.app.cli import build_parser, main
from runner.bundle import BATCH_STATE_PREFIX, read_manifest
from runner.errors import Cancellation, ExportError
from runner.export import registry
from runner.export.options import ExportOptions
from runner.export.pipeline import prepare

SHARED = ("preprocessor", "audio_encoder", "token_embedding", "text_decoder", "text_decoder_step")


def test_max_batch_adds_the_batched_step_with_its_own_slot_cache(tiny_batch_bundle):
    m = read_manifest(tiny_batch_bundle)
    assert m.model["max_batch"] == 4 and list(m.methods) == [*SHARED, "text_decoder_batch"]
    spec, dec = m.methods["text_decoder_batch"], m.methods["text_decoder"]
    batch, t = {"min": 1, "max": 4}, m.model["config"]["text"]
    assert [(x.name, x.dtype, x.shape) for x in spec.inputs] == [
        ("embeds", "float32", [batch, 1, t["dim"]]),
        ("cache_position", "int64", [batch]),
    ]
    assert [(x.name, x.dtype, x.shape) for x in spec.outputs] == [("logits", "float32", [batch, t["vocab_size"]])]
    assert spec.weights == dec.weights  # one copy of the decoder's weights
    slots = {k: v for k, v in spec.state.items() if k.startswith(BATCH_STATE_PREFIX)}
    assert len(slots) == len(dec.state) == 2 * t["n_layers"]
    for name, s in slots.items():
        one = dec.state[name.removeprefix(BATCH_STATE_PREFIX)]
        assert s.shape == [4, *one.shape[1:]] and one.shape[0] == 1 and s.dtype == one.dtype


def test_the_default_bundle_has_max_batch_1_and_the_same_methods_byte_for_byte(tiny_bundle, tiny_batch_bundle):
    one, four = read_manifest(tiny_bundle), read_manifest(tiny_batch_bundle)
    assert one.model["max_batch"] == 1 and list(one.methods) == list(SHARED)
    for name in SHARED:
        assert one.methods[name] == four.methods[name]
        lib = one.methods[name].library
        assert one.files[lib].sha256 == four.files[lib].sha256


def test_inspect_shows_max_batch(tiny_bundle, tiny_batch_bundle, capsys):
    for bundle, line in (
        (tiny_batch_bundle, "batch: up to 4 files decoded at once (text_decoder_batch; run --batch N, N <= 4)"),
        (tiny_bundle, "batch: one file at a time (export with --max-batch N to decode N at once)"),
    ):
        assert main(["inspect", str(bundle), "--no-verify"]) == 0
        assert line in " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert main(["inspect", str(tiny_batch_bundle), "--json", "--no-verify"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["max_batch"] == 4


def test_the_flag_and_its_range():
    assert build_parser().parse_args(["export"]).max_batch == 1
    assert build_parser().parse_args(["export", "--max-batch", "8"]).max_batch == 8
    for bad in (0, -2, True):
        with pytest.raises(ExportError, match=f"--max-batch {bad}: a whole number, at least 1"):
            ExportOptions(max_batch=bad)


@pytest.mark.parametrize("family", ["whisper", "voxtral-realtime"])
def test_a_family_without_a_batched_step_refuses_max_batch(family):
    with pytest.raises(ExportError, match=f"--max-batch 2: a {family} bundle has no batched decode step"):
        prepare(None, None, ExportOptions(max_batch=2), registry.family(family))  # refused before the model is touched


@pytest.mark.parametrize(
    "family,opts,says",
    [
        ("voxtral-realtime", {"quant": "int4"}, "--quant int4: a voxtral-realtime bundle has no quantised path"),
        ("voxtral", {"max_streams": 4}, "--max-streams: a voxtral bundle has no stream slots"),
        ("whisper", {"max_streams": 4}, "--max-streams: a whisper bundle has no stream slots"),
    ],
)
def test_a_flag_the_family_does_not_take_is_refused_not_ignored(family, opts, says):
    """A flag a family would ignore (and the CLI would still name the bundle after, `-int4`) is an error."""
    with pytest.raises(ExportError, match=says):
        prepare(None, None, ExportOptions(**opts), registry.family(family))  # refused before the model is touched


def test_the_cli_refuses_it_in_one_error_line(tmp_path, capsys):
    out = tmp_path / "rt"
    assert main(["export", "--preset", "tiny-realtime", "--max-batch", "2", "--out", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --max-batch 2: a voxtral-realtime bundle has no batched decode step")
    assert "Traceback" not in "\n".join(err) and not out.exists()


def test_the_traced_slot_caches_are_freed_after_the_compile_and_the_eager_caches_kept():
    """batch_plan's release (the pipeline calls it after the compile): the slot caches it traced over, max_batch
    rows of the whole context (39 GB at 32 slots of 10240 positions on the 3B), are freed; the eager model's
    caches, which the traced module reaches through its layers, keep their values."""
    import torch

    from runner.export.methods import kv_cache_state
    from runner.export.voxtral import batch_plan
    from runner.models.voxtral import Voxtral
    from runner.models.voxtral_config import preset

    opts = ExportOptions(max_batch=4, max_seq_len=32)
    cfg = preset("tiny")
    model = Voxtral(cfg).init_weights(seed=1)
    model.setup_caches(opts.max_seq_len)
    eager = [b for n, b in model.named_buffers() if "kv_cache" in n]
    for b in eager:
        b.fill_(0.5)
    state = kv_cache_state(cfg.text.n_layers, [1, cfg.text.n_kv_heads, 32, cfg.text.head_dim], "float32")
    plan = batch_plan(model, opts, state)
    plan.exported()
    slots = plan.release.__self__.slot_buffers()  # the traced module's slot caches
    assert len(slots) == 2 * cfg.text.n_layers
    assert all(b.untyped_storage().nbytes() == 4 * 4 * 32 * cfg.text.head_dim * cfg.text.n_kv_heads for b in slots)
    plan.release()
    assert all(b.untyped_storage().nbytes() == 0 for b in slots)
    assert all(torch.equal(b, torch.full_like(b, 0.5)) for b in eager)


class Broken(torch.nn.Module):
    """A method that cannot be exported, as a kernel an older torch cannot compile."""

    def forward(self, embeds, cache_position):
        raise RuntimeError("no kernel for this torch\nsecond line of the error")


def test_a_method_whose_compile_fails_is_compiled_as_its_fallback(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """A plan with a fallback (the CUDA text_decoder's: the Triton prefill, else the whole-cache decoder) whose own
    compile fails: the export compiles the fallback, records why in `model.fallbacks`, inspect says so, and the
    bundle passes its self-check and runs. A plan without one fails the export as before."""
    from conftest import export_cached

    from runner.export import voxtral as vx

    original = vx.prefill_plan

    def failing_first(model, opts, *args):
        plan = original(model, opts, *args)
        return replace(plan, module=Broken(), key_extra={"test": "broken"}, fallback=replace(plan))

    monkeypatch.setattr(vx, "prefill_plan", failing_first)
    out = export_cached(tiny_checkpoint, tmp_path / "fb", max_audio_chunks=1, max_seq_len=512)
    fallbacks = read_manifest(out).model["fallbacks"]
    assert list(fallbacks) == ["text_decoder"] and fallbacks["text_decoder"] == "RuntimeError: no kernel for this torch"
    assert "inputs" not in read_manifest(out).model  # not up to date for the next export: it tries the plan again
    assert main(["inspect", str(out), "--no-verify"]) == 0
    assert "text_decoder: its fallback was compiled (the first did not compile: RuntimeError" in " ".join(
        capsys.readouterr().out.split()
    )
    assert main(["run", "--bundle", str(out), "--audio", "fixtures/audio/speech.wav", "--max-new-tokens", "4"]) == 0

    monkeypatch.setattr(vx, "prefill_plan", lambda *a: replace(original(*a), module=Broken(), key_extra={"t": 1}))
    with pytest.raises(RuntimeError, match="no kernel for this torch"):
        export_cached(tiny_checkpoint, tmp_path / "none", max_audio_chunks=1, max_seq_len=512)
    assert not (tmp_path / "none").exists()

    # a stop requested while a method compiles (SIGTERM): its failed compile is the stop's, not a reason to
    # compile the fallback, and nothing is published
    cancel = Cancellation()

    class Stopped(Broken):
        def forward(self, embeds, cache_position):
            cancel.cancel()  # what the CLI's SIGTERM handler does, mid-trace
            return super().forward(embeds, cache_position)

    monkeypatch.setattr(vx, "prefill_plan", lambda *a: replace(failing_first(*a), module=Stopped()))
    with pytest.raises(RuntimeError, match="no kernel for this torch"):
        export_cached(tiny_checkpoint, tmp_path / "stopped", max_audio_chunks=1, max_seq_len=512, cancel=cancel)
    assert not (tmp_path / "stopped").exists()


def test_a_stop_requested_before_an_export_publishes_nothing(tiny_checkpoint, tmp_path):
    """Cancellation is checked between methods and before publishing: a stopped export leaves no bundle."""
    from conftest import export_cached

    from runner.errors import Terminated

    cancel = Cancellation()
    cancel.cancel()
    with pytest.raises(Terminated):
        export_cached(tiny_checkpoint, tmp_path / "stopped", max_audio_chunks=1, max_seq_len=512, cancel=cancel)
    assert not (tmp_path / "stopped").exists() and not list(tmp_path.glob(".stopped*"))


def test_a_plan_that_may_fall_back_on_a_mismatch_does_and_no_other(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """A plan marked `fallback_on_mismatch` (the fp8 prefill through `_scaled_mm`) whose compiled output differs from
    its reference: its fallback is compiled in its place, the whole bundle checked again and published, the
    manifest's `model.fallbacks` and inspect say it was the self-check, and the bundle runs. The same mismatch on
    a plan without the mark fails the export, and nothing is published."""
    from conftest import export_cached

    from runner.errors import ExportError
    from runner.export import voxtral as vx

    original = vx.prefill_plan

    def mismatching(model, opts, *args):
        plan = original(model, opts, *args)
        bad = replace(plan, reference=Doubled(plan.reference or plan.module), key_extra={"test": "mismatch"})
        return replace(bad, fallback=replace(plan), fallback_on_mismatch=True)

    monkeypatch.setattr(vx, "prefill_plan", mismatching)
    out = export_cached(tiny_checkpoint, tmp_path / "fb", max_audio_chunks=1, max_seq_len=512)
    why = read_manifest(out).model["fallbacks"]["text_decoder"]
    assert why.startswith("self-check: max relative error ") and "> 0.0001" in why, why
    assert main(["inspect", str(out), "--no-verify"]) == 0
    assert "text_decoder: its fallback was compiled (the first differed from eager: max relative error" in " ".join(
        capsys.readouterr().out.split()
    )
    assert main(["run", "--bundle", str(out), "--audio", "fixtures/audio/speech.wav", "--max-new-tokens", "4"]) == 0

    monkeypatch.setattr(vx, "prefill_plan", lambda *a: replace(mismatching(*a), fallback_on_mismatch=False))
    with pytest.raises(ExportError, match="text_decoder: exported output differs from eager"):
        export_cached(tiny_checkpoint, tmp_path / "none", max_audio_chunks=1, max_seq_len=512)
    assert not (tmp_path / "none").exists()
