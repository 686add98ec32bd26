"""The prefill's causal attention (`runner/export/kernels_prefill.py`, our Triton op) against torch's SDPA on the
H200: the 3B's heads (32 query, 8 KV, head 128) at each prompt length, our op (the queries' RoPE and o_proj's
layout included) over a grid of tiles and SDPA (is_causal, GQA; RoPE applied beforehand, the layout in its time)
by each backend that takes the shape, each call over the 30 layers' own caches, one CUDA graph replayed back to
back, times per layer. TFLOP/s count the causal
half (each query against its own and earlier positions); errors are against the math backend in float32,
relative to the output's scale.

Then the MLP's SiLU(gate) * up at each length: our op (`kernels_prefill.silu_mul`, over a few tiles) against
Inductor's fused kernel for the same torch ops (torch.compile with a dynamic length, as the export compiles them:
compiled for one static length it ran at twice the bundle's speed, NOTES item 61); GB/s count the bytes read and
written once.

Then the audio encoder's attention (bidirectional, 20 heads of 64 over each 30 s chunk's 1500 positions) by each
SDPA backend at 1 and 20 chunks: the exported encoder calls SDPA, and the backend the export picks is the one
`sdpa default` runs here.

    python benchmarks/prefill_attention.py --lengths 385,2000,7510 --max-seq 10240 --out prefill.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from decode_kernels import rel_err
from profile_decode import graph_ms
from torch.nn.attention import SDPBackend, sdpa_kernel

from runner.export import kernels_prefill as KP
from runner.models.voxtral import apply_rope, rope
from runner.models.voxtral_config import AudioConfig, TextConfig

DEV, BF16 = "cuda", torch.bfloat16
# (BLOCK_M, BLOCK_N, num_warps, num_stages): the table's first, then the Triton tutorial's Hopper candidates
GRID = [KP.prefill_config(128), (64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 32, 4, 3)]
# silu_mul's (BLOCK_R, BLOCK_C, num_warps): the table's first
SILU_GRID = [KP.SILU_MUL_CONFIG, (1, 1024, 4), (4, 1024, 8), (8, 512, 4), (1, 2048, 8)]
BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def timed(who: str, fn, ref, flop: float = 0.0, moved: float = 0.0, layers: int = 1, **extra) -> dict:
    """fn's error against ref (its first layer's output where it runs several) and its time per layer as a graph,
    its rate in TFLOP/s of `flop` or GB/s of `moved` bytes; a config or backend that fails is a row with its
    error."""
    try:
        out = fn()  # also compiles a Triton config before the capture
        err = rel_err(out[0] if isinstance(out, list) else out, ref)
        ms = graph_ms(fn, 10) / layers
    except Exception as e:  # noqa: BLE001 - one failing row (shared memory, a backend's shape rules) is not the end
        return {"who": who, "error": str(e).splitlines()[0][:200], **extra}
    rate = {"tflops": flop / ms / 1e9} if flop else {"gb_s": moved / ms / 1e6}
    return {"who": who, "ms": ms, **rate, "rel_err": err, **extra}


def one_length(c: TextConfig, caches: list, s: int) -> list[dict]:
    """Each call runs over every layer's own cache in turn, as the prefill does: a cache read by the call before is
    not still in L2 (one cache called again and again favoured tiles that re-read keys more, NOTES item 64)."""
    rep, d, kv = c.n_heads // c.n_kv_heads, c.head_dim, c.n_kv_heads
    kc, vc = caches[0]
    qkv = torch.randn(1, s, (c.n_heads + 2 * kv) * d, dtype=BF16, device=DEV)  # as the qkv projection writes it
    start = torch.arange(s, device=DEV)  # the prompt's positions: from 0
    cos, sin = rope(start, d, c.rope_theta, BF16)
    # SDPA's queries with RoPE applied and in its layout, made before timing (our op does both as it loads)
    qh = apply_rope(qkv[0, :, : c.n_heads * d].view(s, c.n_heads, d).transpose(0, 1), cos, sin)[None]
    kh, vh = kc[:, :, :s], vc[:, :, :s]
    flop = 4 * c.n_heads * d * s * (s + 1) / 2

    def as_rows(y):  # [1, H, S, D] -> o_proj's input [1, S, H * D], as our op writes it
        return y.transpose(1, 2).reshape(1, s, c.n_heads * d)

    def sdpa_one(backend, q, k, v):
        with sdpa_kernel(backend):
            return as_rows(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

    def sdpa(backend):
        return [sdpa_one(backend, qh, k[:, :, :s], v[:, :, :s]) for k, v in caches]

    ref = sdpa_one(SDPBackend.MATH, qh.float(), kh.float(), vh.float())

    def ours(cfg):
        return [KP._launch_prefill(qkv, cos, sin, k, v, start, rep, cfg) for k, v in caches]

    n = len(caches)
    rows = [timed(f"ours {cfg}", lambda cfg=cfg: ours(cfg), ref, flop, layers=n, config=cfg) for cfg in GRID]
    rows += [timed(f"sdpa {b.name}", lambda b=b: sdpa(b), ref, flop, layers=n) for b in BACKENDS]
    # where a backend refuses GQA: the keys and values repeated per query head beforehand (not timed; layer 0's)
    kr, vr = (x.repeat_interleave(rep, dim=1) for x in (kh, vh))
    rows.append(timed("sdpa default, K/V repeated", lambda: as_rows(F.scaled_dot_product_attention(
        qh, kr, vr, is_causal=True)), ref, flop))  # fmt: skip
    return rows


def silu_mul_rows(c: TextConfig, s: int) -> list[dict]:
    gate_up = torch.randn(1, s, 2 * c.ffn_dim, dtype=BF16, device=DEV)
    moved = gate_up.numel() * 1.5 * gate_up.element_size()  # read gate and up, write half as many

    def mlp_act(gu):  # the model's written-out form (MLP.forward)
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up

    ref = mlp_act(gate_up.float())
    inductor = torch.compile(mlp_act)
    torch._dynamo.mark_dynamic(gate_up, 1)  # the prompt's length, as the export's Dim("seq"); the widths static
    rows = [timed("inductor", lambda: inductor(gate_up), ref, moved=moved)]
    return rows + [
        timed(f"ours {cfg}", lambda cfg=cfg: KP._launch_silu_mul(gate_up, cfg), ref, moved=moved, config=cfg)
        for cfg in SILU_GRID
    ]


def encoder_chunks(a: AudioConfig, chunks: int) -> list[dict]:
    t, h = a.max_source_positions, a.n_heads
    d = a.dim // h
    q, k, v = (torch.randn(chunks, h, t, d, dtype=BF16, device=DEV) for _ in range(3))
    flop = 4 * chunks * h * d * t * t

    def sdpa(backend=None, q=q, k=k, v=v):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)

    ref = sdpa(SDPBackend.MATH, q.float(), k.float(), v.float())
    return [timed("sdpa default", sdpa, ref, flop)] + [
        timed(f"sdpa {b.name}", lambda b=b: sdpa(b), ref, flop) for b in BACKENDS
    ]


def exported_attention(a: AudioConfig) -> list[str]:
    """The SDPA op torch.export puts in the encoder's attention on this GPU (what AOTInductor then calls)."""
    from runner.models.voxtral import EncoderAttention

    m = EncoderAttention(a.dim, a.n_heads).to(DEV, BF16)
    x = torch.randn(1, a.max_source_positions, a.dim, dtype=BF16, device=DEV)
    graph = torch.export.export(m, (x,)).run_decompositions().graph
    return sorted({str(n.target) for n in graph.nodes if "attention" in str(n.target)})


