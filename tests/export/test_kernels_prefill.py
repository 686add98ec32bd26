"""The prefill attention kernel (runner/export/kernels_prefill.py) against torch's causal attention: ragged prompt
lengths and tiles, grouped query heads, nothing read past the prompt; and the tiny model's prefill through the op
against the written-out prefill and the cache-attending decoder. On a GPU the kernel is compiled; without one,
Triton's interpreter runs it on the CPU (float16 there: the interpreter computes tl.dot on bfloat16 wrongly)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_env import DEV, DOT_DTYPE, on_h200_target  # before the kernels: on a CPU machine they are interpreted

pytest.importorskip("triton")

from runner.export import kernels_prefill as KP  # noqa: E402
from runner.models.voxtral import Voxtral, apply_rope, rope  # noqa: E402
from runner.models.voxtral_config import preset  # noqa: E402


def reference(qkv, cos, sin, k_cache, v_cache, rep, p0=0):
    """RoPE on the queries (the model's apply_rope, in float32), then causal SDPA in float32: qkv [1, S, (H + 2 H_kv)
    * D] at positions [p0, p0 + S), attending to [0, own position] -> [1, S, H * D]."""
    _, kv, _, d = k_cache.shape
    s = qkv.shape[1]
    q = qkv[0, :, : kv * rep * d].float().view(s, kv * rep, d).transpose(0, 1)  # [H, S, D]
    q = apply_rope(q, cos.float(), sin.float())
    k = k_cache[0, :, : p0 + s].float().repeat_interleave(rep, dim=0)
    v = v_cache[0, :, : p0 + s].float().repeat_interleave(rep, dim=0)
    visible = torch.arange(p0 + s)[None, :] <= torch.arange(p0, p0 + s)[:, None]
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible.to(q.device))  # [H, S, D]
    return y.transpose(0, 1).reshape(1, s, kv * rep * d)


def inputs(s, rep, p0=0, seed=0):
    """A random qkv for S tokens at positions [p0, p0 + S), the model's cos/sin there, and caches holding random
    keys and values at [0, p0 + S) and NaN past them (never to be read)."""
    g = torch.Generator().manual_seed(seed)
    kv, d = 2, 16
    qkv = torch.randn(1, s, (rep + 2) * kv * d, generator=g).to(DEV, DOT_DTYPE)
    cos, sin = rope(torch.arange(p0, p0 + s), d, 1e4, DOT_DTYPE)
    kc, vc = (torch.randn(1, kv, p0 + s + 16, d, generator=g).to(DEV, DOT_DTYPE) for _ in range(2))
    kc[:, :, p0 + s :], vc[:, :, p0 + s :] = float("nan"), float("nan")
    return qkv, cos.to(DEV), sin.to(DEV), kc, vc


@pytest.mark.parametrize("s", [1, 5, 16, 37, 64, 150])  # one token, ragged, block edges, many tiles
@pytest.mark.parametrize("rep", [1, 2, 4])
@pytest.mark.parametrize("config", [(16, 16, 4, 1), (32, 16, 4, 2), (64, 32, 4, 1)])
def test_prefill_attention_matches_causal_sdpa(s, rep, config):
    qkv, cos, sin, kc, vc = inputs(s, rep, seed=s * 10 + rep)
    got = KP._launch_prefill(qkv, cos, sin, kc, vc, torch.arange(s, device=DEV), rep, config)
    assert got.shape == (1, s, rep * 2 * 16) and got.dtype == qkv.dtype
    tol = 2e-3 if DOT_DTYPE == torch.float16 else 2e-2  # q and probabilities rounded to the dot's dtype
    assert (got.float() - reference(qkv, cos, sin, kc, vc, rep)).abs().max().item() < tol


@pytest.mark.parametrize("p0,s", [(1, 1), (7, 9), (16, 16), (23, 41), (64, 37), (100, 5)])  # tile edges and not
@pytest.mark.parametrize("rep", [1, 4])
@pytest.mark.parametrize("config", [(16, 16, 4, 1), (64, 32, 4, 1)])
def test_a_piece_of_a_prompt_attends_to_the_positions_before_it(p0, s, rep, config):
    """A prompt in pieces: queries at positions [p0, p0 + S) see the cache's [0, own position], the earlier
    pieces' keys included, and nothing past p0 + S - 1; RoPE at their own positions."""
    qkv, cos, sin, kc, vc = inputs(s, rep, p0, seed=p0 * 100 + s + rep)
    got = KP._launch_prefill(qkv, cos, sin, kc, vc, torch.arange(p0, p0 + s, device=DEV), rep, config)
    tol = 2e-3 if DOT_DTYPE == torch.float16 else 2e-2
    assert (got.float() - reference(qkv, cos, sin, kc, vc, rep, p0)).abs().max().item() < tol


