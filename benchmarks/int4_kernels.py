"""The int4 decode GEMVs (`runner/export/kernels_int4.py`) on the H200, at the 3B shapes.

1. check: each int4 kind against the dequantised weight in float64 (the kernel's roundings applied), error
   relative to the output's scale, and against the bf16 kernel on the dequantised weight.
2. gemv: (BLOCK_N, BLOCK_G, warps) per kind, each over the 30 layers' distinct weights in one CUDA graph (nothing
   served from L2), beside the bf16 kernel on the bf16 weights at its table's config.
3. step: the whole decode step (30 layers + lm_head) in one CUDA graph with programmatic edges: bf16 and int4
   DecodeStep; int4 logits against the int4 written-out decoder (dequantised in torch) at S = 1.
4. tune: each int4 kind's config tuned inside the int4 step (the others held).
5. tinygemm: aten's `_weight_int4pack_mm` (tinygemm's tensor-core kernels, in torch) at M = 1 on the same layers'
   codes (`quant.tinygemm_operands`), the plain matmul without our epilogues, beside the bf16 kernel and (when
   gemv ran first) our int4 kernel: whether a well-kept int4 kernel reaches the memory-bound speed ours does not
   (NOTES 33, 36). Its error against float64 is checked first, and its nibble order found, on the first layer.
6. agree: teacher-forced top-1 agreement of int4 with bf16: a 385-token prompt (random ids), then 128 tokens the
   bf16 step decodes greedily; int4 prefills the same prompt (torch dequant) and steps through the same tokens
   with the int4 kernels. Also the prompt's positions (all logits, both models in torch), and bf16's own step
   against its written-out decoder (the kernels' rounding alone).

    python benchmarks/int4_kernels.py --parts check,gemv,step,agree --out int4.json      (GPU; about 4 minutes)
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F

from runner.export import kernels as K
from runner.export import kernels_int4 as K4
from runner.export.decode_step import DecodeStep
from runner.export.quant import apply_quant, tinygemm_operands
from runner.models.quant_linear import QuantLinear
from runner.models.voxtral import Voxtral, rope
from runner.models.voxtral_config import preset
from runner.runtime.graphs import capture_graph

DEV, BF16 = "cuda", torch.bfloat16


def graph_ms(fn, replays: int = 30, overlap: bool = False) -> float:
    g = capture_graph(fn, DEV, overlap).graph
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def build(max_seq: int) -> tuple[Voxtral, Voxtral]:
    """The 3B preset with seeded random weights (as `--random-init`), bf16, and an int4 copy of it."""
    with torch.device("meta"):
        m = Voxtral(preset("voxtral-mini-3b"))
    m = m.to_empty(device=DEV).to(BF16).init_weights(0).eval()
    m.setup_caches(max_seq, BF16)
    q = copy.deepcopy(m)
    record = apply_quant(q, "voxtral", "int4")
    print(f"int4: {record}", flush=True)
    return m, q


def rel(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def rms(x, g, eps):
    h = x.float()
    return g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def cases(m: Voxtral, q: Voxtral):
    """kind -> (int4 launch(layer, cfg), bf16 launch(layer), reference(int4 layer), int4 layers, bf16 layers)."""
    c = m.config.text
    g = torch.Generator(device=DEV).manual_seed(1)
    x, xo, xf = (torch.randn(n, generator=g, device=DEV).to(BF16) for n in (c.dim, c.n_heads * c.head_dim, c.ffn_dim))
    r = torch.randn(c.dim, generator=g, device=DEV).to(BF16)
    norm = (1 + 0.1 * torch.randn(c.dim, generator=g, device=DEV)).to(BF16)
    eps = c.norm_eps
    lq, lb = q.language_model, m.language_model
    qa = lambda f: [f(la) for la in lq.model.layers]  # noqa: E731
    ba = lambda f: [f(la) for la in lb.model.layers]  # noqa: E731

    def deq(lin):
        return lin.dequantize(torch.float32).double()

    def bf(v):  # the kernels round each linear's output to bf16 before the epilogue
        return v.to(BF16).double()

    xn = (x.double() * torch.rsqrt(x.double().pow(2).mean() + eps)) * norm.double()
    return {
        "rms qkv": (
            lambda lin, cfg: K4._launch_int4_gemv(x, lin.qweight, lin.scales, lin.offsets, g=norm, eps=eps, config=cfg),
            lambda w: K._launch_gemv(x, w, g=norm, eps=eps),
            lambda lin: bf(deq(lin) @ xn),
            qa(lambda la: la.self_attn.qkv_proj),
            ba(lambda la: la.self_attn.qkv_proj.weight),
        ),
        "add o_proj": (
            lambda lin, cfg: K4._launch_int4_gemv(xo, lin.qweight, lin.scales, lin.offsets, residual=r, config=cfg),
            lambda w: K._launch_gemv(xo, w, residual=r),
            lambda lin: bf(bf(deq(lin) @ xo.double()) + r.double()),
            qa(lambda la: la.self_attn.o_proj),
            ba(lambda la: la.self_attn.o_proj.weight),
        ),
        "rms_glu gate_up": (
            lambda lin, cfg: K4._launch_int4_gemv(
                x, lin.qweight, lin.scales, lin.offsets, g=norm, eps=eps, glu=True, config=cfg
            ),
            lambda w: K._launch_gemv(x, w, g=norm, eps=eps, glu=True),
            lambda lin: (lambda gu: bf(F.silu(bf(gu[0])).to(BF16).double() * bf(gu[1])))((deq(lin) @ xn).chunk(2)),
            qa(lambda la: la.mlp.gate_up_proj),
            ba(lambda la: la.mlp.gate_up_proj.weight),
        ),
        "add down": (
            lambda lin, cfg: K4._launch_int4_gemv(xf, lin.qweight, lin.scales, lin.offsets, residual=r, config=cfg),
            lambda w: K._launch_gemv(xf, w, residual=r),
            lambda lin: bf(bf(deq(lin) @ xf.double()) + r.double()),
            qa(lambda la: la.mlp.down_proj),
            ba(lambda la: la.mlp.down_proj.weight),
        ),
        "rms_f32 lm_head": (
            lambda lin, cfg: K4._launch_int4_gemv(
                x, lin.qweight, lin.scales, lin.offsets, g=norm, eps=eps, out_f32=True, config=cfg
            ),
            lambda w: K._launch_gemv(x, w, g=norm, eps=eps, out_f32=True),
            lambda lin: bf(deq(lin) @ xn),
            [lq.lm_head] * 2,  # 0.2 GB of codes: four times L2 by itself
            [lb.lm_head.weight] * 2,
        ),
    }


def nbytes(lin: QuantLinear) -> int:
    return sum(t.numel() * t.element_size() for t in (lin.qweight, lin.scales, lin.offsets))


def rate(ms: float, nbytes: int, calls: int, prefix: str = "") -> dict:
    """A graph of `calls` kernels over `nbytes` of weights in `ms`: µs per call and the bandwidth it reached."""
    return {f"{prefix}us_per_call": ms * 1e3 / calls, f"{prefix}tb_s": nbytes / ms / 1e9}


def part_check(cs, results) -> None:
    out = results["check"] = {}
    for kind, (launch, launch_bf16, ref, lins, _ws) in cs.items():
        lin = lins[0]
        want = ref(lin)
        got = launch(lin, None)
        bf16_on_deq = launch_bf16(lin.dequantize(BF16))
        out[kind] = {"vs_float64": rel(got, want), "vs_bf16_kernel_on_dequantised": rel(got, bf16_on_deq)}
        print(f"check {kind:16s} vs float64 {out[kind]['vs_float64']:.2e}, vs the bf16 kernel on the dequantised "
              f"weight {out[kind]['vs_bf16_kernel_on_dequantised']:.2e}", flush=True)  # fmt: skip


def part_gemv(cs, results, grid) -> None:
    out = results["gemv"] = {}
    for kind, (launch, launch_bf16, _ref, lins, ws) in cs.items():
        b = sum(nbytes(lin) for lin in lins)
        wb = sum(w.numel() * w.element_size() for w in ws)
        bf16_ms = graph_ms(lambda ws=ws, f=launch_bf16: [f(w) for w in ws])
        n, k = lins[0].out_features // (2 if "glu" in kind else 1), lins[0].in_features
        rows = []
        for cfg in grid:
            if cfg[1] > triton_next_pow2(k // lins[0].group_size):
                continue
            try:
                ms = graph_ms(lambda f=launch, lins=lins, cfg=cfg: [f(lin, cfg) for lin in lins])
            except Exception as e:  # a config Triton cannot compile (registers): skip it, say so
                print(f"  {kind} {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            rows.append((ms, cfg))
        rows.sort()
        ms, cfg = rows[0]
        out[kind] = {
            "n": n,
            "k": k,
            "best": cfg,
            **rate(ms, b, len(lins)),
            **rate(bf16_ms, wb, len(ws), "bf16_"),
            "top5": [(round(t * 1e3 / len(lins), 2), c) for t, c in rows[:5]],
        }
        o = out[kind]
        print(f"gemv {kind:16s} best {cfg}: {o['us_per_call']:.1f} us/call {o['tb_s']:.2f} TB/s | bf16 kernel "
              f"{o['bf16_us_per_call']:.1f} us {o['bf16_tb_s']:.2f} TB/s | top5 {o['top5']}", flush=True)  # fmt: skip
        K4.INT4_CONFIGS[key_of(kind, n, k)] = cfg  # the step below runs with the winners
    results["kernels"] = compiled_kernels()


def int4pack_operands(lin: QuantLinear, high: int) -> tuple:
    """(packed codes, group size, scales_and_zeros): `_weight_int4pack_mm`'s arguments after x, in its order;
    `high` is the column (0: even, 1: odd) each byte holds in its high nibble."""
    codes, sz = tinygemm_operands(lin)
    b = (codes[:, high::2] << 4 | codes[:, 1 - high :: 2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(b, 8), lin.group_size, sz


def part_tinygemm(cs, results) -> None:
    out = results["tinygemm"] = {}
    g = torch.Generator(device=DEV).manual_seed(2)
    mm = torch.ops.aten._weight_int4pack_mm
    for kind, (_launch, _launch_bf16, _ref, lins, ws) in cs.items():
        k = lins[0].in_features
        x = torch.randn(1, k, generator=g, device=DEV).to(BF16)
        want = x.double() @ lins[0].dequantize(torch.float32).double().T
        orders = {"even-high": 0, "odd-high": 1}  # which nibble of a byte holds column 2j: found by the error
        err = {o: rel(mm(x, *int4pack_operands(lins[0], h)), want) for o, h in orders.items()}
        order = min(err, key=err.get)
        ops = [int4pack_operands(lin, orders[order]) for lin in lins]
        ms = graph_ms(lambda ops=ops, x=x: [mm(x, *op) for op in ops])
        b = sum(p.numel() * p.element_size() + sz.numel() * sz.element_size() for p, _, sz in ops)
        x1 = x[0]
        bf16_ms = graph_ms(lambda ws=ws, x1=x1: [K._launch_gemv(x1, w) for w in ws])
        wb = sum(w.numel() * w.element_size() for w in ws)
        ours = results.get("gemv", {}).get(kind, {}).get("us_per_call")
        out[kind] = {
            "n": lins[0].out_features,
            "k": k,
            "vs_float64": err[order],
            "nibble_order": order,
            "errors_by_order": err,
            **rate(ms, b, len(ops)),
            **rate(bf16_ms, wb, len(ws), "bf16_"),
            "ours_int4_us_per_call": ours,
        }
        o = out[kind]
        print(f"tinygemm {kind:16s} {o['us_per_call']:.1f} us/call {o['tb_s']:.2f} TB/s (vs float64 {err[order]:.1e}, "
              f"{order}) | bf16 kernel {o['bf16_us_per_call']:.1f} us | ours int4 {ours}", flush=True)  # fmt: skip


def key_of(kind: str, n: int, k: int):
    return (kind.split()[0], n, k)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def step_inputs(m: Voxtral, pos: int):
    g = torch.Generator(device=DEV).manual_seed(2)
    emb = (torch.randn(1, 1, m.config.text.dim, generator=g, device=DEV) * 0.5).to(BF16)
    return emb, torch.tensor([pos], device=DEV)


def part_step(m, q, results, fill: int, pdl: bool) -> None:
    out = results["step"] = {}
    emb, pos = step_inputs(m, fill)
    with torch.no_grad():
        for name, model in (("bf16", m), ("int4", q)):
            step, dec = DecodeStep(model.config.text, model.language_model, pdl=pdl), model.decoder()
            model.reset_caches()
            want = dec(emb, pos)
            model.reset_caches()
            got = step(emb, pos)
            ms = min(graph_ms(lambda step=step: step(emb, pos), 50, overlap=pdl) for _ in range(3))
            out[name] = {"ms": ms, "tok_s_step_only": 1e3 / ms, "rel_err": rel(got, want),
                         "argmax_equal": bool(got.argmax() == want.argmax())}  # fmt: skip
            print(f"step {name}: {ms:.4f} ms/step ({1e3 / ms:.0f} tok/s, the step alone) | vs its written-out "
                  f"decoder rel err {out[name]['rel_err']:.2e}, argmax equal {out[name]['argmax_equal']}", flush=True)  # fmt: skip


def part_tune(q, results, fill: int, pdl: bool) -> None:
    c = q.config.text
    emb, pos = step_inputs(q, fill)
    step = DecodeStep(c, q.language_model, pdl=pdl)
    d = c.head_dim
    keys = {
        "qkv": ("rms", (c.n_heads + 2 * c.n_kv_heads) * d, c.dim),
        "o_proj": ("add", c.dim, c.n_heads * d),
        "gate_up": ("rms_glu", c.ffn_dim, c.dim),
        "down": ("add", c.dim, c.ffn_dim),
        "lm_head": ("rms_f32", c.vocab_size, c.dim),
    }
    out = results["tune"] = {}
    with torch.no_grad():
        for name, key in keys.items():
            held = K4.INT4_CONFIGS.get(key, K4.DEFAULT_INT4)
            grid = {held} | {(bn, bg, 4, st) for bn in (2, 4, 8, 16) for bg in (4, 8) for st in (1, 2)}
            rows = []
            for cfg in sorted(grid):
                K4.INT4_CONFIGS[key] = cfg
                rows.append((graph_ms(lambda: step(emb, pos), 30, pdl), cfg))
            rows.sort()
            K4.INT4_CONFIGS[key] = rows[0][1]  # keep the winner for the next kinds
            held_ms = next(ms for ms, cfg in rows if cfg == held)
            out[name] = {"best": rows[0][1], "best_ms": rows[0][0], "held": held, "held_ms": held_ms, "top5": rows[:5]}
            print(f"tune {name}: best {rows[0][1]} {rows[0][0]:.4f} ms/step; before {held} {held_ms:.4f}", flush=True)
    results["int4_configs"] = {f"{k[0]} {k[1]}x{k[2]}": v for k, v in K4.INT4_CONFIGS.items()}


def all_logits(model: Voxtral, embeds, positions, hidden: list | None = None) -> torch.Tensor:
    """The written-out decoder's logits at every position [S, vocab] (TextDecoder keeps only the last); each
    layer's output appended to `hidden`."""
    dec = model.decoder()
    max_seq = dec.layers[0].self_attn.kv_cache.k_cache.shape[2]
    mask = torch.arange(max_seq, device=DEV)[None, :] <= positions[:, None]
    cos, sin = rope(positions, dec.c.head_dim, dec.c.rope_theta, embeds.dtype)
    x = embeds
    for layer in dec.layers:
        x = layer(x, cos, sin, positions, mask)
        if hidden is not None:
            hidden.append(x[0].float())
    return dec.lm_head(dec.norm(x[0])).float()


