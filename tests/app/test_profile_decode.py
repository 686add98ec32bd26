"""benchmarks/profile_decode.py's kernel accounting (its GPU parts run on the lent machine): the runtime's `method:`
ranges are not kernels, and each kernel counts under one kind."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from script_module import load_module

PD = load_module("profile_decode", Path(__file__).resolve().parents[2] / "benchmarks" / "profile_decode.py")


def event(name: str, us: float, device=torch.autograd.DeviceType.CUDA):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_method_ranges_and_host_events_are_not_kernel_time_and_each_kernel_has_one_kind():
    events = [
        event("method:text_decoder_batch", 3000.0),  # a span over the kernels below: not one of them
        event("aten::mm", 50.0, torch.autograd.DeviceType.CPU),
        event("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_TNT", 100.0),
        event("sm90_xmma_gemm_bf16bf16_bf16f32", 60.0),
        event("triton_poi_fused_add_rms_norm_3", 10.0),
        event("_batch_attention_kernel", 30.0),
        event("_batch_merge_kernel", 5.0),
        event("_batch_attention_kernel", 30.0),
    ]
    rows = PD.kernel_rows(events)
    assert sorted(rows) == [
        "_batch_attention_kernel",
        "_batch_merge_kernel",
        "nvjet_tst_128x64_64x4_1x2_h_bz_coopA_TNT",
        "sm90_xmma_gemm_bf16bf16_bf16f32",
        "triton_poi_fused_add_rms_norm_3",
    ]
    assert rows["_batch_attention_kernel"] == [2, 60.0]
    assert PD.kind_line(rows, per=1) == (
        "By kind, per call: matmul 0.160 ms (2 kernels); attention 0.065 ms (3 kernels); the rest 0.010 ms (1 kernels)"
    )