def test_prefill_config_by_head_size():
    assert KP.prefill_config(128)[:2] == (128, 64)  # the 3B's heads: the fastest in the bundle (NOTES item 64)
    block_m, block_n, _, _ = KP.prefill_config(16)  # the tiny model's: tl.dot needs tiles >= 16
    assert block_m >= 16 and block_n >= 16


@torch.no_grad()
def test_tiny_prefill_through_the_op_matches_the_written_out_prefill():
    """The tiny model's prompt through the op (as the CUDA text_decoder holds it) against the written-out
    prompt-only prefill and the decoder that attends to the whole cache: the same logits and caches."""
    cfg = preset("tiny")
    m = Voxtral(cfg).init_weights(seed=3).to(DEV, DOT_DTYPE)
    m.setup_caches(64)
    g = torch.Generator().manual_seed(0)
    emb = (torch.randn(1, 23, cfg.text.dim, generator=g) * 0.5).to(DEV, DOT_DTYPE)
    pos = torch.arange(23, device=DEV)
    results = []
    for decoder in (m.prefiller(KP.KERNELS), m.prefiller(), m.decoder()):
        m.reset_caches()
        logits = decoder(emb, pos)
        caches = [layer.self_attn.kv_cache.k_cache.clone() for layer in m.language_model.model.layers]
        results.append((logits, caches))
    (op, op_k), (written, written_k), (whole, _) = results
    scale = written.abs().max()
    assert (op - written).abs().max() / scale < 1e-2
    assert (op - whole).abs().max() / scale < 1e-2
    assert torch.equal(op_k[0], written_k[0])  # the first layer's keys come before any attention
    assert all((a - b).abs().max() < 1e-2 * b.abs().max() for a, b in zip(op_k, written_k))


@torch.no_grad()
def test_the_tiny_prefill_in_pieces_is_the_whole_prefill():
    """The tiny model's prompt in three pieces through the op (each at its positions, after the ones before it
    are in the cache) gives the whole prompt's last logits and caches."""
    cfg = preset("tiny")
    m = Voxtral(cfg).init_weights(seed=4).to(DEV, DOT_DTYPE)
    m.setup_caches(64)
    g = torch.Generator().manual_seed(1)
    emb = (torch.randn(1, 23, cfg.text.dim, generator=g) * 0.5).to(DEV, DOT_DTYPE)
    prefill = m.prefiller(KP.KERNELS)
    runs = []
    for pieces in ([(0, 23)], [(0, 8), (8, 16), (16, 23)]):
        m.reset_caches()
        for a, b in pieces:
            logits = prefill(emb[:, a:b], torch.arange(a, b, device=DEV))
        runs.append((logits, [x.self_attn.kv_cache.v_cache.clone() for x in m.language_model.model.layers]))
    (whole, whole_v), (pieces, pieces_v) = runs
    assert (pieces - whole).abs().max() < 1e-2 * whole.abs().max()
    assert all((a - b).abs().max() <= 1e-2 * b.abs().max() for a, b in zip(pieces_v, whole_v))


COMPILE = r"""
from runner.export import kernels_prefill as KP

bm, bn, warps, stages = KP.prefill_config(128)
consts = {"QK_SCALE": 128**-0.5 * KP.LOG2E, "REP": 4, "H_KV": 8, "D": 128, "BLOCK_M": bm, "BLOCK_N": bn}
sig = {**dict.fromkeys(("qkv_ptr", "cos_ptr", "sin_ptr", "k_ptr", "v_ptr"), "*bf16"), "pos_ptr": "*i64",
       "out_ptr": "*bf16", "n_rows": "i32", "kv_stride_h": "i32", **dict.fromkeys(consts, "constexpr")}
# AOTInductor specialises 16-byte-aligned pointers and strides as Triton's launcher does
names = KP._prefill_attention_kernel.arg_names
aligned = ("qkv_ptr", "cos_ptr", "sin_ptr", "k_ptr", "v_ptr", "out_ptr", "kv_stride_h")
attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
k = triton.compile(ASTSource(KP._prefill_attention_kernel, sig, consts, attrs), target=H200,
                   options={"num_warps": warps, "num_stages": stages})
z = lambda n: torch.zeros(n, dtype=torch.bfloat16)
kw = dict(qkv_ptr=z(64 * 48 * 128), cos_ptr=z(64 * 128), sin_ptr=z(64 * 128), k_ptr=z(8 * 64 * 128),
          v_ptr=z(8 * 64 * 128), pos_ptr=torch.arange(64), out_ptr=z(64 * 32 * 128), n_rows=256, kv_stride_h=64 * 128,
          **consts)
writes = written(KP._prefill_attention_kernel, kw)
ptx = k.asm["ptx"]
print(json.dumps({"shared": k.metadata.shared, "wgmma": "wgmma" in ptx, "pipelined": "cp.async" in ptx, "writes": writes}))
"""