def report(what: str, rows: list[dict]) -> None:
    for r in sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"]):
        print(
            f"{what}: {r['who']:<32} {r['ms']:8.3f} ms {r.get('tflops') or r['gb_s']:5.0f} "
            f"{'TFLOP/s' if 'tflops' in r else 'GB/s'}, rel err {r['rel_err']:.1e}",
            flush=True,
        )
    for r in rows:
        if "error" in r:
            print(f"{what}: {r['who']} failed: {r['error']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="385,2000,7510", help="prompt lengths (30 s: 385; 10 minutes: 7510)")
    ap.add_argument("--max-seq", type=int, default=10240, help="the caches' positions (the 10-minute bundle's)")
    ap.add_argument("--layers", type=int, default=30, help="layers' caches each call runs over (the 3B's 30)")
    ap.add_argument("--encoder-chunks", default="1,20", help="the audio encoder's attention at these chunk counts")
    ap.add_argument("--out", default=None, help="JSON of every row")
    args = ap.parse_args()
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        chunk_counts = [int(x) for x in args.encoder_chunks.split(",") if x]
    except ValueError:
        ap.error(
            f"--lengths, --encoder-chunks: comma-separated integers, got {args.lengths!r}, {args.encoder_chunks!r}"
        )
    if args.layers < 1:
        ap.error("--layers: at least 1")
    if not all(1 <= n <= args.max_seq for n in lengths):
        ap.error(f"--lengths: 1 to --max-seq ({args.max_seq}) positions each")
    c = TextConfig()
    shape = (1, c.n_kv_heads, args.max_seq, c.head_dim)
    caches = [tuple(torch.randn(shape, dtype=BF16, device=DEV) for _ in range(2)) for _ in range(args.layers)]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "lengths": {}, "encoder": {}}
    try:
        for s in lengths:
            results["lengths"][s] = rows = one_length(c, caches, s)
            report(f"prefill attention, {s} positions", rows)
            results.setdefault("silu_mul", {})[s] = rows = silu_mul_rows(c, s)
            report(f"silu_mul, {s} rows", rows)
        for n in chunk_counts:
            results["encoder"][n] = rows = encoder_chunks(AudioConfig(), n)
            report(f"encoder attention, {n} chunks", rows)
        if chunk_counts:
            results["encoder_exported"] = ops = exported_attention(AudioConfig())
            print(f"encoder attention, as exported: {', '.join(ops) or 'written out'}", flush=True)
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
