"""The Voxtral Realtime export fits the card it runs on (issue 42: the 4B export's default 64 stream slots ran out
of memory on an 80 GB H100 while compiling decoder_step). Without --max-streams the slots are the most, up to the
default, whose export fits the device's free memory; a --max-streams that does not fit is one line saying how many
do. The estimate is a pure function of (config, dtype, slots, free bytes), checked here with numbers on the CPU."""

from __future__ import annotations

import pytest
import torch

import runner.export.voxtral_realtime as rt
from runner.app.cli import main
from runner.errors import ExportError
from runner.export.options import ExportOptions
from runner.export.pipeline import ExportReport
from runner.models.voxtral_realtime import DecoderState, EncoderState, VoxtralRealtime
from runner.models.voxtral_realtime_config import PRESETS

GIB = 1 << 30
REAL = PRESETS["voxtral-mini-4b-realtime"]
TINY = PRESETS["tiny-realtime"]
CUDA_BF16 = ExportOptions(device="cuda", dtype="bf16")


def test_the_4b_export_does_not_get_64_slots_on_a_card_with_78_gib_free():
    assert rt.bytes_needed(REAL, torch.bfloat16, 64) > 78 * GIB  # what ran out of memory on the H100
    n = rt.max_streams(CUDA_BF16, REAL, 78 * GIB)
    assert 1 <= n < 64
    assert rt.bytes_needed(REAL, torch.bfloat16, n) <= 78 * GIB < rt.bytes_needed(REAL, torch.bfloat16, n + 1)


def test_the_4b_export_gets_the_default_where_it_fits():
    free = rt.bytes_needed(REAL, torch.bfloat16, 64)
    assert rt.max_streams(CUDA_BF16, REAL, free) == 64
    assert rt.max_streams(CUDA_BF16, REAL, free - 1) == 63


def test_a_tiny_config_gets_the_default():
    assert rt.max_streams(CUDA_BF16, TINY, 78 * GIB) == rt.DEFAULT_STREAMS["cuda"]


def test_a_max_streams_that_does_not_fit_is_refused_saying_how_many_do():
    n = rt.streams_that_fit(REAL, torch.bfloat16, 64, 78 * GIB)
    opts = ExportOptions(device="cuda", dtype="bf16", max_streams=64)
    with pytest.raises(ExportError, match=rf"^--max-streams 64: does not fit .*; {n} stream slots fit$"):
        rt.max_streams(opts, REAL, 78 * GIB)
    assert rt.max_streams(ExportOptions(device="cuda", dtype="bf16", max_streams=n), REAL, 78 * GIB) == n


def test_where_not_even_one_slot_fits_the_error_says_what_one_needs():
    with pytest.raises(ExportError, match=r"even 1 stream slot needs \d+\.\d GiB"):
        rt.max_streams(CUDA_BF16, REAL, 8 * GIB)


def test_off_cuda_the_slots_are_not_sized():
    model = VoxtralRealtime(TINY)
    assert rt.device_free_bytes(model, "cpu") is None
    assert rt.max_streams(ExportOptions(), TINY, None) == rt.DEFAULT_STREAMS["cpu"]
    assert rt.max_streams(ExportOptions(max_streams=100), TINY, None) == 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_estimate_counts_the_state_and_the_weights_the_model_allocates(dtype):
    """Per slot, the buffers models/voxtral_realtime.py's two states allocate; the weights, the built model's."""
    enc, dec = rt.state_bytes_per_stream(TINY, dtype)
    assert enc == sum(b.numel() * b.element_size() for b in EncoderState(TINY, 1, dtype).buffers())
    assert dec == sum(b.numel() * b.element_size() for b in DecoderState(TINY, 1, dtype).buffers())
    assert rt.param_count(TINY) == sum(p.numel() for p in VoxtralRealtime(TINY).parameters())


def test_the_estimate_grows_with_each_slot_by_at_least_its_state():
    enc, dec = rt.state_bytes_per_stream(REAL, torch.bfloat16)
    sizes = [rt.bytes_needed(REAL, torch.bfloat16, s) for s in range(1, 66)]
    assert all(b - a >= enc + dec for a, b in zip(sizes, sizes[1:]))
    assert sizes[0] > 2 * rt.param_count(REAL) * 2  # the eager model's weights and the bundle's, in bf16


def _export(tmp_path, *flags: str) -> int:
    return main(["export", "--preset", "tiny-realtime", "--device", "cpu", "--out", str(tmp_path / "out"),
                 "--cache-dir", str(tmp_path / "cache"), *flags])  # fmt: skip


def test_export_refuses_a_max_streams_the_device_cannot_hold(tmp_path, capsys, monkeypatch):
    free = rt.bytes_needed(TINY, torch.float32, 3)
    monkeypatch.setattr(rt, "device_free_bytes", lambda model, device: free)
    monkeypatch.setattr(rt, "build_bundle", lambda *a, **k: pytest.fail("compiled a bundle that does not fit"))
    assert _export(tmp_path, "--max-streams", "8") == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: --max-streams 8: does not fit ({free / GIB:.1f} GiB of cpu memory free); 3 stream slots fit"
    ]


def test_export_without_max_streams_plans_the_slots_that_fit(tmp_path, capsys, monkeypatch, caplog):
    """The sized count reaches the manifest, the compile-cache key and every method's state (nothing compiled)."""
    monkeypatch.setattr(rt, "device_free_bytes", lambda model, device: rt.bytes_needed(TINY, torch.float32, 3))
    seen = {}

    def build(model, plans, source, tokenizer, meta, out, opts, progress, key):
        seen.update(meta=meta["max_streams"], key=key["max_streams"], opts=opts.max_streams)
        seen["rows"] = {s.shape[0] for p in plans for s in p.spec.state.values()}
        return ExportReport()

    monkeypatch.setattr(rt, "build_bundle", build)
    assert _export(tmp_path) == 0
    assert seen == {"meta": 3, "key": 3, "opts": 3, "rows": {3}}
    assert "3 stream slots, not the default 8" in caplog.text