def test_the_3b_tile_compiles_for_the_h200_and_writes_only_its_output():
    """The 3B's tile (head 128, rep 4) compiled for sm_90 by Triton here, no GPU needed: it fits the H200's shared
    memory, its dots are Hopper's wgmma and its key and value loads are pipelined (asynchronous copies into
    shared memory, num_stages deep); and AOTInductor's analysis of the Triton IR finds it writes its output
    alone (a kernel that seemed to write the KV cache would have the export copy the cache: NOTES item 26)."""
    got = on_h200_target(COMPILE)
    assert got["writes"] == ["out_ptr"]
    assert got["wgmma"] and got["pipelined"] and 0 < got["shared"] <= 227 * 1024


@pytest.mark.parametrize("rows,ffn", [(1, 16), (5, 48), (37, 1024), (3, 1100)])  # one row, ragged, block edges
@pytest.mark.parametrize("config", [(2, 1024, 4), (4, 64, 2), (1, 16, 1)])
def test_silu_mul_is_the_eager_mlp_activation(rows, ffn, config):
    """SiLU(gate) * up on the gate_up projection's output in 16 bits, as the eager model computes it: equal bit for
    bit (each product rounded where eager rounds it), whatever the tile, the row count and a partial last block.
    (float16 on a CPU: the interpreter casts float32 to bfloat16 by truncation, the GPU rounds to nearest.)"""
    g = torch.Generator().manual_seed(rows * 7 + ffn)
    gate_up = (torch.randn(1, rows, 2 * ffn, generator=g) * 3).to(DEV, DOT_DTYPE)
    gate, up = gate_up.chunk(2, dim=-1)
    got = KP._launch_silu_mul(gate_up, config)
    assert got.shape == (1, rows, ffn) and got.dtype == DOT_DTYPE
    want = F.silu(gate) * up
    assert (got.float() - want.float()).abs().max().item() <= 1e-2 * want.float().abs().max().item()
    assert (got != want).float().mean().item() < 0.01  # exp's last bits may move a rounding, rarely


SILU_MUL = r"""
from runner.export import kernels_prefill as KP

block_r, block_c, warps = KP.SILU_MUL_CONFIG
consts = {"FFN": 8192, "BLOCK_R": block_r, "BLOCK_C": block_c}
sig = {"gu_ptr": "*bf16", "out_ptr": "*bf16", "n_rows": "i32", **dict.fromkeys(consts, "constexpr")}
names = KP._silu_mul_kernel.arg_names
attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("gu_ptr", "out_ptr")}
k = triton.compile(ASTSource(KP._silu_mul_kernel, sig, consts, attrs), target=H200, options={"num_warps": warps})
z = lambda n: torch.zeros(n, dtype=torch.bfloat16)
writes = written(KP._silu_mul_kernel, dict(gu_ptr=z(4 * 16384), out_ptr=z(4 * 8192), n_rows=4, **consts))
ptx = k.asm["ptx"]
print(json.dumps({"v4_loads": ptx.count("ld.global.v4"), "v4_stores": ptx.count("st.global.v4"),
                  "scalar_loads": ptx.count("ld.global.b16") + ptx.count("ld.global.u16"), "writes": writes}))
"""


def test_silu_mul_compiles_to_16_byte_loads_and_stores_for_the_h200():
    """The op exists because Inductor's kernel for the same ops moved ≈ 1.3 TB/s (NOTES item 61): compiled for
    sm_90 here, its loads and stores are 16-byte vectors (no 2-byte ones) and it writes its output alone."""
    got = on_h200_target(SILU_MUL)
    assert got["writes"] == ["out_ptr"]
    assert got["v4_loads"] >= 2 and got["v4_stores"] >= 1 and got["scalar_loads"] == 0


