"""The int4 DecodeStep against its written-out decoder. On a GPU in bf16 its linears are tinygemm and the other
kernels compiled; without one Triton's interpreter runs the kernels on the CPU (as test_kernels.py) and the int4
linears are the dequantised matmul, so this checks the step's wiring (norms, residuals, SiLU * up around each
linear). tinygemm itself against the dequantised weight: tests/cuda/test_int4_cuda.py. Speed:
benchmarks/int4_kernels.py on the H200."""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEV, DOT_DTYPE  # before the kernels: on a CPU machine they are interpreted

pytest.importorskip("triton")

from runner.export.decode_step import DecodeStep  # noqa: E402
from runner.export.quant import apply_quant  # noqa: E402
from runner.models.voxtral import Voxtral  # noqa: E402
from runner.models.voxtral_config import preset  # noqa: E402


def test_int4_decode_step_matches_its_decoder():
    """The int4 model: prefill 8 positions with the written-out decoder (dequantised in torch), then 3 steps with
    it and with the int4 step; logits and caches agree as the bf16 step's do (test_kernels.py)."""
    torch.manual_seed(0)
    m = Voxtral(preset("tiny")).init_weights(0).to(DEV, DOT_DTYPE)
    apply_quant(m, "voxtral", "int4")
    m.setup_caches(64)
    dec, step = m.decoder(), DecodeStep(m.config.text, m.language_model)
    caches = [t for layer in dec.layers for t in (layer.self_attn.kv_cache.k_cache, layer.self_attn.kv_cache.v_cache)]
    e = (torch.randn(1, 11, m.config.text.dim) * 0.5).to(DEV, DOT_DTYPE)
    outputs = {}
    with torch.no_grad():
        for name, module in (("decoder", dec), ("step", step)):
            m.reset_caches()
            dec(e[:, :8], torch.arange(8, device=DEV))
            logits = [module(e[:, i : i + 1], torch.tensor([i], device=DEV)) for i in range(8, 11)]
            outputs[name] = (logits, [t.clone() for t in caches])
    (want, want_kv), (got, got_kv) = outputs["decoder"], outputs["step"]
    tol = 1e-2 if DOT_DTYPE == torch.float16 else 5e-2  # the export self-check's bf16 tolerance
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert (a - b).abs().max() / b.abs().max() < tol
        if DOT_DTYPE == torch.float16:
            assert a.argmax() == b.argmax()
    assert max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got_kv, want_kv)) < tol
