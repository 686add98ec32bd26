"""The int4 prefill's op (runner/export/kernels_int4.py): the dequantisation against quant_linear.dequantize, for
every layout tinygemm takes (inner k-tiles 2, 4, 8) and group size (32 to 256); compiled for the H200 here; and the
CUDA export's use of it: an int4 prefill traced through it, the eager model's layers left as they were. Without a
GPU, Triton's interpreter runs the kernel on the CPU."""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEV, on_h200_target  # before the kernels: on a CPU machine they are interpreted

pytest.importorskip("triton")

from runner.export import kernels_int4 as KI  # noqa: E402
from runner.export import kernels_prefill as KP  # noqa: E402
from runner.export.quant import apply_quant, quantize_linear  # noqa: E402
from runner.export.voxtral import EXPORT as VOXTRAL_EXPORT  # noqa: E402
from runner.models import quant_linear  # noqa: E402
from runner.models.quant_linear import QuantLinear  # noqa: E402
from runner.models.voxtral import Voxtral  # noqa: E402
from runner.models.voxtral_config import preset  # noqa: E402

SHAPES = [(3072, 64, 128), (256, 32, 32), (64, 16, 64), (96, 8, 32), (512, 24, 256), (256, 40, 64), (128, 16, 128)]


def quantized(k: int, n: int, group: int, dtype: torch.dtype) -> QuantLinear:
    torch.manual_seed(k + n + group)
    lin = quantize_linear(torch.nn.Linear(k, n, bias=False), group_size=group)
    lin.scales_and_zeros.data = lin.scales_and_zeros.to(dtype)
    return lin.to(DEV)


@pytest.mark.parametrize("k,n,group", SHAPES)  # 8 to 40 rows (1, 2 and 4 blocks of 8 per program), every T and G
def test_the_op_is_the_dequantised_weight(k, n, group):
    """Exact through the interpreter; on a GPU float32 scales may differ by the one rounding a fused multiply-add
    saves (bf16 scales, the CUDA bundles', are exact there: below)."""
    lin = quantized(k, n, group, torch.float32)
    got, want = KI.dequantize(lin), lin.dequantize(torch.float32)
    assert got.shape == (n, k) and got.dtype == torch.float32
    if DEV == "cuda":
        assert ((got - want).abs() <= want.abs().amax() * 2**-23).all()
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("k,n,group", SHAPES[:3])
def test_bf16_scales_give_the_weight_in_bf16(k, n, group):
    """Bit for bit on a GPU. Triton's interpreter casts float32 to bfloat16 by its own rounding, so on the CPU the
    float32 values (exact, above) are checked cast, and the op's own cast to within one bf16 step."""
    lin = quantized(k, n, group, torch.bfloat16)
    got, want = KI.dequantize(lin), lin.dequantize()
    assert got.dtype == torch.bfloat16
    if DEV == "cuda":
        assert torch.equal(got, want)
    else:
        f32 = KI._launch(lin.qweight, lin.scales_and_zeros.float(), lin.group_size)
        assert torch.equal(f32.to(torch.bfloat16), want)
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()


def test_the_hook_dequantizes_through_the_op_only_when_set():
    lin = quantized(256, 16, 64, torch.float32)
    calls = []
    lin.dequantizer = lambda q: calls.append(q) or KI.dequantize(q)
    x = torch.randn(3, 256, device=DEV)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, KI.dequantize(lin)))
    assert calls == [lin]
    lin.dequantize(torch.float64)  # another dtype than the scales': plain torch
    assert calls == [lin]