@pytest.mark.parametrize("rows,n", [(1, 16), (7, 80), (33, 1280)])  # non-power-of-two widths: the encoder's 1280
@pytest.mark.parametrize("dtype", [torch.float32, DOT_DTYPE])
def test_add_layer_norm_is_the_residual_add_then_layer_norm(rows, n, dtype):
    """(x + delta, LayerNorm(x + delta)) as the eager encoder computes them: the sum rounded to the dtype first
    (it is the residual stream), the norm over the rounded sum; the sum equal bit for bit, the norm within float32
    reduction order (and one rounding in 16 bits)."""
    g = torch.Generator().manual_seed(rows + n)
    x, delta = ((torch.randn(2, rows, n, generator=g) * 2 + 0.5).to(DEV, dtype) for _ in range(2))
    norm = torch.nn.LayerNorm(n, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2, generator=g), norm.bias.normal_(0.0, 0.2, generator=g)
        norm = norm.to(DEV, dtype)
        total, out = KP._launch_add_layer_norm(x, delta, norm.weight, norm.bias, norm.eps)
        want = norm(x + delta)
    assert torch.equal(total, x + delta)
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert (out.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()


@torch.no_grad()
def test_the_tiny_audio_encoder_through_the_op_is_the_written_out_encoder():
    """The tiny model's audio_encoder method with the prompt's kernels (as the CUDA export holds it) against the
    written-out method: the same audio embeddings, at one chunk and two."""
    from runner.models.voxtral import AudioEncoderMethod

    cfg = preset("tiny")
    m = Voxtral(cfg).init_weights(seed=6).to(DEV)
    g = torch.Generator().manual_seed(2)
    for chunks in (1, 2):
        mel = torch.randn(chunks, cfg.audio.n_mels, 3000, generator=g).to(DEV)
        got, want = AudioEncoderMethod(m, KP.KERNELS)(mel), AudioEncoderMethod(m)(mel)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


ADD_LAYER_NORM = r"""
from runner.export import kernels_prefill as KP

consts = {"EPS": 1e-5, "N": 1280, "BLOCK_N": 2048}
ptrs = ("x_ptr", "delta_ptr", "w_ptr", "b_ptr", "sum_ptr", "out_ptr")
sig = {**dict.fromkeys(ptrs, "*bf16"), **dict.fromkeys(consts, "constexpr")}
names = KP._add_layer_norm_kernel.arg_names
attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ptrs}
k = triton.compile(ASTSource(KP._add_layer_norm_kernel, sig, consts, attrs), target=H200, options={"num_warps": 4})
z = lambda n: torch.zeros(n, dtype=torch.bfloat16)
kw = dict(x_ptr=z(2 * 1280), delta_ptr=z(2 * 1280), w_ptr=z(1280), b_ptr=z(1280), sum_ptr=z(2 * 1280),
          out_ptr=z(2 * 1280), **consts)
writes = written(KP._add_layer_norm_kernel, kw)
ptx = k.asm["ptx"]
print(json.dumps({"v4_loads": ptx.count("ld.global.v4"), "writes": writes,
                  "scalar_loads": ptx.count("ld.global.b16") + ptx.count("ld.global.u16")}))
"""


def test_add_layer_norm_compiles_to_16_byte_loads_for_the_h200():
    """Compiled for sm_90 here: a row read in 16-byte vectors (the 1280 columns' mask is per 8 elements) and the
    kernel writes its two outputs alone."""
    got = on_h200_target(ADD_LAYER_NORM)
    assert sorted(got["writes"]) == ["out_ptr", "sum_ptr"]
    assert got["v4_loads"] >= 2 and got["scalar_loads"] == 0


TRACE = r"""
from runner.export import kernels_prefill as KP
from runner.models.voxtral import AudioEncoderMethod, Voxtral
from runner.models.voxtral_config import preset
from torch.export import Dim, export

m = Voxtral(preset("tiny")).init_weights(seed=1)
m.setup_caches(32)
mel = torch.randn(2, m.config.audio.n_mels, 3000)
encoder = export(AudioEncoderMethod(m, KP.KERNELS), (mel,), dynamic_shapes=({0: Dim("chunks", min=1, max=4)},))
seq = Dim("seq", min=1, max=32)
decoder = export(m.prefiller(KP.KERNELS), (torch.randn(1, 6, m.config.text.dim), torch.arange(6)),
                 dynamic_shapes=({1: seq}, {0: seq}))
named = ("voxtral.", "aten.layer_norm", "aten.silu")
ops = lambda ep: sorted(str(n.target) for n in ep.graph.nodes if str(n.target).startswith(named))
print(json.dumps({"audio_encoder": ops(encoder), "text_decoder": ops(decoder)}))
"""


def test_the_cuda_methods_trace_with_each_op_as_one_node():
    """What the CUDA export traces (torch.export at dynamic chunks and prompt lengths; tracing launches nothing, so
    a CPU does): the encoder's 2 add-norms per layer and the decoder's attention and SiLU · up per layer, each one
    opaque node, nothing of them written out beside."""
    got = on_h200_target(TRACE)
    layers_a, layers_t = preset("tiny").audio.n_layers, preset("tiny").text.n_layers
    # the first layer's norm has no add before it (the position embedding's is fused with the convolutions')
    assert got["audio_encoder"] == ["aten.layer_norm.default"] + ["voxtral.add_layer_norm.default"] * 2 * layers_a
    assert got["text_decoder"] == sorted(["voxtral.prefill_attention.default", "voxtral.silu_mul.default"] * layers_t)
