"""The prefill's causal attention (`runner/export/kernels_prefill.py`, our Triton op) against torch's SDPA on the
H200: the 3B's heads (32 query, 8 KV, head 128) at each prompt length, our op over a grid of tiles and SDPA
(is_causal, GQA) by each backend that takes the shape, each call one CUDA graph replayed back to back. TFLOP/s
count the causal half (each query against its own and earlier positions); errors are against the math backend in
float32, relative to the output's scale.

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
from runner.models.voxtral_config import TextConfig

DEV, BF16 = "cuda", torch.bfloat16
# (BLOCK_M, BLOCK_N, num_warps, num_stages): the table's first, then the Triton tutorial's Hopper candidates
GRID = [KP.prefill_config(128), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3)]
BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def timed(who: str, fn, ref, flop: float, **extra) -> dict:
    """fn's error against ref and its time as a graph; a config or backend that fails is a row with its error."""
    try:
        err = rel_err(fn(), ref)  # also compiles a Triton config before the capture
        ms = graph_ms(fn, 10)
    except Exception as e:  # noqa: BLE001 - one failing row (shared memory, a backend's shape rules) is not the end
        return {"who": who, "error": str(e).splitlines()[0][:200], **extra}
    return {"who": who, "ms": ms, "tflops": flop / ms / 1e9, "rel_err": err, **extra}


def one_length(c: TextConfig, kc, vc, s: int) -> list[dict]:
    rep, d, kv = c.n_heads // c.n_kv_heads, c.head_dim, c.n_kv_heads
    q = torch.randn(1, kv, s * rep, d, dtype=BF16, device=DEV)  # as the model folds it: row r is position r // rep
    qh = q.view(kv, s, rep, d).transpose(1, 2).reshape(1, kv * rep, s, d)  # SDPA's layout, made before timing
    kh, vh = kc[:, :, :s], vc[:, :, :s]
    flop = 4 * c.n_heads * d * s * (s + 1) / 2

    def folded(y):
        return y.view(kv, rep, s, d).transpose(1, 2).reshape(1, kv, s * rep, d)

    def sdpa(backend, q=qh, k=kh, v=vh):
        with sdpa_kernel(backend):
            return folded(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

    ref = sdpa(SDPBackend.MATH, qh.float(), kh.float(), vh.float())
    rows = [
        timed(f"ours {cfg}", lambda cfg=cfg: KP._launch_prefill(q, kc, vc, rep, cfg), ref, flop, config=cfg)
        for cfg in GRID
    ]
    rows += [timed(f"sdpa {b.name}", lambda b=b: sdpa(b), ref, flop) for b in BACKENDS]
    # where a backend refuses GQA: the keys and values repeated per query head beforehand (not timed)
    kr, vr = (x.repeat_interleave(rep, dim=1) for x in (kh, vh))
    rows.append(timed("sdpa default, K/V repeated", lambda: folded(F.scaled_dot_product_attention(
        qh, kr, vr, is_causal=True)), ref, flop))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="385,2000,7510", help="prompt lengths (30 s: 385; 10 minutes: 7510)")
    ap.add_argument("--max-seq", type=int, default=10240, help="the caches' positions (the 10-minute bundle's)")
    ap.add_argument("--out", default=None, help="JSON of every row")
    args = ap.parse_args()
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths: comma-separated integers, got {args.lengths!r}")
    if not all(1 <= n <= args.max_seq for n in lengths):
        ap.error(f"--lengths: 1 to --max-seq ({args.max_seq}) positions each")
    c = TextConfig()
    kc, vc = (torch.randn(1, c.n_kv_heads, args.max_seq, c.head_dim, dtype=BF16, device=DEV) for _ in range(2))
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "lengths": {}}
    try:
        for s in lengths:
            rows = one_length(c, kc, vc, s)
            results["lengths"][s] = rows
            ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
            for r in ok:
                print(
                    f"prefill attention, {s} positions: {r['who']:<32} {r['ms']:8.3f} ms {r['tflops']:5.0f} "
                    f"TFLOP/s, rel err {r['rel_err']:.1e}",
                    flush=True,
                )
            for r in rows:
                if "error" in r:
                    print(f"prefill attention, {s} positions: {r['who']} failed: {r['error']}", flush=True)
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