@torch.library.custom_op("test_int4::dequantize", mutates_args=())
def stand_in(qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The op's contract in plain torch: what export_dequantizing traces through on a CPU machine, where the
    interpreted kernel cannot be traced (its launch would read fake tensors' data)."""
    return quant_linear.dequantize(qweight, scales_and_zeros, scales_and_zeros.dtype)


@stand_in.register_fake
def _(qweight, scales_and_zeros, group_size):
    n8, kt, _, j = qweight.shape
    return scales_and_zeros.new_empty(n8 * 8, kt * j * 32)


def test_an_int4_prefill_exports_through_the_op_and_leaves_the_model_as_it_was(monkeypatch):
    """The tiny model's int4 prefill traced by export_dequantizing: one op node per quantised linear the prompt
    runs, the program's logits equal to the eager model's, and the layers' hooks unset again. On a GPU as the CUDA
    export traces it (bf16, the attention op; the lm_head's last row through tinygemm, not dequantised); on the CPU
    in float32, with a stand-in for the op that has its contract (the kernel's values are tested above)."""
    cuda = DEV == "cuda"
    op = torch.ops.voxtral.int4_dequantize
    if not cuda:
        op = torch.ops.test_int4.dequantize
        monkeypatch.setattr(KI, "dequantize", lambda lin: op(lin.qweight, lin.scales_and_zeros, lin.group_size))
    ep, layers, got, want = export_tiny_int4_prefill()
    assert all(x.dequantizer is None for x in layers)
    assert sum(n.target is op.default for n in ep.graph.nodes) == len(layers) - cuda
    assert torch.equal(got, want)


def export_tiny_int4_prefill():
    """The tiny model's int4 prefill (bf16 and the attention op on a GPU, float32 on the CPU) exported by
    export_dequantizing at a dynamic length -> (the program, the QuantLinear layers, its logits, eager's logits)."""
    cuda = DEV == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    m = Voxtral(preset("tiny")).init_weights(seed=5).to(DEV, dtype)
    apply_quant(m, VOXTRAL_EXPORT, "int4")
    m.setup_caches(32)
    prefill = m.prefiller(KP.KERNELS) if cuda else m.prefiller()
    emb = torch.randn(1, 6, m.config.text.dim, device=DEV).to(dtype)
    pos = torch.arange(6, device=DEV)
    seq = torch.export.Dim("seq", min=1, max=32)
    ep = KI.export_dequantizing(prefill, (emb, pos), ({1: seq}, {0: seq}))
    m.reset_caches()
    want = prefill(emb, pos)
    m.reset_caches()
    return ep, [x for x in m.modules() if isinstance(x, QuantLinear)], ep.module()(emb, pos), want


COMPILE = r"""
import re
from runner.export import kernels_int4 as KI

out = {}
for g in (128, 32):  # one group per row of a program's tile (the 3B's), and four
    consts = {"K": 3072, "J": 4, "G": g, "R8": KI.ROWS_PER_PROGRAM}
    sig = {"q_ptr": "*i32", "sz_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", **dict.fromkeys(consts, "constexpr")}
    names = KI._dequant_kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("q_ptr", "sz_ptr", "out_ptr", "N")}
    k = triton.compile(ASTSource(KI._dequant_kernel, sig, consts, attrs), target=H200, options={"num_warps": 4})
    out[g] = sorted(set(re.findall(r"st\.global[\w.]*", k.asm["ptx"])))
z = lambda n, t=torch.bfloat16: torch.zeros(n, dtype=t)
kw = dict(q_ptr=z(8 * 24 * 32 * 4, torch.int32), sz_ptr=z(24 * 8 * 2), out_ptr=z(8 * 3072), N=8, K=3072, J=4, G=128, R8=1)
out["writes"] = written(KI._dequant_kernel, kw)
print(json.dumps(out))
"""


def test_the_3b_kernel_compiles_for_the_h200_with_whole_row_stores():
    """Compiled for sm_90 here (no GPU needed): the weight is written in 16-byte stores (eight bf16 of one row per
    thread: the codes reordered in registers, not scattered 2-byte writes), and AOTInductor's analysis of the
    Triton IR finds it writes its output alone."""
    got = on_h200_target(COMPILE)
    assert got["128"] == got["32"] == ["st.global.v4.b32"]
    assert got["writes"] == ["out_ptr"]
