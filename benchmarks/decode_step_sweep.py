"""The whole decode step on the H200 (3B shapes, bf16), by L2-prefetch plan and attention split (issue 6).

1. check: the fused attention (rope and the cache write folded in) against rope + the written-out attention, and a
   GEMV with prefetch programs against the same GEMV without (must be equal: the prefetch only warms L2).
2. plans: the DecodeStep run eagerly but captured as one CUDA graph (its ops are the compiled Triton kernels; the
   rope's cos/sin are a few small torch kernels), for each `PREFETCH_BYTES` plan and attention split. The plan
   "off" is the session-11 step less the two rope/cache kernels per layer.
3. compiled: the best plan and "off" under torch.compile (the kernels AOTInductor will put into the `.so`), with
   the eager decoder at S = 1 (cuBLAS) as the reference, logits compared.
4. layer timeline: torch.profiler over replays of the best plan and of "off": each kernel slot of a layer, its
   time and the gap before it, averaged over layers 1-28.

    python benchmarks/decode_step_sweep.py --out results.json     (GPU; about 4 minutes)
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

MB = 1 << 20
KINDS = ("qkv", "attention", "o_proj", "gate_up", "down", "lm_head")


def plan(qkv=0, attention=0, tails=0, lm_head=0) -> dict[str, int]:
    """`tails`: what o_proj, gate_up and down each prefetch of the next weights, in MB."""
    return dict(zip(KINDS, (qkv * MB, attention * MB, tails * MB, tails * MB, tails * MB, lm_head * MB)))


PLANS = {
    "off": plan(),
    "attn24": plan(attention=24),
    "attn12": plan(attention=12),
    "tails4": plan(tails=4),
    "tails8": plan(tails=8),
    "tails16": plan(tails=16),
    "attn24+tails4": plan(attention=24, tails=4),
    "attn24+tails8": plan(attention=24, tails=8),
    "attn24+tails16": plan(attention=24, tails=16),
    "attn24+tails24": plan(attention=24, tails=24),
    "qkv8+attn24+tails8": plan(qkv=8, attention=24, tails=8),
    "attn24+tails8+lm16": plan(attention=24, tails=8, lm_head=16),
    "qkv12+attn12+tails8+lm16": plan(qkv=12, attention=12, tails=8, lm_head=16),
}
SPLITS = ((8, 64), (1, 128), (4, 128), (8, 128))


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
        got = K._launch_attention(
            qkv, cos, sin, k2, v2, pos, splits, bt, pf=la.self_attn.o_proj.weight, pf_bytes=24 * MB
        )
        out[f"attention {splits}x{bt} rel err"] = rel_err(got, want)
        out[f"attention {splits}x{bt} cache rel err"] = max(rel_err(k2, want_k), rel_err(v2, want_v))
    x = torch.randn(c.dim, dtype=BF16, device=DEV)
    w, nxt = la.self_attn.qkv_proj.weight, la.mlp.gate_up_proj.weight
    g = la.input_layernorm.weight
    plain = K._launch_gemv(x, w, g=g, eps=c.norm_eps)
    with_pf = K._launch_gemv(x, w, g=g, eps=c.norm_eps, pf=nxt, pf_bytes=16 * MB, pf_parts=2)
    out["gemv with prefetch equal"] = bool(torch.equal(plain, with_pf))
    print(json.dumps(out, indent=1), flush=True)


def time_plans(step, emb, pos, out: dict) -> tuple[str, tuple[int, int]]:
    rows = []
    for splits, bt in SPLITS[:1]:
        K.ATTN_SPLITS, K.ATTN_BLOCK_T = splits, bt
        for name, p in PLANS.items():
            K.PREFETCH_BYTES.update(p)
            try:
                ms = min(graph_ms(lambda: step(emb, pos), 30) for _ in range(3))
            except Exception as e:  # a plan that cannot compile or run: say so, go on
                print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            rows.append((ms, name, (splits, bt)))
            print(f"  {name:28s} splits {splits}x{bt}: {ms:.4f} ms/step ({1e3 / ms:.0f} tok/s)", flush=True)
    best_name = min(rows)[1] if rows else "off"
    K.PREFETCH_BYTES.update(PLANS[best_name])
    for splits, bt in SPLITS[1:]:
        K.ATTN_SPLITS, K.ATTN_BLOCK_T = splits, bt
        ms = min(graph_ms(lambda: step(emb, pos), 30) for _ in range(3))
        rows.append((ms, best_name, (splits, bt)))
        print(f"  {best_name:28s} splits {splits}x{bt}: {ms:.4f} ms/step ({1e3 / ms:.0f} tok/s)", flush=True)
    rows.sort()
    out["plans"] = [(round(ms, 4), name, s) for ms, name, s in rows]
    ms, name, split = rows[0]
    print(f"best: {name} splits {split}: {ms:.4f} ms", flush=True)
    return name, split


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
            best, split = time_plans(step, emb, pos, res)
            K.ATTN_SPLITS, K.ATTN_BLOCK_T = split
            for name in (best, "off"):
                K.PREFETCH_BYTES.update(PLANS[name])
                restore()
                res[f"eager {name} rel err"] = rel_err(step(emb, pos), ref)
                res[f"timeline {name}"] = layer_timeline(lambda: step(emb, pos), c.n_layers, f"eager step, {name}")
            if not args.no_compile:
                for name in (best, "off"):
                    K.PREFETCH_BYTES.update(PLANS[name])
                    torch._dynamo.reset()
                    t0 = time.time()
                    compiled = torch.compile(step, fullgraph=True)
                    restore()
                    got = compiled(emb, pos)
                    r = {"compile_s": time.time() - t0, "rel_err": rel_err(got, ref)}
                    r["argmax_equal"] = bool(got.argmax() == ref.argmax())
                    r["ms"] = min(graph_ms(lambda f=compiled: f(emb, pos), 50) for _ in range(3))
                    res[f"compiled {name}"] = r
                    print(f"compiled {name}: {r}  ({1e3 / r['ms']:.0f} tok/s)", flush=True)
                    layer_timeline(lambda f=compiled: f(emb, pos), c.n_layers, f"compiled step, {name}")
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
