"""The int4 prefill's ops (runner/export/kernels_int4.py): the dequantisation against quant_linear.dequantize, and
the matmul that dequantises in its loads against F.linear on that weight, for every layout tinygemm takes (inner
k-tiles 2, 4, 8) and group size (32 to 256); both compiled for the H200 here; and the CUDA export's use of them: an
int4 prefill traced through either, the eager model's layers left as they were. Without a GPU, Triton's
interpreter runs the kernels on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_env import DEV, on_h200_target  # before the kernels: on a CPU machine they are interpreted

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from runner.export import kernels_int4 as KI  # noqa: E402
from runner.export import kernels_prefill as KP  # noqa: E402
from runner.export.quant import apply_quant, quantize_linear  # noqa: E402
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
    ep, layers, got, want = export_tiny_int4_prefill(fused=False)
    assert all(x.dequantizer is None for x in layers)
    assert sum(n.target is op.default for n in ep.graph.nodes) == len(layers) - cuda
    assert torch.equal(got, want)


def export_tiny_int4_prefill(fused: bool):
    """The tiny model's int4 prefill (bf16 and the attention op on a GPU, float32 on the CPU) exported by
    export_dequantizing at a dynamic length -> (the program, the QuantLinear layers, its logits, eager's logits)."""
    cuda = DEV == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    m = Voxtral(preset("tiny")).init_weights(seed=5).to(DEV, dtype)
    apply_quant(m, "voxtral", "int4")
    m.setup_caches(32)
    prefill = m.prefiller(KP.KERNELS) if cuda else m.prefiller()
    emb = torch.randn(1, 6, m.config.text.dim, device=DEV).to(dtype)
    pos = torch.arange(6, device=DEV)
    seq = torch.export.Dim("seq", min=1, max=32)
    ep = KI.export_dequantizing(prefill, (emb, pos), ({1: seq}, {0: seq}), fused=fused)
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


LINEAR_SHAPES = [(256, 40, 64), (256, 24, 256), (192, 16, 32), (96, 200, 32), (128, 136, 128)]  # (K, N, G): T 8, 4, 2
LINEAR_CONFIGS = [None, (16, 16, 4, 1, True), (32, 32, 4, 2, False)]  # linear_config's; small tiles in both orders


@pytest.fixture
def bf16_dots(monkeypatch):
    """The interpreter multiplies bfloat16 dot operands as their uint16 bits: widened to float32 first (exactly)
    here, so the kernel's bf16 path (the CUDA bundles') runs on the CPU too. Its casts to bfloat16 still truncate
    where the GPU rounds to nearest: the tolerances below allow that."""
    if DEV == "cpu":
        from triton.runtime import interpreter

        dot = interpreter.InterpreterBuilder.create_dot

        def widen(h):
            if h.dtype != tl.bfloat16:
                return h
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

        monkeypatch.setattr(
            interpreter.InterpreterBuilder, "create_dot", lambda self, a, b, *rest: dot(self, widen(a), widen(b), *rest)
        )


@pytest.mark.parametrize("config", LINEAR_CONFIGS)
@pytest.mark.parametrize("k,n,group", LINEAR_SHAPES)
@pytest.mark.parametrize("m", [1, 7, 130])  # one row, a ragged tile, more rows than one 128-row tile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_is_the_matmul_on_the_dequantised_weight(bf16_dots, dtype, m, k, n, group, config):
    """x @ W^T with W dequantised inside the K loop against float64 on quant_linear.dequantize's weight in x's dtype:
    float32 to its accumulation order (the products exact: not TF32's); bf16 to that and one rounding of each
    output. (The interpreter casts to bf16 by truncation where the GPU rounds to nearest: there the weight is cast
    so, and an output may be off by one step of its own.)"""
    lin = quantized(k, n, group, dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k + n)).to(DEV, dtype)
    got = KI._launch_linear(x, lin.qweight, lin.scales_and_zeros, lin.group_size, config)
    assert got.shape == (m, n) and got.dtype == dtype
    w = quant_linear.dequantize(lin.qweight, lin.scales_and_zeros, torch.float32)
    if dtype == torch.bfloat16:
        w = w.to(dtype) if DEV == "cuda" else (w.view(torch.int32) & -(2**16)).view(torch.float32)
    want = F.linear(x.double(), w.double())
    err, scale = (got.double() - want).abs(), want.abs().max()
    step = 0 if dtype == torch.float32 else 2 ** (-8 if DEV == "cuda" else -7)  # one rounding, to nearest or down
    assert (err <= step * want.abs() + 1e-5 * scale).all(), err.max()


def test_linear_config_tiles_fit_the_weight():
    """128 rows x 128 features for the 3B's weights; a small weight gets a narrower (>= 16: tl.dot's) N tile."""
    assert KI.linear_config(3072, 3072)[:2] == (128, 128)
    assert KI.linear_config(24, 64)[1] == 32 and KI.linear_config(8, 64)[1] == 16


def test_the_matmul_hook_replaces_dequantize_and_linear_only_when_set():
    lin = quantized(256, 16, 64, torch.float32)
    lin.bias = torch.nn.Parameter(torch.randn(16, device=DEV))
    x = torch.randn(2, 3, 256, device=DEV)
    plain = lin(x)
    assert torch.equal(plain, F.linear(x, lin.dequantize(torch.float32), lin.bias))
    calls = []
    lin.matmul = lambda q, x: calls.append(x.shape) or KI.linear(q, x)
    got = lin(x)
    assert calls == [(2, 3, 256)] and got.shape == (2, 3, 16)
    assert (got - plain).abs().max() <= 1e-5 * plain.abs().max()
    lin.matmul = None
    assert torch.equal(lin(x), plain)


class OneLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = quantized(256, 40, 64, torch.float32)

    def forward(self, x):
        return torch.tanh(self.proj(x))


def traceable_on_the_cpu(monkeypatch):
    """On the CPU the interpreted kernel cannot be traced (its launch would read fake tensors' data): the op's fake
    implementation (its own body) then skips the launch; the exported program still runs the real kernel."""
    if DEV == "cpu":
        launch = KI._launch_linear

        def launch_or_shape(x, qweight, *args, **kwargs):
            if torch._subclasses.fake_tensor.is_fake(x):
                return x.new_empty(x.shape[0], qweight.shape[0] * 8)
            return launch(x, qweight, *args, **kwargs)

        monkeypatch.setattr(KI, "_launch_linear", launch_or_shape)


def test_a_fused_export_holds_the_matmul_op_and_no_dequantisation(monkeypatch):
    """export_dequantizing(fused=True) of a module with an int4 layer: one voxtral.int4_linear node, no dequantise
    node nor unpacking ops (shifts, masks) in the graph, at a dynamic row count; the program equals eager."""
    traceable_on_the_cpu(monkeypatch)
    m = OneLinear()
    x = torch.randn(1, 9, 256, device=DEV)
    seq = torch.export.Dim("seq", min=1, max=64)
    ep = KI.export_dequantizing(m, (x,), ({1: seq},), fused=True)
    assert m.proj.matmul is None and m.proj.dequantizer is None
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("voxtral.int4_linear.default") == 1
    assert not [t for t in targets if "dequantize" in t or "shift" in t or "bitwise" in t], targets
    for rows in (9, 1, 33):  # the row count is not specialised
        xr = torch.randn(1, rows, 256, device=DEV)
        want = m(xr)
        assert (ep.module()(xr) - want).abs().max() <= 1e-5 * want.abs().max()


def test_an_int4_prefill_exports_through_the_matmul_op(monkeypatch):
    """The tiny model's int4 prefill traced with fused=True: one int4_linear node per quantised linear the prompt
    runs (the lm_head's last row stays with tinygemm on a GPU) and no dequantise node; the program's logits equal
    the eager model's to float32 accumulation order (bf16 rounding on a GPU); the hooks unset again."""
    cuda = DEV == "cuda"
    traceable_on_the_cpu(monkeypatch)
    ep, layers, got, want = export_tiny_int4_prefill(fused=True)
    assert all(x.matmul is None and x.dequantizer is None for x in layers)
    targets = [n.target for n in ep.graph.nodes]
    assert targets.count(torch.ops.voxtral.int4_linear.default) == len(layers) - cuda
    assert torch.ops.voxtral.int4_dequantize.default not in targets
    assert (got - want).abs().max() <= (2e-2 if cuda else 1e-4) * want.abs().max()


LINEAR_COMPILE = r"""
import re
from runner.export import kernels_int4 as KI

out = {}
for g in (128, 32):
    bm, bn, warps, stages, weight_order = KI.linear_config(3072, 3072)
    consts = {"N": 3072, "K": 3072, "J": 4, "G": g, "BLOCK_M": bm, "R8": bn // 8, "WEIGHT_ORDER": weight_order,
              "EXACT": False}
    sig = {"x_ptr": "*bf16", "q_ptr": "*i32", "sz_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32",
           **dict.fromkeys(consts, "constexpr")}
    names = KI._linear_kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("x_ptr", "q_ptr", "sz_ptr", "out_ptr")}
    k = triton.compile(ASTSource(KI._linear_kernel, sig, consts, attrs), target=H200,
                       options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    dots = sorted(set(re.findall(r"\b(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", ptx)))
    out[g] = {"shared": k.metadata.shared, "dots": dots,
              # each load's kind, or an asynchronous copy's size in bytes
              "loads": [m[1] or m[0] for m in re.finditer(r"ld\.global[\w.]*|cp\.async\.c[ag][^;]*?, (0x\w+)", ptx)]}
z = lambda n, t=torch.bfloat16: torch.zeros(n, dtype=t)
kw = dict(x_ptr=z(256 * 3072), q_ptr=z(384 * 24 * 32 * 4, torch.int32), sz_ptr=z(24 * 3072 * 2), out_ptr=z(256 * 3072),
          M=256, N=3072, K=3072, J=4, G=128, BLOCK_M=128, R8=16, WEIGHT_ORDER=True, EXACT=False)
out["writes"] = written(KI._linear_kernel, kw)
print(json.dumps(out))
"""


def test_the_3b_matmul_compiles_for_the_h200_to_tensor_cores_and_16_byte_loads():
    """Compiled for sm_90 here (no GPU needed), at linear_config's tiles for a 3B weight: its dots are Hopper's
    wgmma (bf16 in, float32 accumulators), x and the int4 words arrive in 16-byte asynchronous copies (pipelined
    into shared memory, num_stages deep; ld.global.v4 where not pipelined), only scales and zeros in 2-byte loads;
    it fits the H200's shared memory and writes its output alone."""
    got = on_h200_target(LINEAR_COMPILE)
    for g in ("128", "32"):
        assert got[g]["dots"] == ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"]
        assert set(got[g]["loads"]) <= {"0x10", "ld.global.v4.b32", "ld.global.b16"}
        assert got[g]["loads"].count("0x10") >= 10  # a step's x (8 per thread) and words (2), num_stages deep
        assert 0 < got[g]["shared"] <= 227 * 1024
    assert got["128"]["loads"].count("ld.global.b16") <= 8  # one group per tile: a feature's scale and zero alone
    assert got["writes"] == ["out_ptr"]
