"""The decode-step kernels (`runner/export/kernels.py`) against cuBLAS and the eager decoder, on the H200.

1. check: each kernel against torch on the 3B shapes (bf16), error relative to the output's scale.
2. gemv: every (BLOCK_N, BLOCK_K, warps, stages) of a grid per GEMV kind, each over the 30 layers' distinct
   weights in one CUDA graph (nothing served from L2), against torch's F.linear (cuBLAS) on the same weights.
3. attention: splits x BLOCK_T at two cache fills (a long cache: warps and stages too), against the written-out
   attention the exported model uses.
4. step: the whole decode step (30 layers + lm_head) as one CUDA graph: the eager decoder at S = 1 (cuBLAS), the
   DecodeStep with the best configs eager, and the DecodeStep under torch.compile (Inductor fuses the rope and
   the cache write as AOTInductor will); logits compared with the eager decoder.
5. splits: attention's splits x BLOCK_T inside the whole step (one CUDA graph, programmatic edges) at each of
   --attention-fills, in a cache of --max-seq: whether the 10-minute bundle's 16 splits cost a short position's step
   (NOTES 53: 2.43 against 2.25 ms, the 1024 bundle's 4) and which count each position wants.

    python benchmarks/decode_kernels.py --out results.json     (GPU; about 3 minutes)
    python benchmarks/decode_kernels.py --parts attention,step --attention-fills 385,450,512 --fill 450
    python benchmarks/decode_kernels.py --parts tune --fill 450     (each GEMV's config inside the step)
    python benchmarks/decode_kernels.py --parts attention --max-seq 10240 --attention-fills 385,2000,7510   (long cache)
    python benchmarks/decode_kernels.py --parts splits --max-seq 10240 --attention-fills 385,1885,7510
    python benchmarks/decode_kernels.py --parts step,tune --fp8 --fill 450   (the step and its GEMVs on e4m3 codes)
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
import triton
from profile_decode import graph_ms

from runner.export import kernels as K
from runner.export import kernels_attention as KA
from runner.export.decode_step import DecodeStep
from runner.models.fp8_linear import Fp8Linear
from runner.models.quant_linear import swap_module
from runner.models.voxtral import KVCache, LanguageModel, TextDecoder, apply_rope, rope
from runner.models.voxtral_config import TextConfig

DEV, BF16 = "cuda", torch.bfloat16


def build(c: TextConfig, max_seq: int, fill: int) -> LanguageModel:
    with torch.device(DEV):
        lm = LanguageModel(c).to(BF16)
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():
        for p in lm.parameters():
            if p.dim() == 1:  # norm scales near one, so folding them in is tested
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device=DEV))
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=DEV) * 0.02)
        for layer in lm.model.layers:
            layer.self_attn.kv_cache = KVCache(max_seq, c.n_kv_heads, c.head_dim, BF16).to(DEV)
            for t in (layer.self_attn.kv_cache.k_cache, layer.self_attn.kv_cache.v_cache):
                t[:, :, :fill].copy_(torch.randn(t[:, :, :fill].shape, generator=g, device=DEV))
    return lm


def to_fp8(lm: LanguageModel) -> None:
    """Every linear of the decoder and lm_head to e4m3 with a scale per row (`--quant fp8`'s layers), in place."""
    for name, m in list(lm.named_modules()):
        if isinstance(m, torch.nn.Linear):
            swap_module(lm, name, Fp8Linear.from_linear(m))
    torch.cuda.empty_cache()


def rms(x, g, eps):
    h = x.float()
    return g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def gemv_cases(lm: LanguageModel, c: TextConfig):
    """kind -> (launch(w, config), reference(w), weights per layer, bytes per call)."""
    x = torch.randn(c.dim, dtype=BF16, device=DEV)
    xo = torch.randn(c.n_heads * c.head_dim, dtype=BF16, device=DEV)
    xf = torch.randn(c.ffn_dim, dtype=BF16, device=DEV)
    g = lm.model.norm.weight
    L = lm.model.layers
    eps = c.norm_eps
    return {
        "rms qkv": (
            lambda w, cfg: K._launch_gemv(x, w, g=g, eps=eps, config=cfg),
            lambda w: F.linear(rms(x, g, eps), w),
            [la.self_attn.qkv_proj.weight for la in L],
        ),
        "add o_proj": (
            lambda w, cfg: K._launch_gemv(xo, w, residual=x, config=cfg),
            lambda w: x + F.linear(xo, w),
            [la.self_attn.o_proj.weight for la in L],
        ),
        "rms_glu gate_up": (
            lambda w, cfg: K._launch_gemv(x, w, g=g, eps=eps, glu=True, config=cfg),
            lambda w: (lambda gu: F.silu(gu[0]) * gu[1])(F.linear(rms(x, g, eps), w).chunk(2)),
            [la.mlp.gate_up_proj.weight for la in L],
        ),
        "add down": (
            lambda w, cfg: K._launch_gemv(xf, w, residual=x, config=cfg),
            lambda w: x + F.linear(xf, w),
            [la.mlp.down_proj.weight for la in L],
        ),
        "rms_f32 lm_head": (
            lambda w, cfg: K._launch_gemv(x, w, g=g, eps=eps, out_f32=True, config=cfg),
            lambda w: F.linear(rms(x, g, eps), w).float(),
            [lm.lm_head.weight] * 4,  # one matrix of 0.8 GB: larger than L2 by itself
        ),
    }


def rel_err(got, ref) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def sweep_gemv(lm, c, results, quick: bool) -> dict:
    grid = list(itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8), (1, 3)))
    if quick:
        grid = [(8, 512, 4, 1)]
    best = {}
    for kind, (launch, ref, ws) in gemv_cases(lm, c).items():
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        err = rel_err(launch(ws[0], K.DEFAULT_GEMV), ref(ws[0]))
        cublas = graph_ms(
            lambda ws=ws: [F.linear(torch.zeros(1, w.shape[1], dtype=BF16, device=DEV), w) for w in ws], 20
        )
        rows = []
        t0 = time.time()
        for cfg in grid:
            if cfg[1] > triton_next_pow2(ws[0].shape[1]):
                continue
            try:
                ms = graph_ms(lambda f=launch, ws=ws, cfg=cfg: [f(w, cfg) for w in ws], 20)
            except Exception as e:  # a config Triton cannot compile (registers): skip it, say so
                print(f"  {kind} {cfg}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                continue
            rows.append((ms, cfg))
        rows.sort()
        ms, cfg = rows[0]
        n = ws[0].shape[0] // (2 if "glu" in kind else 1)
        best[kind] = {
            "config": cfg,
            "n": n,
            "k": ws[0].shape[1],
            "us_per_call": ms * 1e3 / len(ws),
            "tb_s": nbytes / ms / 1e9,
            "cublas_us_per_call": cublas * 1e3 / len(ws),
            "cublas_tb_s": nbytes / cublas / 1e9,
            "rel_err": err,
            "top5": [(round(m * 1e3 / len(ws), 2), c_) for m, c_ in rows[:5]],
        }
        b = best[kind]
        print(
            f"{kind:16s} best {cfg}: {b['us_per_call']:.1f} us/call {b['tb_s']:.2f} TB/s | cuBLAS "
            f"{b['cublas_us_per_call']:.1f} us {b['cublas_tb_s']:.2f} TB/s | rel err {err:.1e} | "
            f"{len(rows)} configs in {time.time() - t0:.0f} s",
            flush=True,
        )
    results["gemv"] = best
    return best


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def reference_attention(q, kc, vc, pos, rep, d):
    """The exported model's written-out attention at one position (model.Attention, S = 1)."""
    kv = kc.shape[1]
    max_seq = kc.shape[2]
    qq = q.view(1, kv, rep, d)
    mask = torch.arange(max_seq, device=DEV)[None, :] <= pos[:, None]
    scores = torch.matmul(qq, kc.transpose(-1, -2)).float() * d**-0.5
    scores = scores.masked_fill(~mask.repeat_interleave(rep, dim=0), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(vc.dtype), vc).reshape(-1)


def sweep_attention(lm, c, results, fills=(512, 1000)) -> dict:
    """The fused op (RoPE, cache write, attention, split merge) against the written-out attention on the roped
    query over the cache it wrote (the reference's time leaves RoPE and the write out)."""
    rep, d = c.n_heads // c.n_kv_heads, c.head_dim
    caches = [(la.self_attn.kv_cache.k_cache, la.self_attn.kv_cache.v_cache) for la in lm.model.layers]
    qkv = torch.randn((c.n_heads + 2 * c.n_kv_heads) * d, dtype=BF16, device=DEV)
    counters = torch.zeros(16, dtype=torch.int32, device=DEV)
    out = {}
    for fill in fills:
        pos = torch.tensor([fill - 1], device=DEV)
        cos, sin = (t[0] for t in rope(pos, d, c.rope_theta, BF16))
        q = apply_rope(qkv[: c.n_heads * d].view(c.n_heads, d), cos, sin)

        def fused(p=pos, s=None, b=None, kc_vc=caches, cos=cos, sin=sin, launch=None):
            # the counters need no zeroing between calls: the last split of each head resets its count
            return [KA._launch_attention(qkv, cos, sin, kc, vc, p, counters, 0, s, b, launch) for kc, vc in kc_vc]

        ref_ms = graph_ms(lambda p=pos, q=q: [reference_attention(q, kc, vc, p, rep, d) for kc, vc in caches], 20)
        rows = []
        max_seq = caches[0][0].shape[-2]
        long = max_seq >= KA.LONG_CACHE
        grid = [
            (s, b, None) for s, b in itertools.product((1, 2, 4, 8, 16, *((32, 64) if long else ())), (32, 64, 128))
        ]
        if long:  # a long cache's fills: one program of 4 warps per SM may hold too few loads in flight
            grid += [(s, b, {"num_warps": w, "num_stages": st}) for s, b, w, st in itertools.product(
                (8, 16, 32), (64, 128), (4, 8), (2, 4))]  # fmt: skip
        for splits, bt, launch in grid:
            got = fused(pos, splits, bt, caches[:1], launch=launch)[0]
            err = rel_err(got, reference_attention(q, *caches[0], pos, rep, d))
            ms = graph_ms(lambda p=pos, s=splits, b=bt, la=launch: fused(p, s, b, launch=la), 20)
            rows.append((ms, splits, bt, err, launch or {}))
        rows.sort(key=lambda r: r[0])
        ms, splits, bt, err, launch = rows[0]
        out[fill] = {
            "splits": splits,
            "block_t": bt,
            "launch": launch,
            "us_per_layer": ms * 1e3 / len(caches),
            "reference_us_per_layer": ref_ms * 1e3 / len(caches),
            "rel_err": err,
            "max_rel_err_any_config": max(r[3] for r in rows),
            "top5": [(round(r[0] * 1e3 / len(caches), 2), r[1], r[2], r[4]) for r in rows[:5]],
        }
        o = out[fill]
        print(
            f"attention, {fill} positions: best splits={splits} BLOCK_T={bt} {launch or ''} "
            f"{o['us_per_layer']:.2f} us/layer "
            f"(written-out {o['reference_us_per_layer']:.2f}); rel err {err:.1e}, worst config "
            f"{o['max_rel_err_any_config']:.1e}",
            flush=True,
        )
    results["attention"] = out
    return out


def time_steps(lm, c, results, fill: int) -> None:
    emb = torch.randn(1, 1, c.dim, dtype=BF16, device=DEV) * 0.5
    pos = torch.tensor([fill], device=DEV)
    ref_dec, step = TextDecoder(c, lm), DecodeStep(c, lm, pdl=K.pdl_supported(torch.empty(0, device=DEV)))
    caches = [t for la in lm.model.layers for t in (la.self_attn.kv_cache.k_cache, la.self_attn.kv_cache.v_cache)]
    saved = [t.clone() for t in caches]

    def restore():
        for t, s in zip(caches, saved):
            t.copy_(s)

    out = {}
    with torch.no_grad():
        restore()
        ref = ref_dec(emb, pos)
        restore()
        got = step(emb, pos)
        out["eager_rel_err"] = rel_err(got, ref)
        out["eager_argmax_equal"] = bool(got.argmax() == ref.argmax())
        out["reference_eager_ms"] = graph_ms(lambda: ref_dec(emb, pos), 20)
        out["step_eager_ms"] = graph_ms(lambda: step(emb, pos), 20)
        print(
            f"step: eager decoder S=1 {out['reference_eager_ms']:.3f} ms | DecodeStep eager "
            f"{out['step_eager_ms']:.3f} ms | rel err {out['eager_rel_err']:.1e} argmax equal "
            f"{out['eager_argmax_equal']}",
            flush=True,
        )
        t0 = time.time()
        compiled = torch.compile(step, fullgraph=True)
        restore()
        got = compiled(emb, pos)
        out["compile_s"] = time.time() - t0
        out["compiled_rel_err"] = rel_err(got, ref)
        out["step_compiled_ms"] = graph_ms(lambda: compiled(emb, pos), 50)
        print(
            f"step: DecodeStep compiled {out['step_compiled_ms']:.3f} ms ({1e3 / out['step_compiled_ms']:.0f} tok/s) "
            f"| rel err {out['compiled_rel_err']:.1e} | compile {out['compile_s']:.0f} s",
            flush=True,
        )
    results["step"] = out


def tune_in_step(lm, c, results, fill: int, suffix: str = "") -> None:
    """Each GEMV kind's config, then attention's splits x BLOCK_T, tuned inside the whole step (eager, one CUDA
    graph), the other kinds held at the table's: in the step a kernel starts behind another's tail, which an
    isolated sweep does not see (session 12 tuned o_proj, gate_up and down this way, -0.075 ms; qkv and lm_head
    were not). Each result is kept as soon as it is measured: a failure later still leaves it in --out."""
    emb = torch.randn(1, 1, c.dim, dtype=BF16, device=DEV) * 0.5
    pos = torch.tensor([fill], device=DEV)
    pdl = K.pdl_supported(emb)  # the kernels wait (sm_90+): tune with programmatic edges
    step = DecodeStep(c, lm, pdl=pdl)
    d = c.head_dim
    keys = {  # `suffix` "_fp8": the kinds of layers on e4m3 codes (--fp8)
        "qkv": ("rms" + suffix, (c.n_heads + 2 * c.n_kv_heads) * d, c.dim),
        "o_proj": ("add" + suffix, c.dim, c.n_heads * d),
        "gate_up": ("rms_glu" + suffix, c.ffn_dim, c.dim),
        "down": ("add" + suffix, c.dim, c.ffn_dim),
        "lm_head": ("rms_f32" + suffix, c.vocab_size, c.dim),
    }
    out = results["in_step_tuning"] = {}
    with torch.no_grad():
        if pdl:  # the step with plain and with programmatic edges, alternating
            ab = {"plain": [], "pdl": []}
            for _ in range(3):
                for kind in ab:
                    ab[kind].append(graph_ms(lambda: step(emb, pos), 30, overlap=kind == "pdl"))
            out["pdl_ab"] = ab
            print(f"in-step PDL: plain {min(ab['plain']):.4f} ms/step, programmatic {min(ab['pdl']):.4f}", flush=True)
        for name, key in keys.items():
            held = K.gemv_config(*key)
            k_max = triton.next_power_of_2(key[2])
            grid = {held} | {
                (bn, bk, w, 1)
                for bn in ((4, 8, 16) if suffix else (2, 4, 8, 16))  # an e4m3 tile of 2 rows is too few bytes
                for bk in (1024, 2048, 4096)
                for w in (4, 8)
                if bk <= k_max
            }
            rows = []
            for cfg in sorted(grid):
                K.GEMV_CONFIGS[key] = cfg
                rows.append((graph_ms(lambda: step(emb, pos), 30, pdl), cfg))
            rows.sort()
            K.GEMV_CONFIGS[key] = held  # the table stays as exported; the JSON says what won
            held_ms = next(ms for ms, cfg in rows if cfg == held)
            out[name] = {"best": rows[0][1], "best_ms": rows[0][0], "held": held, "held_ms": held_ms, "top5": rows[:5]}
            print(f"in-step {name}: best {rows[0][1]} {rows[0][0]:.4f} ms/step; the table's {held} {held_ms:.4f}")
        if suffix:  # attention reads the same bf16 cache either way: tuned with the bf16 step
            return
        # attention's splits x BLOCK_T likewise: in the step its cache reads come from HBM (the GEMVs between two
        # layers stream ~240 MB through L2), in the attention sweep largely from L2. BLOCK_T 256 needs more shared
        # memory than the H200 has (274 KB, session 14).
        held = (KA.ATTN_SPLITS, KA.ATTN_BLOCK_T)
        rows = []
        for cfg in sorted({held, (1, 128), (2, 64), (2, 128), (4, 64), (4, 128), (8, 32), (8, 64)}):
            KA.ATTN_SPLITS, KA.ATTN_BLOCK_T = cfg
            rows.append((graph_ms(lambda: step(emb, pos), 30, pdl), cfg))
        KA.ATTN_SPLITS, KA.ATTN_BLOCK_T = held
        rows.sort()
        held_ms = next(ms for ms, cfg in rows if cfg == held)
        out["attention"] = {"best": rows[0][1], "best_ms": rows[0][0], "held": held, "held_ms": held_ms, "rows": rows}
        print(f"in-step attention: best {rows[0][1]} {rows[0][0]:.4f} ms/step; the table's {held} {held_ms:.4f}")


SPLITS_GRID = [(2, 128), (4, 64), (4, 128), (8, 64), (8, 128), (16, 64), (16, 128), (32, 64)]


def splits_in_step(lm, c, results, fills: list[int], max_seq: int) -> None:
    """The whole step's ms at each fill for each (splits, BLOCK_T) of SPLITS_GRID, the cache's own table first:
    both of kernels.py's counts (ATTN_SPLITS, LONG_SPLITS) set, so the cache's size does not pick. Two passes in
    alternating order; each config's best kept."""
    emb = torch.randn(1, 1, c.dim, dtype=BF16, device=DEV) * 0.5
    pdl = K.pdl_supported(emb)
    step = DecodeStep(c, lm, pdl=pdl)
    held = (KA.ATTN_SPLITS, KA.LONG_SPLITS, KA.ATTN_BLOCK_T)
    table = (KA.attention_splits(max_seq), KA.ATTN_BLOCK_T)
    grid = [table] + [g for g in SPLITS_GRID if g != table]
    out = results["splits_in_step"] = {"max_seq": max_seq, "table": table}
    try:
        with torch.no_grad():
            for fill in fills:
                pos = torch.tensor([fill], device=DEV)
                best: dict[tuple[int, int], float] = {}
                for order in (grid, grid[::-1]):
                    for cfg in order:
                        KA.ATTN_SPLITS = KA.LONG_SPLITS = cfg[0]
                        KA.ATTN_BLOCK_T = cfg[1]
                        ms = graph_ms(lambda pos=pos: step(emb, pos), 30, pdl)
                        best[cfg] = min(ms, best.get(cfg, ms))
                rows = sorted((ms, cfg) for cfg, ms in best.items())
                out[fill] = {"rows": rows, "table_ms": best[table]}
                print(
                    f"in-step splits, {fill} positions of {max_seq}: best {rows[0][1]} {rows[0][0]:.4f} ms/step; "
                    f"the table's {table} {best[table]:.4f}",
                    flush=True,
                )
    finally:
        KA.ATTN_SPLITS, KA.LONG_SPLITS, KA.ATTN_BLOCK_T = held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="one GEMV config (a smoke run)")
    ap.add_argument("--fp8", action="store_true", help="the step and tune parts with the linears in e4m3 (--quant fp8)")
    ap.add_argument("--fill", type=int, default=512, help="cache positions already written (the step)")
    ap.add_argument(
        "--attention-fills", default="512,1000", help="cache fills for the attention sweep (the bench decodes 385-512)"
    )
    ap.add_argument(
        "--max-seq",
        type=int,
        default=1024,
        help="the caches' positions (10240: the 10-minute bundle's; 32 and 64 "
        "splits join the attention sweep from 4096)",
    )
    ap.add_argument(
        "--parts",
        default="gemv,attention,step",
        help="which of gemv,attention,step,tune (in-step GEMV tuning),splits (in-step attention splits) to run",
    )
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    known = {"gemv", "attention", "step", "tune", "splits"}
    if parts - known:
        ap.error(f"--parts: unknown {sorted(parts - known)}")
    try:
        fills = [int(f) for f in args.attention_fills.split(",")]
    except ValueError:
        ap.error(f"--attention-fills: comma-separated integers, got {args.attention_fills!r}")
    cap = args.max_seq
    if not all(1 <= f <= cap for f in fills) or not 0 <= args.fill < cap:  # the sweep's caches hold --max-seq
        ap.error(f"--attention-fills: 1 to {cap} positions each; --fill: a position from 0 to {cap - 1}")
    if args.fp8 and parts - {"step", "tune"}:
        ap.error("--fp8: only the step and tune parts run on e4m3 codes")
    c = TextConfig()
    lm = build(c, cap, max(fills + [args.fill + 1]))
    if args.fp8:
        to_fp8(lm)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fp8": args.fp8}
    try:
        if "gemv" in parts:  # the best configs replace the table's for the step below
            best = sweep_gemv(lm, c, results, args.quick)
            for kind, b in best.items():
                K.GEMV_CONFIGS[(kind.split()[0], b["n"], b["k"])] = tuple(b["config"])
        if "attention" in parts:
            sweep_attention(lm, c, results, fills)
            results["attention_table_config"] = (KA.ATTN_SPLITS, KA.ATTN_BLOCK_T)
            print(
                f"attention: the table's config is {KA.ATTN_SPLITS} x {KA.ATTN_BLOCK_T}; the step uses it", flush=True
            )
        if "step" in parts:
            time_steps(lm, c, results, args.fill)
        if "tune" in parts:
            tune_in_step(lm, c, results, args.fill, "_fp8" if args.fp8 else "")
        if "splits" in parts:
            splits_in_step(lm, c, results, fills, cap)
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
