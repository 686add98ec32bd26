"""The whole decode step on the H200 (3B shapes, bf16), by attention split (issue 6).

1. check: the attention kernel (rope, the cache write and the merge of its splits folded in) against rope + the
   written-out attention, at each split.
2. splits: the DecodeStep run eagerly but captured as one CUDA graph (its ops are the compiled Triton kernels; the
   rope's cos/sin and the counters' fill are a few small torch kernels), for each (splits, BLOCK_T).
3. GEMV configs in the step: for each GEMV kind in turn, candidates around the isolated sweep's best (and wider
   K tiles: more bytes in flight per program, fewer dependent loop trips), the others held; the fastest step wins.
4. compiled: the best split and configs under torch.compile (the kernels AOTInductor will put into the `.so`), with the
   eager decoder at S = 1 (cuBLAS) as the reference, logits compared.
5. layer timeline: torch.profiler over replays: each kernel slot of a layer, its time and the gap before it,
   averaged over layers 1-28.

Session 12's first run (`h200/step_sweep_s12.*`) also timed L2-prefetch plans: extra programs issuing
`cp.async.bulk.prefetch.L2` of the next kernel's weights. Every plan was slower than none (2.36-2.80 ms against
2.34), and the prefetch was taken out.

    python benchmarks/decode_step_sweep.py --out results.json     (GPU; about 3 minutes)
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from decode_kernels import BF16, DEV, build, rel_err
from profile_decode import graph_ms
from torch.profiler import ProfilerActivity, profile

from runner.export import kernels as K
from runner.export.config import TextConfig
from runner.export.decode_step import DecodeStep
from runner.export.model import TextDecoder, rope

SPLITS = ((8, 64), (1, 128), (4, 64), (4, 128), (8, 32), (16, 32), (16, 64))


def check(lm, c, out: dict) -> None:
    rep, d, n_kv = c.n_heads // c.n_kv_heads, c.head_dim, c.n_kv_heads
    la = lm.model.layers[0]
    kc, vc = la.self_attn.kv_cache.k_cache.clone(), la.self_attn.kv_cache.v_cache.clone()
    pos = torch.tensor([511], device=DEV)
    qkv = torch.randn((c.n_heads + 2 * n_kv) * d, dtype=BF16, device=DEV)
    cos, sin = (t.reshape(d) for t in rope(pos, d, c.rope_theta, BF16))
    q, k, v = qkv.view(-1, d).split([c.n_heads, n_kv, n_kv])

    def rope_ref(x):
        x1, x2 = x.float().chunk(2, -1)
        return (x.float() * cos.float() + torch.cat((-x2, x1), -1) * sin.float()).to(BF16)

    want_k, want_v = kc.clone(), vc.clone()
    want_k[0, :, 511], want_v[0, :, 511] = rope_ref(k), v
    qq = rope_ref(q).view(1, n_kv, rep, d)
    scores = torch.matmul(qq, want_k[:, :, :512].transpose(-1, -2)).float() * d**-0.5
    want = torch.matmul(torch.softmax(scores, -1).to(BF16), want_v[:, :, :512]).reshape(-1)
    for splits, bt in SPLITS:
        k2, v2 = kc.clone(), vc.clone()
        counts = torch.zeros(n_kv, dtype=torch.int32, device=DEV)
        rot = K.rope_table(pos, qkv, c.rope_theta, d)
        got = K._launch_attention(qkv, rot, k2, v2, pos, counts, 0, splits, bt)
        out[f"attention {splits}x{bt} rel err"] = rel_err(got, want)
        out[f"attention {splits}x{bt} cache rel err"] = max(rel_err(k2, want_k), rel_err(v2, want_v))
        out[f"attention {splits}x{bt} counts"] = counts.tolist()
    print(json.dumps(out, indent=1), flush=True)


# (BLOCK_N, BLOCK_K, num_warps, num_stages) candidates per GEMV, by K.GEMV_CONFIGS key; the first is the table's
CANDIDATES = {
    ("rms", 6144, 3072): [(16, 512, 4, 3), (8, 1024, 4, 1), (16, 1024, 8, 1), (4, 4096, 8, 1), (8, 4096, 8, 1)],
    ("add", 3072, 4096): [
        (2, 1024, 8, 1),
        (2, 4096, 8, 1),
        (4, 4096, 8, 1),
        (1, 4096, 4, 1),
        (2, 2048, 8, 1),
        (4, 2048, 8, 1),
    ],
    ("rms_glu", 8192, 3072): [(16, 256, 4, 1), (8, 1024, 8, 1), (4, 4096, 8, 1), (8, 512, 4, 1), (2, 4096, 4, 1)],
    ("add", 3072, 8192): [(2, 1024, 4, 3), (2, 8192, 8, 1), (1, 8192, 8, 1), (2, 4096, 8, 1), (4, 4096, 8, 1)],
}


def step_ms(step, emb, pos) -> float:
    return min(graph_ms(lambda: step(emb, pos), 30) for _ in range(3))


def tune_gemvs(step, emb, pos, out: dict) -> None:
    best_ms = step_ms(step, emb, pos)
    log = []
    for key, cands in CANDIDATES.items():
        best_cfg = K.GEMV_CONFIGS.get(key, K.DEFAULT_GEMV)
        for cfg in cands:
            if cfg == best_cfg:
                continue
            K.GEMV_CONFIGS[key] = cfg
            try:
                ms = step_ms(step, emb, pos)
            except Exception as e:  # a config Triton cannot compile (registers): skip it, say so
                print(f"  {key} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            log.append((key, cfg, round(ms, 4)))
            print(f"  {key} {cfg}: {ms:.4f} ms/step (best so far {best_ms:.4f})", flush=True)
            if ms < best_ms:
                best_ms, best_cfg = ms, cfg
        K.GEMV_CONFIGS[key] = best_cfg
    out["gemv_tuning"] = log
    out["gemv_configs"] = {str(k): v for k, v in K.GEMV_CONFIGS.items()}
    print(f"tuned: {best_ms:.4f} ms/step ({1e3 / best_ms:.0f} tok/s); {out['gemv_configs']}", flush=True)


def time_splits(step, emb, pos, out: dict) -> tuple[int, int]:
    rows = []
    for split in SPLITS:
        K.ATTN_SPLITS, K.ATTN_BLOCK_T = split
        ms = step_ms(step, emb, pos)
        rows.append((ms, split))
        print(f"  splits {split[0]:2d} x BLOCK_T {split[1]:3d}: {ms:.4f} ms/step ({1e3 / ms:.0f} tok/s)", flush=True)
    rows.sort()
    out["splits"] = [(round(ms, 4), split) for ms, split in rows]
    print(f"best: {rows[0][1]}: {rows[0][0]:.4f} ms", flush=True)
    return rows[0][1]


def layer_timeline(fn, n_layers: int, title: str, replays: int = 10) -> list:
    """Kernels of `replays` graph replays in order; each layer's run of kernels from the one before its attention
    (qkv) up to the next qkv; per slot: name, mean us, mean gap before it, over layers 1..n-2."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    ev = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    per_step = len(ev) // replays
    attn = [i for i, e in enumerate(ev[:per_step]) if "attention" in e[2]]
    slots: dict[int, list] = collections.defaultdict(list)
    for r in range(replays):
        o = r * per_step
        for li in range(1, n_layers - 1):
            a, b = attn[li] - 1, attn[li + 1] - 1
            for k, i in enumerate(range(a, b)):
                st, en, nm = ev[o + i]
                slots[k].append((nm, en - st, st - ev[o + i - 1][1]))
    rows = [
        (v[0][0][:40], sum(x[1] for x in v) / len(v), sum(x[2] for x in v) / len(v)) for _, v in sorted(slots.items())
    ]
    step_us = sum(e - s_ for s_, e, _ in ev[:per_step])
    print(f"## {title}: {per_step} kernels per step, {step_us / 1e3:.3f} ms of kernel time; one layer:", flush=True)
    for nm, us, gap in rows:
        print(f"   {nm:40s} {us:7.2f} us  (gap before {gap:5.2f} us)", flush=True)
    print(f"   layer total {sum(r[1] + r[2] for r in rows):.2f} us", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--fill", type=int, default=512, help="cache positions already written")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    c = TextConfig()
    lm = build(c, 1024, 1000)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    emb = torch.randn(1, 1, c.dim, dtype=BF16, device=DEV) * 0.5
    pos = torch.tensor([args.fill], device=DEV)
    caches = [t for la in lm.model.layers for t in (la.self_attn.kv_cache.k_cache, la.self_attn.kv_cache.v_cache)]
    saved = [t.clone() for t in caches]

    def restore():
        for t, s in zip(caches, saved):
            t.copy_(s)

    try:
        with torch.no_grad():
            t0 = time.time()
            check(lm, c, res.setdefault("check", {}))
            ref_dec, step = TextDecoder(c, lm), DecodeStep(c, lm)
            restore()
            ref = ref_dec(emb, pos)
            res["reference_eager_ms"] = graph_ms(lambda: ref_dec(emb, pos), 20)
            print(
                f"eager decoder S=1 (cuBLAS): {res['reference_eager_ms']:.4f} ms ({time.time() - t0:.0f} s)", flush=True
            )
            split = time_splits(step, emb, pos, res)
            K.ATTN_SPLITS, K.ATTN_BLOCK_T = split
            tune_gemvs(step, emb, pos, res)
            restore()
            res["eager rel err"] = rel_err(step(emb, pos), ref)
            res["timeline eager"] = layer_timeline(lambda: step(emb, pos), c.n_layers, f"eager step, splits {split}")
            if not args.no_compile:
                t0 = time.time()
                compiled = torch.compile(step, fullgraph=True)
                restore()
                got = compiled(emb, pos)
                r = {"compile_s": time.time() - t0, "rel_err": rel_err(got, ref)}
                r["argmax_equal"] = bool(got.argmax() == ref.argmax())
                r["ms"] = min(graph_ms(lambda: compiled(emb, pos), 50) for _ in range(3))
                res["compiled"] = r
                print(f"compiled: {r}  ({1e3 / r['ms']:.0f} tok/s)", flush=True)
                res["timeline compiled"] = layer_timeline(lambda: compiled(emb, pos), c.n_layers, "compiled step")
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