def compiled_kernels() -> list[dict]:
    """Registers and spills of every compiled `_gemv_kernel_int4` specialisation (Triton's per-device cache)."""
    out = []
    for cache in getattr(K4._gemv_kernel_int4, "device_caches", {}).values():
        for k in cache[0].values():
            try:
                consts = {n: v for n, v in k.src.constants.items() if isinstance(v, int | bool)}
                out.append(
                    {
                        "regs": k.n_regs,
                        "spills": k.n_spills,
                        "warps": k.metadata.num_warps,
                        **{str(a): b for a, b in consts.items()},
                    }
                )
            except Exception as e:  # another Triton's object layout: say so, keep going
                out.append({"error": f"{type(e).__name__}: {e}"})
    return out


def part_agree(m, q, results, prompt_len: int, new: int, pdl: bool) -> None:
    c = m.config.text
    g = torch.Generator(device=DEV).manual_seed(3)
    ids = torch.randint(0, c.vocab_size, (1, prompt_len), generator=g, device=DEV)
    embed = m.language_model.model.embed_tokens  # the embedding is not quantised: the same in both
    pos = torch.arange(prompt_len, device=DEV)
    out = results["agree"] = {}
    with torch.no_grad():
        m.reset_caches()
        q.reset_caches()
        hb, hq = [], []
        lb, lq = all_logits(m, embed(ids), pos, hb), all_logits(q, embed(ids), pos, hq)
        out["prompt_positions"] = prompt_len
        out["prompt_top1_agreement"] = (lb.argmax(-1) == lq.argmax(-1)).float().mean().item()
        out["prompt_top1_in_int4_top5"] = (
            (lq.topk(5, -1).indices == lb.argmax(-1)[:, None]).any(-1).float().mean().item()
        )
        # how the int4 error grows through the random layers: |h_int4 - h_bf16| / |h_bf16| per layer, and the logits
        out["hidden_rel_err_per_layer"] = [round(((a - b).norm() / b.norm()).item(), 4) for a, b in zip(hq, hb)]
        out["logits_rel_err"] = ((lq - lb).norm() / lb.norm()).item()
        out["logits_cosine"] = F.cosine_similarity(lq, lb, dim=-1).mean().item()
        print(f"agree: hidden rel err by layer {out['hidden_rel_err_per_layer']}; logits rel err "
              f"{out['logits_rel_err']:.3f}, cosine {out['logits_cosine']:.4f}", flush=True)  # fmt: skip
        # bf16 decodes greedily with its kernels; the decoder's written-out step and int4's kernels are forced
        steps = {n: DecodeStep(mod.config.text, mod.language_model, pdl=pdl) for n, mod in (("bf16", m), ("int4", q))}
        tokens, picks = [], {"bf16_decoder": [], "int4": []}
        last = {"bf16": lb[-1], "int4": lq[-1]}
        tok = int(last["bf16"].argmax())
        picks["int4"].append(int(last["int4"].argmax()))
        picks["bf16_decoder"].append(tok)
        dec_b = m.decoder()
        for i in range(new):
            tokens.append(tok)
            e, p = embed(torch.tensor([[tok]], device=DEV)), torch.tensor([prompt_len + i], device=DEV)
            ld = dec_b(e, p)  # the written-out bf16 decoder first: the step then rewrites slot p its own way
            lb_step = steps["bf16"](e, p)
            lq_step = steps["int4"](e, p)
            tok = int(lb_step.argmax())
            if i + 1 < new:
                picks["int4"].append(int(lq_step.argmax()))
                picks["bf16_decoder"].append(int(ld.argmax()))
        want = tokens  # bf16's picks: the token after the prompt, then each step's
        for name, got in picks.items():
            out[f"decode_top1_agreement_{name}"] = sum(a == b for a, b in zip(got, want)) / len(want)
        out["decode_steps"] = len(want)
    print(f"agree: prompt ({prompt_len} positions, torch) int4 vs bf16 top-1 {out['prompt_top1_agreement']:.3f}; "
          f"decode ({out['decode_steps']} teacher-forced steps, kernels) int4 vs bf16 "
          f"{out['decode_top1_agreement_int4']:.3f}; bf16 written-out vs bf16 kernels "
          f"{out['decode_top1_agreement_bf16_decoder']:.3f}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="check,gemv,step,agree")
    ap.add_argument("--fill", type=int, default=450, help="cache positions already written (step, tune)")
    ap.add_argument("--quick", action="store_true", help="one config per kind in the gemv sweep")
    args = ap.parse_args()
    parts = args.parts.split(",")
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    t0 = time.time()
    m, q = build(1024)
    print(f"built in {time.time() - t0:.0f} s", flush=True)
    pdl = K.pdl_supported(torch.empty(0, device=DEV))
    # one warp covering 8 groups (32 lanes x 4 words) or two covering 16: every row of the tile in each thread; or
    # four warps over 8 groups and more rows
    grid = [(bn, bg, 1, st) for bn, bg in ((4, 8), (8, 8), (8, 4), (16, 4)) for st in (1, 2)]
    grid += [(4, 16, 2, 2), (8, 16, 2, 2), (16, 8, 4, 1), (16, 8, 4, 2), (8, 8, 4, 2)]
    grid = [K4.DEFAULT_INT4] if args.quick else grid
    try:
        for part in parts:
            t0 = time.time()
            with torch.no_grad():
                if part in ("check", "gemv", "tinygemm"):
                    cs = cases(m, q)
                    {"check": part_check, "gemv": lambda c, r: part_gemv(c, r, grid), "tinygemm": part_tinygemm}[part](
                        cs, results
                    )
                elif part == "step":
                    part_step(m, q, results, args.fill, pdl)
                elif part == "tune":
                    part_tune(q, results, args.fill, pdl)
                elif part == "agree":
                    part_agree(m, q, results, 385, 128, pdl)
                else:
                    ap.error(f"unknown part {part}")
            print(f"[{part}: {time.time() - t0:.0f} s]", flush=True)
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
