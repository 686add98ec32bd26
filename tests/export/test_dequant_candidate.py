"""benchmarks/int4_kernels.py's candidate dequantisation kernel (a Triton program per tinygemm word block, timed
on the H200 against Inductor's kernel before anything uses it: NOTES.md's plan) gives quant_linear's dequantised
weight exactly, for every layout tinygemm takes (inner k-tiles 2, 4, 8) and group size (32 to 256)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from kernel_env import DEV, ROOT  # before the kernels: on a CPU machine they are interpreted

from runner.export.quant import quantize_linear  # noqa: E402

pytest.importorskip("triton")


def candidate():
    spec = importlib.util.spec_from_file_location("int4_kernels", ROOT / "benchmarks" / "int4_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("k,n,group", [(3072, 64, 128), (256, 32, 32), (64, 16, 64), (96, 8, 32), (512, 24, 256)])
def test_the_candidate_is_the_dequantised_weight(k, n, group):
    torch.manual_seed(k + n)
    lin = quantize_linear(torch.nn.Linear(k, n, bias=False).to(DEV), group_size=group)
    got = candidate().triton_dequantize(lin, torch.float32)
    assert got.shape == (n, k)
    assert torch.equal(got, lin.dequantize(torch.float32))
