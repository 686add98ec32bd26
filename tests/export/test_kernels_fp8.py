"""The fp8 prefill's GEMM over the e4m3 codes (runner/export/kernels_fp8.py) against float64 (ragged sizes, one
row, the K loop's tail), the tiny prefill through its hook against the dequantised prefill, the CUDA prefill's
trace (one op per fp8 layer, no matmul beside), and both 3B tiles compiled for sm_90. On a GPU the kernel is
compiled; without one, Triton's interpreter runs it (float16 there: it computes tl.dot on bfloat16 wrongly)."""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEV, DOT_DTYPE, on_h200_target  # before the kernels: on a CPU machine they are interpreted

pytest.importorskip("triton")

from runner.export import kernels_fp8 as KF  # noqa: E402
from runner.export.quant import apply_quant  # noqa: E402
from runner.export.voxtral import EXPORT as VOXTRAL_EXPORT  # noqa: E402
from runner.models.fp8_linear import fp8_layers, matmul_through, quantize  # noqa: E402
from runner.models.voxtral import Voxtral  # noqa: E402
from runner.models.voxtral_config import preset  # noqa: E402


@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (5, 40, 200), (70, 130, 64), (16, 96, 48), (33, 256, 320)])
def test_fp8_mm_is_the_product_with_the_scaled_codes(m, n, k):
    """Against x @ (codes * scale)^T in float64: the codes exact in the compute dtype, one float32 sum per output
    scaled once, one rounding of the result (float16 here: 2^-11 of the largest output, with the sums' float32
    error well under it)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    codes, scale = quantize(torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n)[:, None])
    x = torch.randn(m, k, generator=g).to(DOT_DTYPE)
    got = KF._launch(x.to(DEV), codes.to(DEV), scale.to(DEV))
    want = x.double() @ (codes.double() * scale.double()[:, None]).T
    assert got.shape == (m, n) and got.dtype == DOT_DTYPE
    err = (got.double().cpu() - want).abs() / want.abs().amax(dim=0)  # per output channel: the scales span decades
    assert err.max().item() < 2e-3


@pytest.mark.parametrize("rows,tile", [(1, "row"), (16, "row"), (17, "prompt"), (385, "prompt")])
def test_a_prompt_takes_the_prompt_tile_and_one_row_the_row_tile(rows, tile):
    assert KF.tile_for(rows) == KF.TILES[tile]
    shapes = torch.fx.experimental.symbolic_shapes.ShapeEnv()
    symbol = shapes.create_unbacked_symint()  # a traced length: never the row tile, whatever its value
    assert KF.tile_for(symbol) == KF.TILES["prompt"]


@torch.no_grad()
def test_the_tiny_prefill_through_the_op_is_the_dequantised_prefill():
    """The tiny fp8 model's prefill with its layers through the hook against the same model dequantising (its
    reference in the self-check): the weights' one rounding apart, held to the compute dtype's tolerance; the hook
    unset again after."""
    m = Voxtral(preset("tiny")).init_weights(seed=5).to(DEV, DOT_DTYPE)
    apply_quant(m, VOXTRAL_EXPORT, "fp8")
    m.setup_caches(32)
    prefill = m.prefiller()
    emb = (torch.randn(1, 9, m.config.text.dim, generator=torch.Generator().manual_seed(2)) * 0.5).to(DEV, DOT_DTYPE)
    pos = torch.arange(9, device=DEV)
    want = prefill(emb, pos)
    m.reset_caches()
    with matmul_through(m, KF.widened):
        assert all(lin.matmul is KF.widened for lin in fp8_layers(m))
        got = prefill(emb, pos)
    assert not any(lin.matmul for lin in fp8_layers(m))
    assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()
    assert not torch.equal(got, want)  # the op ran: the weights were not rounded to the compute dtype first


TRACE = r"""
from types import SimpleNamespace
from runner.export import kernels_fp8 as KF, kernels_prefill as KP
from runner.export.quant import apply_quant
from runner.export.voxtral import EXPORT, _export_through
from runner.models.fp8_linear import fp8_layers
from runner.models.voxtral import Voxtral
from runner.models.voxtral_config import preset
from torch.export import Dim

m = Voxtral(preset("tiny")).init_weights(seed=1).to(torch.bfloat16)
apply_quant(m, EXPORT, "fp8")
m.setup_caches(32)
seq = Dim("seq", min=1, max=32)
emb = torch.randn(1, 6, m.config.text.dim).to(torch.bfloat16)
plan = SimpleNamespace(example=(emb, torch.arange(6)), dynamic_shapes=({1: seq}, {0: seq}))
ep = _export_through(m.prefiller(KP.KERNELS), plan, KF.widened)
calls = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
print(json.dumps({"calls": calls, "layers": len(fp8_layers(m)), "hooks": sum(bool(x.matmul) for x in fp8_layers(m))}))
"""


def test_the_cuda_prefill_traces_each_fp8_layer_to_one_op():
    """What the export traces for the widened prefill (export/voxtral.py's `_export_through` with the op's hook;
    tracing launches nothing, so a CPU does): one fp8_mm per fp8
    layer (the decoder's and the head's), no matmul of a dequantised weight beside them, the hooks unset after."""
    got = on_h200_target(TRACE)
    assert got["calls"].count("voxtral.fp8_mm.default") == got["layers"] > 0
    assert not {f"aten.{op}.default" for op in ("mm", "addmm", "linear", "matmul", "bmm")} & set(got["calls"])
    assert got["hooks"] == 0


COMPILE = r"""
from runner.export import kernels_fp8 as KF

out = {}
for name, (n, k, m) in {"prompt": (16384, 3072, 385), "row": (131072, 3072, 1)}.items():  # gate_up; the head
    block_n, block_m, block_k, warps, stages = KF.tile_for(m)
    consts = dict(N=n, K=k, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k)
    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32",
           **dict.fromkeys(consts, "constexpr")}
    kern = triton.compile(ASTSource(KF._fp8_mm_kernel, sig, consts), target=H200,
                          options={"num_warps": warps, "num_stages": stages})
    ptx = kern.asm["ptx"]
    out[name] = {"local": ".local" in ptx, "shared": kern.metadata.shared, "mma": "mma" in ptx}
z = lambda n, t=torch.bfloat16: torch.zeros(n, dtype=t)
kw = dict(x_ptr=z(2 * 64), w_ptr=z(64 * 64, torch.float8_e4m3fn), scale_ptr=z(64, torch.float32), out_ptr=z(2 * 64),
          M=2, N=64, K=64, BLOCK_N=64, BLOCK_M=16, BLOCK_K=64)
out["writes"] = written(KF._fp8_mm_kernel, kw)
print(json.dumps(out))
"""


def test_the_3b_tiles_compile_for_the_h200_on_the_tensor_cores():
    """Compiled for sm_90 here (no GPU needed) at the 3B's gate_up over a 385-token prompt and its head over one row:
    the product on the tensor cores, no spills to local memory, shared memory within the H200's; AOTInductor's
    analysis finds it writes its output alone."""
    got = on_h200_target(COMPILE)
    for tile in ("prompt", "row"):
        assert got[tile]["mma"] and not got[tile]["local"] and got[tile]["shared"] <= 227 * 1024, got[tile]
    assert got["writes"] == ["out_ptr"]
